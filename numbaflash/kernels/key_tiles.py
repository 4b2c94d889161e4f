"""The key tiles a forward block visits: every tile of its visible range, or a block mask's non-empty ones.

``key_tiles(mods, BLOCK_M, BLOCK_N)`` gives ``(count, start, full)``, device functions of the kernel's
``mod`` argument (`kernels.mods`), the block's batch element, head, first row and visible key range
``[lo, hi)`` (from `blocks.query_block`):

* ``count(mod, b, h, row_start, lo, hi)``: how many tiles the block visits (0: none);
* ``start(mod, b, h, row_start, n_base, it)``: the first key of the ``it``-th (``n_base``: the first key of
  the first tile without a block mask, ``(lo // BLOCK_N) * BLOCK_N``);
* ``full(mod, b, h, row_start, it)``: whether ``mask_mod`` and the causal/window mask show all of it
  (`BlockMask.unmasked`: no kernel tests a score there); False without a block mask.

`tile_order` gives the order v5's forward visits them in (ALiBi's blocks start beside their diagonal).

With a block mask (``mods.block_sparse``) ``mod[0]`` is `numbaflash.block_sparsity.BlockMask.key_tiles`'s
``(table, bits)``, made for these tiles and the call's causal/window mask: entry 0 of a query tile is its
count, entries 1.. are ``2 * key tile + full`` and, after them, each partial tile's slot in ``bits``:
`verdict_slot`, `verdict_word` and `shown` read them for the forwards' `softmax.steps` mask, the dQ pass's
`gradients.row_steps` and the CUDA-core kernels (`simt`, the backward passes through `thread_verdicts`), which ask
mask_mod nothing on a block-masked call. The last entry of row ``x`` is the query tile that the grid's block ``x``
runs (`grid_tile`).

Skipping mask_mod on full tiles costs registers, as the choice between the two paths is made per tile: with
``full`` from the table, ptxas 13.0 kept 124 bytes of local memory in v5's forward at headdim 128 with a
causal block mask (0 where every visited tile asks the mask_mod). The skip still ran faster (H100, fp16,
N = 16384, 16 heads, .bench/fullskip.py; time over the built-in causal's): a causal block mask 1.22x forward
at headdim 64 and 128 against 2.28x and 1.28x asking mask_mod everywhere, 8 documents 0.42-0.43x against
0.54-0.71x; backward 1.38-1.53x against 1.31-1.45x, 8 documents 0.37-0.39x against 0.50-0.52x. Reading the
partial tiles' verdicts from bits instead of calling mask_mod took that forward's spill stores at headdim 128
from 124 to 8 bytes with a causal block mask and from 596 to 8 with 8 documents' mask_mod (ptxas 13.0,
sm_90a, `.bench/c128.py`): its code no longer depends on the mask_mod.
"""

from numba import types

from .intrinsics import device_function


@device_function
def _entry(table, b, h, block, i):
    # Unsigned indices into a C-contiguous table: with signed ones and strides, each lookup paid numba's
    # negative-index wraparound and 64-bit stride products (about 40 instructions before each tile's wait in
    # v5's forward), and a causal block mask's forward executed 21% more instructions than the built-in
    # causal's (ncu, H200, headdim 64, N = 16384). Now its loop's lookups run on the uniform datapath: the
    # causal block mask went from 1.18-1.22x to 1.04x the built-in causal's time forward and from 1.22-1.28x
    # to 1.06x backward at headdim 64 (H200, bench_mods --timing stream), and the dK/dV pass at headdim 128
    # lost its 280 bytes of local memory (ptxas 13.0).
    return table[types.uint64(b if table.shape[0] > 1 else 0), types.uint64(h if table.shape[1] > 1 else 0),
                 types.uint64(block), types.uint64(i)]


def table_entry(BLOCK_M):
    """``entry(mod, b, h, start, i)``: entry ``i`` of the block-mask table (``mod[0][0]``) of the block of ``BLOCK_M``
    rows (or keys) from ``start``, for batch element ``b`` and head ``h`` (a table's axis of 1 serves all)."""
    @device_function
    def entry(mod, b, h, start, i):
        return _entry(mod[0][0], b, h, start // BLOCK_M, i)

    return entry


@device_function
def grid_tile(mod, b, h, x):
    """The query tile that block ``x`` of head ``h``'s row of a block-masked grid runs (forward, dQ): the last entry
    of the table's row ``x`` (`numbaflash.block_sparsity.BlockMask.grid_order`)."""
    table = mod[0][0]
    return _entry(table, b, h, x, table.shape[3] - 1)


def key_tiles(mods, BLOCK_M, BLOCK_N):
    if mods.block_sparse:
        entry = table_entry(BLOCK_M)

        @device_function
        def count(mod, b, h, row_start, lo, hi):
            return entry(mod, b, h, row_start, 0) if lo < hi else 0

        @device_function
        def start(mod, b, h, row_start, n_base, it):
            return (entry(mod, b, h, row_start, 1 + it) >> 1) * BLOCK_N

        @device_function
        def full(mod, b, h, row_start, it):
            return (entry(mod, b, h, row_start, 1 + it) & 1) == 1
    else:
        @device_function
        def count(mod, b, h, row_start, lo, hi):
            return (hi - (lo // BLOCK_N) * BLOCK_N + BLOCK_N - 1) // BLOCK_N if lo < hi else 0

        @device_function
        def start(mod, b, h, row_start, n_base, it):
            return n_base + it * BLOCK_N

        @device_function
        def full(mod, b, h, row_start, it):
            return False

    return count, start, full


def tile_order(mods, BLOCK_M, BLOCK_N):
    """``order(it, row_start, n_base, ntiles, seqlen_q, seqlen_k)``: the tile (for ``start``, ``full`` and the
    verdicts' ``slot``) a forward block visits at iteration ``it`` of ``ntiles``.

    With ALiBi the block starts at the last tile wholly left of its first row's diagonal (key ``row + seqlen_k -
    seqlen_q``, where the bias -slope |distance| peaks), goes left from there, then visits the rest in ascending
    order: the tiles across the block's diagonal, then those right of it. So its rows' maxima are found at once
    and move past `softmax.RESCALE_LOG2` about once (on the diagonal), where in ascending order a steep head's
    moved at every tile up to the diagonal (the bias rises by slope x BLOCK_N per tile), each move rescaling the
    output; and a causal block's masked tiles come last, as the plain kernel's do. Starting at the middle row's
    diagonal tile instead, the tile the mask crosses opened the pipeline, where its softmax overlaps no product:
    v5's causal ALiBi forward at headdim 64 went from 1.14-1.18x to 1.07-1.09x the built-in causal's time (with the
    column term of `wgmma.alibi_columns`; H100, fp16, N = 16384, 16 heads, .bench/alibi_ab.py), at 128 from
    0.94-0.97x to 0.97-1.02x.
    Otherwise ``it``: a block mask's table lists its own order, and packed sequences keep theirs (the producer
    zeroes the rows past a sequence in the last tile it copies)."""
    if mods.alibi and not mods.block_sparse and not mods.packed:
        @device_function
        def order(it, row_start, n_base, ntiles, seqlen_q, seqlen_k):
            left = min(max((row_start + seqlen_k - seqlen_q - n_base) // BLOCK_N, 0), ntiles)  # tiles left of it
            return left - 1 - it if it < left else it
    else:
        @device_function
        def order(it, row_start, n_base, ntiles, seqlen_q, seqlen_k):
            return it

    return order


def verdict_slot(mods, BLOCK_M):
    """``slot(mod, b, h, row_start, it)``: the slot of the ``it``-th key tile's verdicts in the block mask's bits
    (-1 for a full tile, and without a block mask); for a dK/dV pass (`query_tiles`, whose table has the same
    layout) ``slot(mod, b, hk, key_start, it)``, of its ``it``-th visit."""
    if mods.block_sparse:
        entry = table_entry(BLOCK_M)

        @device_function
        def slot(mod, b, h, row_start, it):
            return entry(mod, b, h, row_start, mod[0][0].shape[3] // 2 + 1 + it)
    else:
        @device_function
        def slot(mod, b, h, row_start, it):
            return -1

    return slot


def verdict_word(mods):
    """``word(mod, slot, r, col, t)``: the word of the verdicts in ``slot`` that holds row ``r``'s tile columns
    ``col ..`` (``col`` a multiple of 8: an 8-column chunk never straddles two 32-bit words), shifted for
    fragment lane ``4 g + t`` (its columns ``col + 2 t``, ``+ 1``), for `shown` to read (a device function cannot
    return the bits array itself: numba returns only arrays passed in). A CUDA-core thread passes ``t = 0`` and
    its first column, its ``thread_n`` columns (a divisor of 32) lying in one word."""
    if mods.block_sparse:
        @device_function
        def word(mod, slot, r, col, t):
            return mod[0][1][types.uint64(slot), types.uint64(r), types.uint64(col // 32)] >> types.int32(2 * t)
    else:
        @device_function
        def word(mod, slot, r, col, t):
            return types.int32(0)

    return word


def thread_verdicts(mods, BLOCK_M, ROWS):
    """``visit(words, mod, b, h, start, it, row, col)``: whether the block mask shows the ``it``-th visit of the block
    at ``start`` whole (`verdict_slot`'s arguments; False without a block mask, as `key_tiles`' ``full``), and where
    it does not, a CUDA-core thread's verdict words of its ``ROWS`` rows from ``row`` (a dK/dV pass's keys) and its
    columns from ``col``, which lie in one word, into ``words`` for `shown`. The visit's slot says both (-1: whole),
    so the table's full bit is not read."""
    slot_of, word_of = verdict_slot(mods, BLOCK_M), verdict_word(mods)
    SPARSE = mods.block_sparse

    @device_function
    def visit(words, mod, b, h, start, it, row, col):
        if not SPARSE:
            return False
        slot = slot_of(mod, b, h, start, it)
        if slot >= 0:
            for a in range(ROWS):
                words[a] = word_of(mod, slot, row + a, col, 0)
        return slot < 0

    return visit


@device_function
def shown(word, col, e):
    """Whether `verdict_word`'s ``word`` for columns ``col ..`` shows the lane's column ``col + 2 t + e`` (int32
    words: the right shifts copy the sign bit into bits no test reads). Reading the lane's two bits as one
    ``& 3`` pair instead took v5's block-masked forward from 6103 to 7618 instructions at headdim 64 (ptxas 13.0)."""
    return (word >> types.int32(col % 32 + e)) & types.int32(1) != 0
