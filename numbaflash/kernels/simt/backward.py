"""Kernel v1 backward: FlashAttention-2's gradients on the CUDA cores, deterministic.

Three launches, none with atomics, so repeated calls give bitwise identical gradients:

1. ``preprocess``: D = rowsum(dO * O), one warp per query row.
2. ``dkdv``: one block per (key block, kv head, batch element). K_j and V_j stay in shared memory; for
   every query head of the group and every query block that sees these keys, the block recomputes
   S^T = K Q^T and P^T = exp2(S^T - LSE) from the saved LSE, dP^T = V dO^T and dS^T = P^T (dP^T - D),
   and accumulates dV_j += P^T dO and dK_j += dS^T Q in registers. GQA's sum over the group happens
   in that loop, in a fixed order.
3. ``dq``: one block per (query block, head, batch element); Q_i, dO_i, LSE_i and D_i stay put while the
   visible key blocks stream past, recomputing P and dS, and dQ_i += dS K accumulates in registers.

Passing dQ through its own pass costs a second S and dP per tile (seven tile products instead of five)
but needs neither atomics nor an N x N or per-key-block dQ buffer: the extra memory is D, O(N).

Products that contract over the head dimension read k-major (transposed) tiles; those that contract
over rows read row-major ones. Rather than hold both layouts, each kernel stages the second layout
into the same buffer once the first is consumed (one more tile read, mostly from L2). Q is staged
pre-multiplied by softmax_scale * log2(e), so scores are base-2 logits; the final dK and dQ fold
the scale back in. With score modifications (`kernels.mods`) Q is pre-multiplied by softmax_scale, P is
rebuilt from the modified scores, and dS carries the modification's derivative.
"""

import math

import numpy as np
from numba import cuda, types
from numba.cuda.np.numpy_support import from_dtype

from ... import masks
from ...mods import NONE
from .. import elements
from ..blocks import key_block, query_blocks
from ..intrinsics import device_function, group_sum
from ..fragments import fill
from ..key_tiles import key_tiles, shown, thread_verdicts
from ..mods import kernel_type, modifiers
from ..query_tiles import query_tiles
from ..sequences import dkdv_operands, dq_operands, sequences, stats_start, stats_tile_rows
from .tiles import in_parts, outer_product, patch_writer, stagers, vector_width

PREPROCESS_ROWS = 8  # query rows per block of the preprocess kernel: one warp each
# The staged preprocess (v5's): rows per warp, each lane's loads of all of them issued before the sums, and
# rows per block of 8 warps. H100, N = 16384, 16 heads, torch.profiler (.bench/bwd_split2.py), headdim 64 / 128:
# a row per warp (32,768 blocks) took 0.107 / 0.116 ms, five times O's and dO's bytes at the memory's rate and
# 12% of a backward over 8 documents of 2048 tokens; 2 rows per warp 0.054 / 0.073, 4 rows 0.040 / 0.057,
# 8 rows 0.036 / 0.070 (each lane's loads past 16 per tensor at headdim 128 leave fewer warps resident).
STAGED_ROWS_PER_WARP = 4
STAGED_PREPROCESS_WARPS = 8
STAGED_PREPROCESS_ROWS = STAGED_PREPROCESS_WARPS * STAGED_ROWS_PER_WARP
LOG2E = math.log2(math.e)


def _layout(sizes):
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def layout_dkdv(D, tiles):
    """K^T, V^T (D x keys), the Q and dO buffers (D x queries, or queries x D), P and dS (queries x keys)."""
    bk, bq = tiles.block_m, tiles.block_n
    ldk, ldq, ldp = bk + 4, bq + 4, bk + 4
    return (ldk, ldq, ldp), _layout((D * ldk, D * ldk, D * ldq, D * ldq, bq * ldp, bq * ldp))


def layout_dq(D, tiles):
    """Q^T, dO^T (D x queries), the K buffer (D x keys, or keys x D), V^T, and dS^T (keys x queries)."""
    bm, bn = tiles.block_m, tiles.block_n
    ldq, ldk, ldd = bm + 4, bn + 4, bm + 4
    return (ldq, ldk, ldd), _layout((D * ldq, D * ldq, D * ldk, D * ldk, bn * ldd))


def smem_elements_dkdv(D, tiles):
    return layout_dkdv(D, tiles)[1][-1]


def smem_elements_dq(D, tiles):
    return layout_dq(D, tiles)[1][-1]


def _signature(storage, n_outputs, mods):
    ACC = elements.codec(storage)[0]
    storage_type = types.Array(from_dtype(elements.kernel_dtype(storage)), 4, "A")
    stat_type = types.Array(ACC, 3, "A")
    return ((storage_type,) * 4 + (stat_type, stat_type) + (storage_type,) * n_outputs
            + (ACC, types.int64, types.int64, types.boolean, kernel_type(mods, ACC)))


def log2_lse(ACC):
    """``lse2(lse, b, h, row)``: the base-2 LSE of query ``row`` in ``ACC``; +inf for a row past the sequence or
    that saw no key (LSE = -inf), so P = exp2(s - inf) = 0 there."""
    INF, LOG2E_ = ACC(np.inf), ACC(LOG2E)

    @device_function
    def lse2(lse, b, h, row):
        if row < lse.shape[2] and lse[b, h, row] != -INF:
            return lse[b, h, row] * LOG2E_
        return INF

    return lse2


def row_statistics(ACC):
    """``load(lse, delta, b, h, row) -> (lse2, dsum)``: `log2_lse` and D of query ``row``, in ``ACC``; D = 0 past
    the sequence. Both backwards' kernels load their rows' statistics with it."""
    ZERO = ACC(0)
    lse2 = log2_lse(ACC)

    @device_function
    def load(lse, delta, b, h, row):
        return lse2(lse, b, h, row), (delta[b, h, row] if row < lse.shape[2] else ZERO)

    return load


def _rows_statistics(ROWS, ACC):
    """``load(lse2, dsum, lse, delta, b, h, row0)``: `row_statistics` of rows ``row0 .. row0 + ROWS - 1``."""
    one = row_statistics(ACC)

    @device_function
    def load(lse2, dsum, lse, delta, b, h, row0):
        for a in range(ROWS):
            lse2[a], dsum[a] = one(lse, delta, b, h, row0 + a)

    return load


@device_function
def warp_row():
    """``(b, h, row, lane)`` of a thread of the row-per-warp kernels (the preprocess and the dQ postprocess):
    grid (rows / PREPROCESS_ROWS, nheads, batch), one warp per query row."""
    return (cuda.blockIdx.z, cuda.blockIdx.y, cuda.blockIdx.x * PREPROCESS_ROWS + cuda.threadIdx.x // 32,
            cuda.threadIdx.x % 32)


def build_preprocess(D, tiles, storage, mods=NONE):
    """D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d], one warp per row (coalesced along d)."""
    ACC, to_acc, _ = elements.codec(storage)
    storage_type = types.Array(from_dtype(elements.kernel_dtype(storage)), 4, "A")
    signature = (storage_type, storage_type, types.Array(ACC, 3, "A"))
    rowsum = _rowsum(ACC, to_acc)

    def attention_backward_preprocess(out, dout, delta):
        # out, dout: (batch, seqlen_q, nheads, headdim); delta: (batch, nheads, seqlen_q)
        b, h, row, lane = warp_row()
        total = rowsum(out, dout, b, h, row, lane)
        if row < out.shape[1] and lane == 0:
            delta[b, h, row] = total

    return attention_backward_preprocess, signature


def build_staged_preprocess(D, tiles, storage, mods=NONE):
    """The preprocess of kernels that copy each query tile's LSE and D in bulk (`wgmma.ws_backward`): it writes
    ``stats[b, h, 0, i]`` = `log2_lse` and ``stats[b, h, 1, i]`` = D, for rows padded to whole tiles (+inf and
    0 past the sequence), so a tile's statistics are two aligned runs of floats the copy engine reads. With
    ``mods.packed`` (its only modification) it takes the cu_seqlens as its last argument and writes sequence
    ``b``'s rows into ``stats[0]`` from `sequences.stats_start` on."""
    ACC, to_acc, _ = elements.codec(storage)
    storage_type = types.Array(from_dtype(elements.kernel_dtype(storage)), 4, "A")
    signature = (storage_type, storage_type, types.Array(ACC, 3, "A"), types.Array(ACC, 4, "C"))
    lse2 = log2_lse(ACC)
    PACKED, sequence = mods.packed, sequences(mods)
    WHOLE = stats_tile_rows(tiles)
    ROWS, STEPS, ZERO = STAGED_ROWS_PER_WARP, D // 32, ACC(0)
    LOADS = ROWS * STEPS  # a lane's elements of O (and of dO)

    @device_function
    def staged_rows(out, dout, lse, stats, mod):
        # out, dout: (batch, seqlen_q, nheads, headdim); lse: (batch, nheads, seqlen_q); stats: (batch, nheads,
        # 2, seqlen_q padded), or (1, nheads, 2, rows) for packed sequences
        b, h = cuda.blockIdx.z, cuda.blockIdx.y
        lane = cuda.threadIdx.x % 32
        row0 = cuda.blockIdx.x * STAGED_PREPROCESS_ROWS + (cuda.threadIdx.x // 32) * ROWS  # the warp's first row
        first, padded, at = 0, stats.shape[3], b
        if PACKED:  # the block's own sequence (`kernels.sequences`)
            q_start, q_end, _, _ = sequence(mod, b)
            out, dout, lse = out[:, q_start:q_end], dout[:, q_start:q_end], lse[:, :, q_start:q_end]
            first, padded, at = stats_start(q_start, b, WHOLE), (q_end - q_start + WHOLE - 1) // WHOLE * WHOLE, 0
        seqlen, headdim = out.shape[1], out.shape[3]
        o = cuda.local.array(LOADS, ACC)
        g = cuda.local.array(LOADS, ACC)
        if seqlen > 0:  # block-uniform (a packed sequence may have no rows)
            # Every load of the warp's rows first, at addresses clamped into the tensors: each inside its own
            # bounds test, each load's use followed it and the loads ran one after another (SASS, ptxas 13.0).
            for r in range(ROWS):
                for step in range(STEPS):
                    row, d = min(row0 + r, seqlen - 1), min(step * 32 + lane, headdim - 1)
                    o[r * STEPS + step], g[r * STEPS + step] = to_acc(out[b, row, h, d]), to_acc(dout[b, row, h, d])
        mine = ZERO  # lane r keeps row r's sum and stores its statistics: one store per warp and array
        for r in range(ROWS):
            total = ZERO
            for step in range(STEPS):
                if row0 + r < seqlen and step * 32 + lane < headdim:
                    total += o[r * STEPS + step] * g[r * STEPS + step]
            total = group_sum(total, 32)  # every lane of the warp takes part, in bounds or not
            if lane == r:
                mine = total
        row = row0 + lane
        if lane < ROWS and row < padded:
            stats[at, h, 0, first + row] = lse2(lse, b, h, row)
            stats[at, h, 1, first + row] = mine

    if PACKED:
        def attention_backward_staged_preprocess(out, dout, lse, stats, mod):
            staged_rows(out, dout, lse, stats, mod)

        return attention_backward_staged_preprocess, signature + (kernel_type(mods, ACC),)

    def attention_backward_staged_preprocess(out, dout, lse, stats):
        staged_rows(out, dout, lse, stats, ())

    return attention_backward_staged_preprocess, signature


def _rowsum(ACC, to_acc):
    """``rowsum(out, dout, b, h, row, lane)``: D of ``row`` (0 past the sequence), summed over a warp's lanes."""
    ZERO = ACC(0)

    @device_function
    def rowsum(out, dout, b, h, row, lane):
        total = ZERO
        if row < out.shape[1]:
            for d in range(lane, out.shape[3], 32):
                total += to_acc(out[b, row, h, d]) * to_acc(dout[b, row, h, d])
        return group_sum(total, 32)  # every lane of the warp takes part, in bounds or not

    return rowsum


def build_dq_postprocess(D, tiles, storage, mods=NONE):
    """dQ[b, i, h, d] = scale * dq_acc[b, h, i, d], rounded to the storage dtype, one warp per row: the last step
    of a backward that accumulates dQ in float32 (`wgmma.ws_backward.build_dkdv_dq`); the head dim's padding
    columns are dropped."""
    ACC, _, from_acc = elements.codec(storage)
    storage_type = types.Array(from_dtype(elements.kernel_dtype(storage)), 4, "A")
    signature = (types.Array(types.float32, 4, "C"), storage_type, types.float32)

    def attention_backward_dq_postprocess(dq_acc, dq, scale):
        # dq_acc: (batch, nheads, seqlen_q rounded up, D) float32; dq: (batch, seqlen_q, nheads, headdim)
        b, h, row, lane = warp_row()
        if row < dq.shape[1]:
            for d in range(lane, dq.shape[3], 32):
                dq[b, row, h, d] = from_acc(ACC(dq_acc[b, h, row, d] * scale))

    return attention_backward_dq_postprocess, signature


def build_dkdv(D, tiles, storage, mods=NONE):
    operands = dkdv_operands(mods)
    PACKED = mods.packed
    ACC, to_acc, from_acc = elements.codec(storage)
    acc_bytes = np.dtype(str(ACC)).itemsize
    BLOCK_K, BLOCK_Q, TK, TQ = tiles.block_m, tiles.block_n, tiles.thread_m, tiles.thread_n
    COLS_T, THREADS = tiles.cols_t, tiles.threads
    TD = D // COLS_T
    VV = vector_width(TD, acc_bytes)
    (LDK, LDQ, LDP), (K_AT, V_AT, Q_AT, DO_AT, P_AT, DS_AT, END) = layout_dkdv(D, tiles)
    ZERO, ONE = ACC(0), ACC(1)
    stage_kv_t, _ = stagers(BLOCK_K, D, THREADS, ZERO, to_acc)
    stage_q_t, stage_q_n = stagers(BLOCK_Q, D, THREADS, ZERO, to_acc)
    scores_patch = in_parts(outer_product(TK, TQ, 1, 0), 32)  # S^T = K Q^T, dP^T = V dO^T over the head dim
    grad_patch = in_parts(outer_product(TK, VV, TD // VV, COLS_T * VV), BLOCK_Q)  # dV += P^T dO, dK += dS^T Q
    write_row = patch_writer(TD, VV, COLS_T, from_acc)
    load_rows = _rows_statistics(TQ, ACC)
    tile_count, tile_of, _ = query_tiles(mods, BLOCK_K, BLOCK_Q)
    visit_whole = thread_verdicts(mods, BLOCK_K, TK)
    SPARSE = mods.block_sparse  # a partial visit's verdicts come from the block mask's bits (a row per key)
    modifier = modifiers(mods, ACC)
    prepare, logit2, visible, natural = modifier.prepare, modifier.logit2, modifier.visible, modifier.natural

    def attention_backward_dkdv(q, k, v, dout, lse, delta, dk, dv, scale_log2, left, right, vec, mod):
        # q, dout: (batch, seqlen_q, nheads, headdim); k, v, dk, dv: (batch, seqlen_k, nheads_kv, headdim)
        # lse, delta: (batch, nheads, seqlen_q)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, dout, lse, delta, dk, dv = operands(mod, cuda.blockIdx.z, q, k, v, dout, lse, delta, dk, dv)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        b, hk, key_start, q_lo, q_hi = key_block(cuda.blockIdx, q, k, BLOCK_K, left, right)
        if PACKED and key_start >= seqlen_k:  # past its sequence's key blocks: the grid covers the longest
            return
        tid = cuda.threadIdx.x
        r, c = tid // COLS_T, tid % COLS_T  # r: this thread's keys, c: its queries in each query tile

        dk_acc = cuda.local.array((TK, TD), ACC)
        dv_acc = cuda.local.array((TK, TD), ACC)
        tile = cuda.local.array((TK, TD), ACC)  # one query tile's dV, then dK: a two-level sum
        fill(dk_acc, TK, TD, ZERO)
        fill(dv_acc, TK, TD, ZERO)

        ntiles = tile_count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q)
        if ntiles > 0:  # block-uniform: no query sees these keys otherwise, and dK = dV = 0
            smem = cuda.shared.array(0, ACC)
            k_t = smem[K_AT:V_AT]  # (D, LDK): K^T
            v_t = smem[V_AT:Q_AT]  # (D, LDK): V^T
            q_buf = smem[Q_AT:DO_AT]  # Q^T (D, LDQ), then Q (BLOCK_Q, D); pre-scaled
            do_buf = smem[DO_AT:P_AT]  # dO^T (D, LDQ), then dO (BLOCK_Q, D)
            p_s = smem[P_AT:DS_AT]  # (BLOCK_Q, LDP): P, queries major
            ds_s = smem[DS_AT:END]  # (BLOCK_Q, LDP): dS
            stage_kv_t(k_t, LDK, k, b, key_start, hk, ONE, tid, vec)
            stage_kv_t(v_t, LDK, v, b, key_start, hk, ONE, tid, vec)
            s = cuda.local.array((TK, TQ), ACC)
            dp = cuda.local.array((TK, TQ), ACC)
            part = cuda.local.array((TK, TQ), ACC)
            lse2 = cuda.local.array(TQ, ACC)
            dsum = cuda.local.array(TQ, ACC)
            words = cuda.local.array(TK, types.int32)  # each of the thread's keys' verdicts on its TQ query rows
            for it in range(ntiles):
                h, q_start = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it)
                bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
                # the verdicts loaded before the tile's copies and products, which hide their latency
                block_full = visit_whole(words, mod, b, hk, key_start, it, r * TK, c * TQ)
                q_end = min(q_start + BLOCK_Q, seqlen_q)
                cuda.syncthreads()  # the previous tile's products are done with every buffer
                stage_q_t(q_buf, LDQ, q, b, q_start, h, scale_log2, tid, vec)
                stage_q_t(do_buf, LDQ, dout, b, q_start, h, ONE, tid, vec)
                load_rows(lse2, dsum, lse, delta, b, h, q_start + c * TQ)
                cuda.syncthreads()  # Q^T and dO^T are complete

                fill(s, TK, TQ, ZERO)
                fill(dp, TK, TQ, ZERO)
                scores_patch(s, part, TK, TQ, k_t, r * TK, LDK, q_buf, c * TQ, LDQ, D)
                scores_patch(dp, part, TK, TQ, v_t, r * TK, LDK, do_buf, c * TQ, LDQ, D)
                # a block mask's full visit is whole to every mask (`BlockMask.unmasked`): no edge test
                full = block_full or masks.tile_is_full(q_start, q_end, key_start, key_start + BLOCK_K, seqlen_q,
                                                        seqlen_k, left, right)
                for bb in range(TQ):
                    row = q_start + c * TQ + bb
                    lo_b, hi_b = masks.key_range(row, seqlen_q, seqlen_k, left, right)
                    distance = ACC(row + seqlen_k - seqlen_q - key_start - r * TK)  # ALiBi's, first key
                    for a in range(TK):
                        key = key_start + r * TK + a
                        p, grad = ZERO, ZERO
                        if ((full or (key >= lo_b and key < hi_b)) and row < seqlen_q
                                and (block_full or (shown(words[a], c * TQ, bb) if SPARSE
                                                    else visible(b, h, row, key, bh)))):
                            x, grad = logit2(s[a, bb], ONE, b, h, row, key, abs(distance - ACC(a)), bh)
                            p = math.exp2(x - lse2[bb])
                        p_s[(c * TQ + bb) * LDP + r * TK + a] = p
                        ds_s[(c * TQ + bb) * LDP + r * TK + a] = p * (dp[a, bb] - dsum[bb]) * grad
                cuda.syncthreads()  # everyone is done with Q^T and dO^T; P and dS are complete
                stage_q_n(q_buf, D, q, b, q_start, h, scale_log2, tid, vec)
                stage_q_n(do_buf, D, dout, b, q_start, h, ONE, tid, vec)
                cuda.syncthreads()  # Q and dO, row-major, are complete
                grad_patch(dv_acc, tile, TK, TD, p_s, r * TK, LDP, do_buf, c * VV, D, BLOCK_Q)
                grad_patch(dk_acc, tile, TK, TD, ds_s, r * TK, LDP, q_buf, c * VV, D, BLOCK_Q)

        # Q was pre-scaled by scale * log2(e): dK = scale dS^T Q = ln(2) dS^T (scale log2(e) Q) (by scale with
        # modifications: dK = dS^T (scale Q)).
        for a in range(TK):
            key = key_start + r * TK + a
            if key < seqlen_k:
                write_row(dk, b, key, hk, dk_acc, a, natural(ONE), c)
                write_row(dv, b, key, hk, dv_acc, a, ONE, c)

    return attention_backward_dkdv, _signature(storage, 2, mods)


def build_dq(D, tiles, storage, mods=NONE):
    operands = dq_operands(mods)
    PACKED = mods.packed
    ACC, to_acc, from_acc = elements.codec(storage)
    acc_bytes = np.dtype(str(ACC)).itemsize
    BLOCK_M, BLOCK_N, TM, TN = tiles.block_m, tiles.block_n, tiles.thread_m, tiles.thread_n
    COLS_T, THREADS = tiles.cols_t, tiles.threads
    TD = D // COLS_T
    VV = vector_width(TD, acc_bytes)
    (LDQ, LDK, LDD), (Q_AT, DO_AT, K_AT, V_AT, DS_AT, END) = layout_dq(D, tiles)
    ZERO, ONE = ACC(0), ACC(1)
    stage_q_t, _ = stagers(BLOCK_M, D, THREADS, ZERO, to_acc)
    stage_k_t, stage_k_n = stagers(BLOCK_N, D, THREADS, ZERO, to_acc)
    scores_patch = in_parts(outer_product(TM, TN, 1, 0), 32)  # S = Q K^T, dP = dO V^T over the head dim
    grad_patch = in_parts(outer_product(TM, VV, TD // VV, COLS_T * VV), BLOCK_N)  # dQ += dS K over the keys
    write_row = patch_writer(TD, VV, COLS_T, from_acc)
    load_rows = _rows_statistics(TM, ACC)
    tile_count, tile_start, _ = key_tiles(mods, BLOCK_M, BLOCK_N)
    visit_whole = thread_verdicts(mods, BLOCK_M, TM)
    SPARSE = mods.block_sparse  # a partial tile's verdicts come from the block mask's bits, not the mask_mod
    modifier = modifiers(mods, ACC)
    prepare, logit2, visible, natural = modifier.prepare, modifier.logit2, modifier.visible, modifier.natural

    query_block = query_blocks(mods)

    def attention_backward_dq(q, k, v, dout, lse, delta, dq, scale_log2, left, right, vec, mod):
        # q, dout, dq: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, dout, lse, delta, dq = operands(mod, cuda.blockIdx.z, q, k, v, dout, lse, delta, dq)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        r, c = tid // COLS_T, tid % COLS_T

        dq_acc = cuda.local.array((TM, TD), ACC)
        tile = cuda.local.array((TM, TD), ACC)  # one key tile's dS K: a two-level sum
        fill(dq_acc, TM, TD, ZERO)
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if ntiles > 0:  # block-uniform: these rows see no key otherwise, and dQ = 0
            smem = cuda.shared.array(0, ACC)
            q_t = smem[Q_AT:DO_AT]  # (D, LDQ): Q^T, pre-scaled
            do_t = smem[DO_AT:K_AT]  # (D, LDQ): dO^T
            k_buf = smem[K_AT:V_AT]  # K^T (D, LDK), then K (BLOCK_N, D)
            v_t = smem[V_AT:DS_AT]  # (D, LDK): V^T
            ds_t = smem[DS_AT:END]  # (BLOCK_N, LDD): dS^T
            stage_q_t(q_t, LDQ, q, b, row_start, h, scale_log2, tid, vec)
            stage_q_t(do_t, LDQ, dout, b, row_start, h, ONE, tid, vec)
            s = cuda.local.array((TM, TN), ACC)
            dp = cuda.local.array((TM, TN), ACC)
            part = cuda.local.array((TM, TN), ACC)
            lse2 = cuda.local.array(TM, ACC)
            dsum = cuda.local.array(TM, ACC)
            load_rows(lse2, dsum, lse, delta, b, h, row_start + r * TM)

            words = cuda.local.array(TM, types.int32)  # each of the thread's rows' verdicts on its TN keys
            for it in range(ntiles):
                n_start = tile_start(mod, b, h, row_start, n_base, it)
                # the verdicts loaded before the tile's copies and products, which hide their latency
                block_full = visit_whole(words, mod, b, h, row_start, it, r * TM, c * TN)
                cuda.syncthreads()  # the previous tile's dQ product is done with K; Q^T, dO^T complete
                stage_k_t(k_buf, LDK, k, b, n_start, hk, ONE, tid, vec)
                stage_k_t(v_t, LDK, v, b, n_start, hk, ONE, tid, vec)
                cuda.syncthreads()  # K^T and V^T are complete

                fill(s, TM, TN, ZERO)
                fill(dp, TM, TN, ZERO)
                scores_patch(s, part, TM, TN, q_t, r * TM, LDQ, k_buf, c * TN, LDK, D)
                scores_patch(dp, part, TM, TN, do_t, r * TM, LDQ, v_t, c * TN, LDK, D)
                full = block_full or masks.tile_is_full(row_start, row_end, n_start, n_start + BLOCK_N, seqlen_q,
                                                        seqlen_k, left, right)  # as the dK/dV pass's
                for a in range(TM):
                    row = row_start + r * TM + a
                    lo_a, hi_a = masks.key_range(row, seqlen_q, seqlen_k, left, right)
                    distance = ACC(row + seqlen_k - seqlen_q - n_start - c * TN)  # ALiBi's, for the first key
                    for bb in range(TN):
                        key = n_start + c * TN + bb
                        ds = ZERO
                        if ((full or (key >= lo_a and key < hi_a)) and row < seqlen_q
                                and (block_full or (shown(words[a], c * TN, bb) if SPARSE
                                                    else visible(b, h, row, key, bh)))):
                            x, grad = logit2(s[a, bb], ONE, b, h, row, key, abs(distance - ACC(bb)), bh)
                            ds = math.exp2(x - lse2[a]) * (dp[a, bb] - dsum[a]) * grad
                        ds_t[(c * TN + bb) * LDD + r * TM + a] = ds
                cuda.syncthreads()  # everyone is done with K^T; dS^T is complete
                stage_k_n(k_buf, D, k, b, n_start, hk, ONE, tid, vec)
                cuda.syncthreads()  # K, row-major, is complete
                grad_patch(dq_acc, tile, TM, TD, ds_t, r * TM, LDD, k_buf, c * VV, D, BLOCK_N)

        # dQ = scale dS K, and scale = scale_log2 * ln(2) (the scale argument itself with modifications).
        for a in range(TM):
            row = row_start + r * TM + a
            if row < seqlen_q:
                write_row(dq, b, row, h, dq_acc, a, natural(scale_log2), c)

    return attention_backward_dq, _signature(storage, 1, mods)
