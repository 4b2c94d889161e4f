"""What a thread block of the attention kernels works on, read from its block index.

The grids `numbaflash.tiling` launches put a query block (forward, dQ) or a key block (dK/dV) on
blockIdx.x, a head on y and a batch element on z. These functions turn that into the block's rows,
heads and visible range, with the bounds of `numbaflash.masks`, so every kernel derives them alike.
Kernels pass ``cuda.blockIdx`` in (under the simulator only a kernel's own globals see the simulated
block index):

* `query_blocks(mods)`: ``query_block``, a block of query rows and the keys at least one of them sees.
* `key_block`: a block of keys and the query rows that see at least one of them.
* `TENSOR_CORE_FORWARD`, `tensor_core_backward`: the launch signatures the tensor-core kernels share.
* `write_hidden_rows`: what a forward block writes for query rows whose every key the mask hides (by
  flash-attn's convention out = 0 and LSE = -inf; such a block loads nothing).
"""

import math

from numba import types

from .. import masks
from .intrinsics import device_function
from .key_tiles import grid_tile
from .mods import kernel_type

_BITS = types.Array(types.uint16, 4, "A")
# The signature of both tensor-core forwards: q, k, v, out as 16-bit words; lse; softmax_scale * log2(e);
# the window's left and right; whether tiles are staged in vectors.
TENSOR_CORE_FORWARD = (_BITS, _BITS, _BITS, _BITS, types.Array(types.float32, 3, "A"), types.float32, types.int64,
                       types.int64, types.boolean)


def tensor_core_backward(n_outputs, mods):
    """The signature of the tensor-core backward kernels: q, k, v, dout as 16-bit words; lse and delta;
    ``n_outputs`` gradients; then as the forward's, with the modifications' values last."""
    stat = types.Array(types.float32, 3, "A")
    return ((_BITS,) * 4 + (stat, stat) + (_BITS,) * n_outputs
            + (types.float32, types.int64, types.int64, types.boolean, kernel_type(mods, types.float32)))


def query_blocks(mods):
    """``query_block(block, q, k, block_m, left, right, mod)`` for the kernels of ``mods``: ``(b, h, hk, row_start,
    row_end, lo, hi)``, the batch element, the query head and its kv head (GQA), the block's rows ``[row_start,
    row_end)`` and the keys ``[lo, hi)`` seen by at least one of them (none when ``lo >= hi``). q: (batch, seqlen_q,
    nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim).

    The blocks that visit the most key tiles come first: blocks start in blockIdx.x order, so the longest ones no
    longer start last and leave SMs idle at the end of the grid. Without a block mask those are the last rows (under
    a causal mask they see the most keys); with one, the block mask's table orders them (`key_tiles.grid_tile`)."""
    if mods.block_sparse:
        @device_function
        def query_block(block, q, k, block_m, left, right, mod):
            return _query_rows(block, q, k, block_m, left, right, grid_tile(mod, block.z, block.y, block.x))
    else:
        @device_function
        def query_block(block, q, k, block_m, left, right, mod):
            last = (q.shape[1] + block_m - 1) // block_m - 1
            return _query_rows(block, q, k, block_m, left, right, last - block.x)

    return query_block


@device_function
def _query_rows(block, q, k, block_m, left, right, tile):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    h, b = block.y, block.z
    hk = h // (q.shape[2] // k.shape[2])
    row_start = tile * block_m
    row_end = min(row_start + block_m, seqlen_q)
    lo, hi = masks.block_key_range(row_start, row_end, seqlen_q, seqlen_k, left, right)
    return b, h, hk, row_start, row_end, lo, hi


@device_function
def key_block(block, q, k, block_m, left, right):
    """``(b, hk, key_start, q_lo, q_hi)``: the batch element, the kv head, the first of the block's keys
    ``[key_start, key_start + block_m)`` and the query rows ``[q_lo, q_hi)`` that see at least one of them."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    hk, b = block.y, block.z
    key_start = block.x * block_m
    key_end = min(key_start + block_m, seqlen_k)
    q_lo, q_hi = masks.query_range(key_start, key_end, seqlen_q, seqlen_k, left, right)
    return b, hk, key_start, q_lo, q_hi


@device_function
def write_hidden_rows(out, lse, b, h, row_start, row_end, zero, tid, threads):
    """``out[b, row_start:row_end, h, :] = zero`` and ``lse[b, h, row_start:row_end] = -inf``, by the block's
    ``threads`` threads together (consecutive threads write consecutive head-dim elements)."""
    headdim = out.shape[3]
    for e in range(tid, (row_end - row_start) * headdim, threads):
        i = e // headdim
        out[b, row_start + i, h, e - i * headdim] = zero
        if e - i * headdim == 0:
            lse[b, h, row_start + i] = -math.inf
