"""Kernel v2: FlashAttention-2 forward on the tensor cores (mma.sync m16n8k16), float16 and bfloat16.

One thread block of ``WARPS`` warps per (query block, head, batch element); each warp owns ``M_TILES``
m-tiles of 16 query rows, so the online softmax needs no communication between warps. Per key tile a
warp computes its 16 M_TILES x BLOCK_N scores S = Q K^T as mma fragments (float32 accumulators in
registers), masks and exponentiates them in registers, repacks them as the 16-bit A operand of P V
(the accumulator layout of two n-tiles is exactly the A layout of one k-step), and adds P V into its
16 M_TILES x D output fragments (the two products are `mma.tiles`'s ``scores`` and ``accumulate``).

K and V tiles are double-buffered: while a tile is computed, the next one is in flight with cp.async
(16 bytes per copy, straight to shared memory).
"""

from numba import cuda, types

from ...mods import NONE
from ..blocks import TENSOR_CORE_FORWARD, query_blocks, write_hidden_rows
from ..intrinsics import cp_async_commit, cp_async_wait_all, cp_async_wait_one
from ..fragments import fragment_writer
from .tiles import lane_offsets, products, row_stride, stager
from ..key_tiles import key_tiles, verdict_slot
from ..sequences import forward_operands
from ..mods import kernel_type, modifiers
from ..softmax import steps

# The mma.sync kernels write their outputs two bytes a store: with `fragments.fragment_writer`'s 4-byte stores
# beside them, accumulators went to local memory (ptxas 13.0, sm_90: 256 bytes of stack in the dK/dV kernel at headdim
# 32, 512-528 in the forward at 128 and 256 and the dQ kernel at 128), where the wgmma kernels kept none.
PAIRED_STORES = False


def layout(D, tiles):
    """Row stride (halves) and offsets of Q (block_m rows), K (two stages) and V (two stages)."""
    ld = row_stride(D)
    sizes = (tiles.block_m * ld, 2 * tiles.block_n * ld, 2 * tiles.block_n * ld)
    return ld, tuple(sum(sizes[:i]) for i in range(4))


def smem_elements(D, tiles):
    return layout(D, tiles)[1][-1]


def build(D, tiles, storage, mods=NONE):
    """The kernel for padded head dim ``D`` (a multiple of 16), `MmaTiles` and float16/bfloat16, and its signature."""
    operands = forward_operands(mods)
    PACKED = mods.packed
    BLOCK_M, BLOCK_N, WARPS, M = tiles.block_m, tiles.block_n, tiles.warps, tiles.m_tiles
    ROWS = 16 * M  # query rows per warp
    THREADS = 32 * WARPS
    LD, (Q_AT, K_AT, V_AT, END) = layout(D, tiles)
    NT, DT = BLOCK_N // 8, D // 8
    M_DT, M_NT, M_ROWS = M * DT, M * NT, 2 * M  # fragment rows of O and S; a lane's rows (g and g + 8 per m-tile)
    stage = stager(D, THREADS)
    scores, accumulate = products(BLOCK_N, D, storage, M)
    write_out = fragment_writer(D, storage, paired=PAIRED_STORES)
    prepare = modifiers(mods, types.float32, fast=True).prepare
    start, mask, online_softmax, rescale_o, finish, write_lse = steps(M, NT, DT, mods)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    SPARSE = mods.block_sparse

    query_block = query_blocks(mods)

    def attention_forward_mma(q, k, v, out, lse, scale_log2, left, right, vec, mod):
        # q, out: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv, headdim)
        # lse: (batch, nheads, seqlen_q)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, out, lse = operands(mod, cuda.blockIdx.z, q, k, v, out, lse)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3

        if lo >= hi:  # the mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, types.uint16(0), tid, THREADS)
            return
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if SPARSE and ntiles <= 0:  # the block mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, types.uint16(0), tid, THREADS)
            return

        smem = cuda.shared.array(0, types.uint16)
        n_first = tile_start(mod, b, h, row_start, n_base, 0)
        stage(smem, Q_AT, q, b, row_start, h, BLOCK_M, tid, vec)
        stage(smem, K_AT, k, b, n_first, hk, BLOCK_N, tid, vec)
        stage(smem, V_AT, v, b, n_first, hk, BLOCK_N, tid, vec)
        cp_async_commit()

        acc = cuda.local.array((M_DT, 4), types.float32)  # O fragments: ROWS x D per warp
        s = cuda.local.array((M_NT, 4), types.float32)  # S fragments: ROWS x BLOCK_N per warp
        frag = cuda.local.array((M, 4), types.uint32)  # A fragments of the warp's m-tiles (`products`)
        # Row r of m_i, l_i is row `fragments.lane_row(r, g)` of the warp's ROWS.
        m_i = cuda.local.array(M_ROWS, types.float32)
        l_i = cuda.local.array(M_ROWS, types.float32)
        alpha = cuda.local.array(M_ROWS, types.float32)
        shift = cuda.local.array((M_ROWS, 2), types.float32)  # ALiBi's row terms (`softmax`)
        start(acc, m_i, l_i)
        a_off, b_off, t_off = lane_offsets(lane, LD)
        warp_row = row_start + warp * ROWS
        q_at = Q_AT + warp * ROWS * LD + a_off

        for it in range(ntiles):
            n_start = tile_start(mod, b, h, row_start, n_base, it)
            k_base = K_AT + (it % 2) * BLOCK_N * LD
            v_base = V_AT + (it % 2) * BLOCK_N * LD
            if it + 1 < ntiles:
                # The other stage was last read in the previous iteration, which ended with a barrier.
                n_next = tile_start(mod, b, h, row_start, n_base, it + 1)
                stage(smem, K_AT + ((it + 1) % 2) * BLOCK_N * LD, k, b, n_next, hk, BLOCK_N, tid, vec)
                stage(smem, V_AT + ((it + 1) % 2) * BLOCK_N * LD, v, b, n_next, hk, BLOCK_N, tid, vec)
                cp_async_commit()
                cp_async_wait_one()  # this tile has landed; the next may still be in flight
            else:
                cp_async_wait_all()
            cuda.syncthreads()  # every thread's copies of this tile (and of Q) are visible

            scores(s, frag, smem, q_at, k_base + b_off)

            mask(s, shift, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left, right,
                 scale_log2, bh, tile_full(mod, b, h, row_start, it), mod, tile_slot(mod, b, h, row_start, it))
            online_softmax(s, shift, m_i, l_i, alpha, scale_log2, bh)
            rescale_o(acc, alpha)
            accumulate(acc, s, frag, smem, v_base + t_off)  # O += P V, P rounded to 16 bits
            cuda.syncthreads()  # this stage is free for the copy issued at the top of the next iteration

        # One normalization at the end; O and LSE written once.
        inv = cuda.local.array(M_ROWS, types.float32)
        finish(acc, l_i, inv)
        for mi in range(M):
            write_out(out, b, warp_row + 16 * mi, h, acc, mi, inv[2 * mi], inv[2 * mi + 1], g, t)
        write_lse(lse, b, h, warp_row, g, t, m_i, l_i, scale_log2, bh)

    return attention_forward_mma, TENSOR_CORE_FORWARD + (kernel_type(mods, types.float32),)
