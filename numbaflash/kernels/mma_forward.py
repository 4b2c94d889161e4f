"""Kernel v2: FlashAttention-2 forward on the tensor cores (mma.sync m16n8k16), float16 and bfloat16.

One thread block of ``WARPS`` warps per (query block, head, batch element); each warp owns 16 query rows,
so the online softmax needs no communication between warps. Per key tile a warp computes its 16 x
BLOCK_N scores S = Q K^T as mma fragments (float32 accumulators in registers), masks and exponentiates
them in registers, repacks them as the 16-bit A operand of P V (the accumulator layout of two n-tiles
is exactly the A layout of one k-step), and adds P V into its 16 x D output fragments. Q is read from
shared memory with ldmatrix, K with ldmatrix as the B operand of Q K^T (K's rows are B's columns),
V with ldmatrix.trans as the B operand of P V.

K and V tiles are double-buffered: while a tile is computed, the next one is in flight with cp.async
(16 bytes per copy, straight to shared memory). Shared-memory rows are padded by 8 halves (16 bytes),
so the 8 rows an ldmatrix reads fall in distinct banks. Scores stay raw; ``softmax_scale * log2(e)``
is folded into the exponent's FMA, and the exponential is the hardware's ex2.
"""

import math

import numpy as np
from numba import cuda, types

from .. import masks
from .intrinsics import (cp_async_16, cp_async_commit, cp_async_wait_all, cp_async_wait_one, device_function, ex2,
                         group_max, group_sum, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16, mma_f16, pack_bf16, pack_f16)


def layout(D, tiles):
    """Row stride (halves) and offsets of Q (block_m rows), K (two stages) and V (two stages)."""
    ld = D + 8
    sizes = (tiles.block_m * ld, 2 * tiles.block_n * ld, 2 * tiles.block_n * ld)
    return ld, tuple(sum(sizes[:i]) for i in range(4))


def smem_elements(D, tiles):
    return layout(D, tiles)[1][-1]


def build(D, tiles, storage):
    """The kernel for padded head dim ``D`` (a multiple of 16), `MmaTiles` and float16/bfloat16, and its signature."""
    BLOCK_M, BLOCK_N, WARPS = tiles.block_m, tiles.block_n, tiles.warps
    THREADS = 32 * WARPS
    LD, (Q_AT, K_AT, V_AT, END) = layout(D, tiles)
    NT, DT, KS, PS, CHUNKS = BLOCK_N // 8, D // 8, D // 16, BLOCK_N // 16, D // 8
    mma, pack = (mma_f16, pack_f16) if storage == "float16" else (mma_bf16, pack_bf16)
    f32 = np.float32
    ZERO, ONE, NEG_INF, LN2 = f32(0), f32(1), f32(-np.inf), f32(math.log(2.0))

    bits = types.Array(types.uint16, 4, "A")
    signature = (bits, bits, bits, bits, types.Array(types.float32, 3, "A"), types.float32, types.int64,
                 types.int64, types.boolean)

    def stage(smem, base, src, b, row0, h, rows, tid, vec):
        """``rows`` rows of one head into shared memory (stride LD); zeros past the sequence or head dim.

        With ``vec`` (head dim a multiple of 8, 16-byte aligned rows) every 16-byte chunk is one cp.async
        that lands while the warp computes; otherwise element by element, synchronously.
        """
        if vec:
            for e in range(tid, rows * CHUNKS, THREADS):
                i = e // CHUNKS
                col = (e - i * CHUNKS) * 8
                ok = row0 + i < src.shape[1] and col < src.shape[3]
                # An empty copy still needs an address; row 0, column 0 always exists.
                cp_async_16(smem, base + i * LD + col, src, (b, row0 + i if ok else 0, h, col if ok else 0),
                            16 if ok else 0)
        else:
            for e in range(tid, rows * D, THREADS):
                i = e // D
                col = e - i * D
                x = types.uint16(0)
                if row0 + i < src.shape[1] and col < src.shape[3]:
                    x = src[b, row0 + i, h, col]
                smem[base + i * LD + col] = x

    def attention_forward_mma(q, k, v, out, lse, scale_log2, left, right, vec):
        # q, out: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv, headdim)
        # lse: (batch, nheads, seqlen_q)
        seqlen_q, seqlen_k, headdim = q.shape[1], k.shape[1], q.shape[3]
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        hk = h // (q.shape[2] // k.shape[2])
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        row_start = cuda.blockIdx.x * BLOCK_M
        row_end = min(row_start + BLOCK_M, seqlen_q)
        lo, hi = masks.block_key_range(row_start, row_end, seqlen_q, seqlen_k, left, right)

        if lo >= hi:  # the mask hides every key from these rows: O = 0, LSE = -inf, nothing loaded
            for e in range(tid, (row_end - row_start) * headdim, THREADS):
                i = e // headdim
                out[b, row_start + i, h, e - i * headdim] = types.uint16(0)
                if e - i * headdim == 0:
                    lse[b, h, row_start + i] = NEG_INF
            return

        smem = cuda.shared.array(0, types.uint16)
        n_first = (lo // BLOCK_N) * BLOCK_N
        ntiles = (hi - n_first + BLOCK_N - 1) // BLOCK_N
        stage(smem, Q_AT, q, b, row_start, h, BLOCK_M, tid, vec)
        stage(smem, K_AT, k, b, n_first, hk, BLOCK_N, tid, vec)
        stage(smem, V_AT, v, b, n_first, hk, BLOCK_N, tid, vec)
        cp_async_commit()

        acc = cuda.local.array((DT, 4), types.float32)  # O fragments: 16 rows x D per warp
        s = cuda.local.array((NT, 4), types.float32)  # S fragments: 16 rows x BLOCK_N per warp
        m_i = cuda.local.array(2, types.float32)  # rows g and g + 8 of the warp's 16
        l_i = cuda.local.array(2, types.float32)
        for j in range(DT):
            for x in range(4):
                acc[j, x] = ZERO
        for half in range(2):
            m_i[half] = NEG_INF
            l_i[half] = ZERO
        # ldmatrix row addresses: lane l serves row (l % 8) of matrix l // 8.
        a_row, a_col = lane % 16, (lane // 16) * 8  # A (Q): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
        b_row, b_col = lane % 8 + (lane // 16) * 8, ((lane // 8) % 2) * 8  # B of two n-tiles (K rows)
        v_row, v_col = lane % 8 + ((lane // 8) % 2) * 8, (lane // 16) * 8  # B of P V, transposed (V rows)
        q_base = Q_AT + (warp * 16 + a_row) * LD + a_col

        for it in range(ntiles):
            n_start = n_first + it * BLOCK_N
            k_base = K_AT + (it % 2) * BLOCK_N * LD
            v_base = V_AT + (it % 2) * BLOCK_N * LD
            if it + 1 < ntiles:
                # The other stage was last read in the previous iteration, which ended with a barrier.
                stage(smem, K_AT + ((it + 1) % 2) * BLOCK_N * LD, k, b, n_start + BLOCK_N, hk, BLOCK_N, tid, vec)
                stage(smem, V_AT + ((it + 1) % 2) * BLOCK_N * LD, v, b, n_start + BLOCK_N, hk, BLOCK_N, tid, vec)
                cp_async_commit()
                cp_async_wait_one()  # this tile has landed; the next may still be in flight
            else:
                cp_async_wait_all()
            cuda.syncthreads()  # every thread's copies of this tile (and of Q) are visible

            for j in range(NT):
                for x in range(4):
                    s[j, x] = ZERO
            for kk in range(KS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, q_base + kk * 16)
                for jp in range(NT // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, k_base + (jp * 16 + b_row) * LD + kk * 16 + b_col)
                    s[2 * jp, 0], s[2 * jp, 1], s[2 * jp, 2], s[2 * jp, 3] = mma(
                        a0, a1, a2, a3, b0, b1, s[2 * jp, 0], s[2 * jp, 1], s[2 * jp, 2], s[2 * jp, 3])
                    s[2 * jp + 1, 0], s[2 * jp + 1, 1], s[2 * jp + 1, 2], s[2 * jp + 1, 3] = mma(
                        a0, a1, a2, a3, b2, b3, s[2 * jp + 1, 0], s[2 * jp + 1, 1], s[2 * jp + 1, 2], s[2 * jp + 1, 3])

            if not masks.tile_is_full(row_start, row_end, n_start, n_start + BLOCK_N, seqlen_q, seqlen_k, left, right):
                for half in range(2):
                    lo_r, hi_r = masks.key_range(row_start + warp * 16 + g + 8 * half, seqlen_q, seqlen_k, left, right)
                    for j in range(NT):
                        for e in range(2):
                            key = n_start + 8 * j + 2 * t + e
                            if key < lo_r or key >= hi_r:
                                s[j, 2 * half + e] = NEG_INF

            # Online softmax on rows g and g + 8; a row's BLOCK_N scores sit in the 4 lanes of a quad.
            for half in range(2):
                row_max = s[0, 2 * half]
                for j in range(NT):
                    row_max = max(row_max, max(s[j, 2 * half], s[j, 2 * half + 1]))
                m_new = max(m_i[half], group_max(row_max, 4))
                # A row that has seen only hidden keys keeps m = -inf; exponentiate it against 0.
                base = m_new * scale_log2 if m_new != NEG_INF else ZERO
                alpha = ex2(m_i[half] * scale_log2 - base)
                m_i[half] = m_new
                row_sum = ZERO
                for j in range(NT):
                    for e in range(2):
                        p = ex2(s[j, 2 * half + e] * scale_log2 - base)
                        s[j, 2 * half + e] = p
                        row_sum += p
                l_i[half] = l_i[half] * alpha + row_sum  # a per-lane partial sum; the quad adds them at the end
                for j in range(DT):
                    acc[j, 2 * half] *= alpha
                    acc[j, 2 * half + 1] *= alpha

            # O += P V: S's accumulators for key n-tiles 2ks, 2ks + 1 are P's A fragment for k-step ks.
            for ks in range(PS):
                a0 = pack(s[2 * ks, 0], s[2 * ks, 1])
                a1 = pack(s[2 * ks, 2], s[2 * ks, 3])
                a2 = pack(s[2 * ks + 1, 0], s[2 * ks + 1, 1])
                a3 = pack(s[2 * ks + 1, 2], s[2 * ks + 1, 3])
                for dp in range(DT // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, v_base + (ks * 16 + v_row) * LD + dp * 16 + v_col)
                    acc[2 * dp, 0], acc[2 * dp, 1], acc[2 * dp, 2], acc[2 * dp, 3] = mma(
                        a0, a1, a2, a3, b0, b1, acc[2 * dp, 0], acc[2 * dp, 1], acc[2 * dp, 2], acc[2 * dp, 3])
                    acc[2 * dp + 1, 0], acc[2 * dp + 1, 1], acc[2 * dp + 1, 2], acc[2 * dp + 1, 3] = mma(
                        a0, a1, a2, a3, b2, b3,
                        acc[2 * dp + 1, 0], acc[2 * dp + 1, 1], acc[2 * dp + 1, 2], acc[2 * dp + 1, 3])
            cuda.syncthreads()  # this stage is free for the copy issued at the top of the next iteration

        # One normalization at the end; O and LSE written once.
        for half in range(2):
            l_row = group_sum(l_i[half], 4)
            row = row_start + warp * 16 + g + 8 * half
            if row < seqlen_q:
                inv = ONE / l_row if l_row > ZERO else ZERO
                for j in range(DT):
                    col = 8 * j + 2 * t
                    word = pack(acc[j, 2 * half] * inv, acc[j, 2 * half + 1] * inv)
                    if col < headdim:
                        out[b, row, h, col] = types.uint16(word & 0xFFFF)
                    if col + 1 < headdim:
                        out[b, row, h, col + 1] = types.uint16(word >> 16)
                if t == 0:
                    lse[b, h, row] = ((m_i[half] * scale_log2 + math.log2(l_row)) * LN2
                                      if l_row > ZERO else NEG_INF)

    device_function(stage)
    return attention_forward_mma, signature
