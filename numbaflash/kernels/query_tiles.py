"""The query tiles a backward's key block visits: every tile of its visible range for each query head of its
GQA group, or a block mask's non-empty ones. The dK/dV passes' counterpart of `key_tiles`.

``query_tiles(mods, BLOCK_M, BLOCK_N)`` (``BLOCK_M`` keys per block, ``BLOCK_N`` query rows per streamed
tile) gives ``(count, tile, full)``, device functions of the kernel's ``mod`` argument (`kernels.mods`), the
block's batch element, kv head and first key, and from `blocks.key_block` the query rows ``[q_lo, q_hi)``
that see its keys:

* ``count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q)``: how many (query head, query tile) visits
  the block makes (0: none, and dK = dV = 0);
* ``tile(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it)``: the ``it``-th visit's query head and
  first row, heads in order and each head's tiles ascending;
* ``full(mod, b, hk, key_start, it)``: whether ``mask_mod`` and the causal/window mask show all of it
  (`BlockMask.unmasked`: no kernel tests a score there); False without a block mask.

With a block mask (``mods.block_sparse``) ``mod[0]`` is `numbaflash.block_sparsity.BlockMask.query_tiles`'s
``(table, bits)``, made for these tiles, the call's causal/window mask and GQA group: entry 0 of a key block
is its count, entries 1.. are ``2 * (j * query tiles + query tile) + full`` for the group's ``j``-th head, and
after them each partial visit's slot in ``bits``, as `key_tiles` lays out its table, so that
`key_tiles.verdict_slot` reads it; the bits are transposed (a row per key, a bit per query row), which
`key_tiles.verdict_word` and `shown` read for the tensor-core dK/dV passes (`gradients.transposed_steps`).
"""

from .intrinsics import device_function
from .key_tiles import table_entry


def query_tiles(mods, BLOCK_M, BLOCK_N):
    if mods.block_sparse:
        entry = table_entry(BLOCK_M)  # of the key block's row, for its kv head

        @device_function
        def count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q):
            return entry(mod, b, hk, key_start, 0) if q_lo < q_hi else 0

        @device_function
        def tile(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it):
            per_head = (seqlen_q + BLOCK_N - 1) // BLOCK_N
            visit = entry(mod, b, hk, key_start, 1 + it) >> 1
            return hk * group + visit // per_head, (visit % per_head) * BLOCK_N

        @device_function
        def full(mod, b, hk, key_start, it):
            return (entry(mod, b, hk, key_start, 1 + it) & 1) == 1
    else:
        @device_function
        def count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q):
            return group * ((q_hi - (q_lo // BLOCK_N) * BLOCK_N + BLOCK_N - 1) // BLOCK_N) if q_lo < q_hi else 0

        @device_function
        def tile(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it):
            q_first = (q_lo // BLOCK_N) * BLOCK_N
            per_head = (q_hi - q_first + BLOCK_N - 1) // BLOCK_N
            return hk * group + it // per_head, q_first + (it % per_head) * BLOCK_N

        @device_function
        def full(mod, b, hk, key_start, it):
            return False

    return count, tile, full
