"""Kernel v2 backward: FlashAttention-2's gradients on the tensor cores (mma.sync m16n8k16), float16 and bfloat16.

The schedule of the CUDA-core backward (`simt.backward`), deterministic, with no atomics: D =
rowsum(dO * O) by its preprocess kernel (shared), then two tensor-core kernels.

* ``dkdv``: one block per (key block, kv head, batch element); each warp owns ``m_tiles`` m-tiles of 16
  keys. K and V stay in shared memory while query tiles (Q, dO, and the rows' LSE and D) stream past,
  double-buffered with cp.async, for every query head of the GQA group in a fixed order. Per tile a
  warp computes S^T = K Q^T, P^T = exp2(S^T scale log2(e) - LSE), dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - D) and dK += dS^T Q, all in registers: P^T and dS^T are repacked as the A
  operands of the next product (`mma.tiles`), and no score tile touches shared memory.
* ``dq``: one block per (query block, head, batch element); each warp owns ``m_tiles`` m-tiles of 16
  query rows, whose LSE and D sit in registers; K and V tiles stream past (double-buffered):
  S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K.

Registers bound the design: a warp keeps its 16 m_tiles x D dK and dV (or dQ) fragments for the whole kernel,
and a streamed tile is processed ``CHUNK`` columns at a time so that its S and dP fragments fit beside
them (`chunk`). At headdim 256, dK and dV alone would take 256 registers per thread: the plan sends
that head dim to the CUDA-core backward. P and dS are rounded to 16 bits as mma operands (as in
flash-attn); LSE, D and every accumulator are float32. With score modifications (`kernels.mods`) P is
rebuilt from the modified scores and dS carries the modification's derivative (``dlogit``).
"""

from numba import cuda, types

from ... import masks
from ...mods import NONE
from ..blocks import key_block, query_blocks, tensor_core_backward
from ..gradients import row_steps, stats_stager, transposed_steps
from ..intrinsics import cp_async_commit, cp_async_wait_all, cp_async_wait_one
from ..fragments import fill, fragment_writer
from .forward import PAIRED_STORES
from ..key_tiles import key_tiles, verdict_slot
from ..mods import modifiers
from ..query_tiles import query_tiles
from ..sequences import dkdv_operands, dq_operands
from .tiles import lane_offsets, products, row_stride, stager

MAX_HEADDIM = 128  # dK and dV fragments: 2 x D / 2 float32 registers per thread


def chunk(tiles):
    """Columns of a streamed tile per S/dP fragment (16 m_tiles x CHUNK per warp): 32 for one m-tile, 16 for two.

    32 measured fastest on the H200 with one m-tile (fp16 backward, N = 4096, TFLOP/s for chunks of 16
    / 32 / 64): 114 / 120 / 113 at headdim 64, 120 / 140 / - at 128, where 32 keeps the dK/dV kernel at
    254 registers with no local memory. Smaller chunks re-read K and V (or Q and dO) from shared
    memory more often; larger ones cost registers and occupancy. Two m-tiles keep the same 32 x 32
    score fragments per warp (ptxas spilled 16 bytes of the dK/dV kernel at headdim 64 with 2 x 32).
    """
    return min(tiles.block_n, 32 // tiles.m_tiles)


def layout_dkdv(D, tiles):
    """Offsets (halves): LSE and D of two query tiles (float32), K and V (block_m rows), Q and dO (two stages)."""
    ld = row_stride(D)
    sizes = (2 * 2 * tiles.block_n * 2, tiles.block_m * ld, tiles.block_m * ld, 2 * tiles.block_n * ld,
             2 * tiles.block_n * ld)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def layout_dq(D, tiles):
    """Offsets (halves): Q and dO (block_m rows), K and V (two stages of block_n rows)."""
    ld = row_stride(D)
    sizes = (tiles.block_m * ld, tiles.block_m * ld, 2 * tiles.block_n * ld, 2 * tiles.block_n * ld)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def smem_elements_dkdv(D, tiles):
    return layout_dkdv(D, tiles)[-1]


def smem_elements_dq(D, tiles):
    return layout_dq(D, tiles)[-1]


def build_dkdv(D, tiles, storage, mods=NONE):
    operands = dkdv_operands(mods)
    PACKED = mods.packed
    BLOCK_M, BLOCK_N, WARPS, M = tiles.block_m, tiles.block_n, tiles.warps, tiles.m_tiles
    ROWS = 16 * M  # keys per warp, of the block's BLOCK_M; BLOCK_N queries per streamed tile
    THREADS, LD, CHUNK = 32 * WARPS, row_stride(D), chunk(tiles)
    STATS = 2 * BLOCK_N  # LSE and D of a query tile, staged by threads tid, tid + THREADS, ...
    load_stats, store_stats, PER_THREAD = stats_stager(BLOCK_N, THREADS)
    STATS_AT, K_AT, V_AT, Q_AT, DO_AT, END = layout_dkdv(D, tiles)
    NT, DT = CHUNK // 8, D // 8
    M_NT, M_DT = M * NT, M * DT  # fragment rows of S and dK
    stage = stager(D, THREADS)
    scores, accumulate = products(CHUNK, D, storage, M)
    write_grad = fragment_writer(D, storage, paired=PAIRED_STORES)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    probabilities, ds = transposed_steps(M, NT, mods)
    tile_count, tile_of, tile_full = query_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    ZERO, ONE = types.float32(0), types.float32(1)

    def attention_backward_dkdv_mma(q, k, v, dout, lse, delta, dk, dv, scale_log2, left, right, vec, mod):
        # q, dout: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v, dk, dv: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, dout, lse, delta, dk, dv = operands(mod, cuda.blockIdx.z, q, k, v, dout, lse, delta, dk, dv)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        b, hk, key_start, q_lo, q_hi = key_block(cuda.blockIdx, q, k, BLOCK_M, left, right)
        if PACKED and key_start >= seqlen_k:  # past its sequence's key blocks: the grid covers the longest
            return
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3

        dk_acc = cuda.local.array((M_DT, 4), types.float32)  # ROWS keys x D per warp
        dv_acc = cuda.local.array((M_DT, 4), types.float32)
        fill(dk_acc, M_DT, 4, ZERO)
        fill(dv_acc, M_DT, 4, ZERO)
        a_off, b_off, t_off = lane_offsets(lane, LD)
        warp_key = key_start + warp * ROWS

        ntiles = tile_count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q)
        if ntiles > 0:  # block-uniform: no query sees these keys otherwise, and dK = dV = 0
            smem = cuda.shared.array(0, types.uint16)
            stats = cuda.shared.array(0, types.float32)  # the same memory: two stages of (LSE, D) x BLOCK_N
            h_next, q_next = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, 0)
            stage(smem, K_AT, k, b, key_start, hk, BLOCK_M, tid, vec)
            stage(smem, V_AT, v, b, key_start, hk, BLOCK_M, tid, vec)
            stage(smem, Q_AT, q, b, q_next, h_next, BLOCK_N, tid, vec)
            stage(smem, DO_AT, dout, b, q_next, h_next, BLOCK_N, tid, vec)
            cp_async_commit()
            next_stat = cuda.local.array(PER_THREAD, types.float32)
            load_stats(next_stat, lse, delta, b, h_next, q_next, tid)
            store_stats(stats, 0, next_stat, tid)
            k_at = K_AT + warp * ROWS * LD + a_off
            v_at = V_AT + warp * ROWS * LD + a_off
            s = cuda.local.array((M_NT, 4), types.float32)  # S^T, then P^T: ROWS keys x CHUNK queries per warp
            dp = cuda.local.array((M_NT, 4), types.float32)  # dP^T, then dS^T
            dlogit = cuda.local.array((M_NT, 4), types.float32)  # with modifications: d modified / d score
            frag = cuda.local.array((M, 4), types.uint32)  # A fragments of the warp's m-tiles (`products`)

            for it in range(ntiles):
                h, q_start = h_next, q_next
                bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
                block_full, slot = tile_full(mod, b, hk, key_start, it), tile_slot(mod, b, hk, key_start, it)
                at = (it % 2) * BLOCK_N * LD
                st = (it % 2) * 2 * BLOCK_N
                if it + 1 < ntiles:
                    # The other stage was last read in the previous iteration, which ended with a barrier.
                    h_next, q_next = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it + 1)
                    stage(smem, Q_AT + BLOCK_N * LD - at, q, b, q_next, h_next, BLOCK_N, tid, vec)
                    stage(smem, DO_AT + BLOCK_N * LD - at, dout, b, q_next, h_next, BLOCK_N, tid, vec)
                    cp_async_commit()
                    # The next tile's LSE and D go to registers now and to shared memory after this
                    # tile's products, so the load's latency hides behind them.
                    load_stats(next_stat, lse, delta, b, h_next, q_next, tid)
                    cp_async_wait_one()  # this tile has landed; the next may still be in flight
                else:
                    cp_async_wait_all()
                cuda.syncthreads()  # every thread's copies and statistics of this tile are visible

                for c0 in range(0, BLOCK_N, CHUNK):
                    c_start = q_start + c0
                    if c_start < q_hi and c_start + CHUNK > q_lo:  # block-uniform: the chunk meets a visible row
                        scores(s, frag, smem, k_at, Q_AT + at + c0 * LD + b_off)
                        probabilities(s, dp, dlogit, stats, st, st + BLOCK_N + c0, q_start, c0, warp_key, key_start,
                                      key_start + BLOCK_M, g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh,
                                      block_full, mod, slot)
                        accumulate(dv_acc, s, frag, smem, DO_AT + at + c0 * LD + t_off)  # dV += P^T dO
                        scores(dp, frag, smem, v_at, DO_AT + at + c0 * LD + b_off)
                        ds(s, dp, dlogit, stats, st + BLOCK_N + c0, t)
                        accumulate(dk_acc, dp, frag, smem, Q_AT + at + c0 * LD + t_off)  # dK += dS^T Q
                if it + 1 < ntiles:
                    store_stats(stats, STATS - st, next_stat, tid)
                cuda.syncthreads()  # this stage is free for the copies issued at the top of the next iteration

        # dK = scale dS^T Q with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_k are dropped.
        scale = natural(scale_log2)
        for mi in range(M):
            write_grad(dk, b, warp_key + 16 * mi, hk, dk_acc, mi, scale, scale, g, t)
            write_grad(dv, b, warp_key + 16 * mi, hk, dv_acc, mi, ONE, ONE, g, t)

    return attention_backward_dkdv_mma, tensor_core_backward(2, mods)


def build_dq(D, tiles, storage, mods=NONE):
    operands = dq_operands(mods)
    PACKED = mods.packed
    BLOCK_M, BLOCK_N, WARPS, M = tiles.block_m, tiles.block_n, tiles.warps, tiles.m_tiles
    ROWS = 16 * M  # query rows per warp, of the block's BLOCK_M; BLOCK_N keys per streamed tile
    THREADS, LD, CHUNK = 32 * WARPS, row_stride(D), chunk(tiles)
    Q_AT, DO_AT, K_AT, V_AT, END = layout_dq(D, tiles)
    NT, DT = CHUNK // 8, D // 8
    M_NT, M_DT, M_ROWS = M * NT, M * DT, 2 * M  # fragment rows of S and dQ; a lane's rows (g, g + 8 per m-tile)
    stage = stager(D, THREADS)
    scores, accumulate = products(CHUNK, D, storage, M)
    write_grad = fragment_writer(D, storage, paired=PAIRED_STORES)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    rows, ds = row_steps(M, NT, mods)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    ZERO = types.float32(0)

    query_block = query_blocks(mods)

    def attention_backward_dq_mma(q, k, v, dout, lse, delta, dq, scale_log2, left, right, vec, mod):
        # q, dout, dq: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, dout, lse, delta, dq = operands(mod, cuda.blockIdx.z, q, k, v, dout, lse, delta, dq)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3

        dq_acc = cuda.local.array((M_DT, 4), types.float32)  # ROWS rows x D per warp
        fill(dq_acc, M_DT, 4, ZERO)
        a_off, b_off, t_off = lane_offsets(lane, LD)
        warp_row = row_start + warp * ROWS

        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if ntiles > 0:  # block-uniform: these rows see no key otherwise, and dQ = 0
            smem = cuda.shared.array(0, types.uint16)
            n_next = tile_start(mod, b, h, row_start, n_base, 0)
            stage(smem, Q_AT, q, b, row_start, h, BLOCK_M, tid, vec)
            stage(smem, DO_AT, dout, b, row_start, h, BLOCK_M, tid, vec)
            stage(smem, K_AT, k, b, n_next, hk, BLOCK_N, tid, vec)
            stage(smem, V_AT, v, b, n_next, hk, BLOCK_N, tid, vec)
            cp_async_commit()
            lse2 = cuda.local.array(M_ROWS, types.float32)
            dsum = cuda.local.array(M_ROWS, types.float32)
            lo_r = cuda.local.array(M_ROWS, types.int64)
            hi_r = cuda.local.array(M_ROWS, types.int64)
            rows(lse2, dsum, lo_r, hi_r, lse, delta, b, h, warp_row, g, seqlen_q, seqlen_k, left, right)
            q_at = Q_AT + warp * ROWS * LD + a_off
            do_at = DO_AT + warp * ROWS * LD + a_off
            s = cuda.local.array((M_NT, 4), types.float32)  # S, then P: ROWS rows x CHUNK keys per warp
            dp = cuda.local.array((M_NT, 4), types.float32)  # dP, then dS
            frag = cuda.local.array((M, 4), types.uint32)  # A fragments of the warp's m-tiles (`products`)

            for it in range(ntiles):
                n_start = n_next
                block_full = tile_full(mod, b, h, row_start, it)
                slot = tile_slot(mod, b, h, row_start, it)
                at = (it % 2) * BLOCK_N * LD
                if it + 1 < ntiles:
                    # The other stage was last read in the previous iteration, which ended with a barrier.
                    n_next = tile_start(mod, b, h, row_start, n_base, it + 1)
                    stage(smem, K_AT + BLOCK_N * LD - at, k, b, n_next, hk, BLOCK_N, tid, vec)
                    stage(smem, V_AT + BLOCK_N * LD - at, v, b, n_next, hk, BLOCK_N, tid, vec)
                    cp_async_commit()
                    cp_async_wait_one()  # this tile has landed; the next may still be in flight
                else:
                    cp_async_wait_all()
                cuda.syncthreads()  # every thread's copies of this tile (and of Q, dO) are visible

                for c0 in range(0, BLOCK_N, CHUNK):
                    c_start = n_start + c0
                    if c_start < hi and c_start + CHUNK > lo:  # block-uniform: the chunk meets a visible key
                        scores(s, frag, smem, q_at, K_AT + at + c0 * LD + b_off)
                        scores(dp, frag, smem, do_at, V_AT + at + c0 * LD + b_off)
                        full = block_full or masks.tile_is_full(row_start, row_end, c_start, c_start + CHUNK,
                                                                seqlen_q, seqlen_k, left, right)
                        ds(s, dp, lse2, dsum, lo_r, hi_r, full, warp_row, c_start, g, t, seqlen_q, seqlen_k,
                           scale_log2, b, h, bh, block_full, mod, slot, row_start, c0)
                        accumulate(dq_acc, dp, frag, smem, K_AT + at + c0 * LD + t_off)  # dQ += dS K
                cuda.syncthreads()  # this stage is free for the copies issued at the top of the next iteration

        # dQ = scale dS K with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_q are dropped.
        scale = natural(scale_log2)
        for mi in range(M):
            write_grad(dq, b, warp_row + 16 * mi, h, dq_acc, mi, scale, scale, g, t)

    return attention_backward_dq_mma, tensor_core_backward(1, mods)
