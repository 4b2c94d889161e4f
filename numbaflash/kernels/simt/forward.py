"""Kernel v1: FlashAttention-2 forward on the CUDA cores, register-tiled, for every dtype.

One thread block per (query block, head, batch element). The block stages its Q tile once, then streams
K/V tiles through shared memory. Thread (r, c) owns rows ``r*TM + a`` and keys ``c*TN + b`` of every
score tile and a ``TM x TD`` patch of the output, so the running max ``m_i``, the running sum ``l_i`` and
the accumulator ``acc`` stay in registers for the whole key loop. Scores become probabilities in
registers; P goes through shared memory only because P V needs each probability in the threads that
own the matching output columns.

Shared memory holds Q^T and K^T (k-major: one 16-byte load gives a thread TM query rows or TN keys of
one head-dimension index), V as is, and P^T. Q is pre-multiplied by ``softmax_scale * log2(e)``, so
the scores are base-2 logits and the softmax uses exp2, the hardware's native exponential. With score
modifications (`kernels.mods`) Q is pre-multiplied by ``softmax_scale``, and the modified natural-log
scores times log2(e) become the base-2 logits.

With ``Tiles.float64_scores`` (float32 on GPUs with full-rate float64, `tiling.FLOAT64_SCORES`) Q is staged
unscaled, each score's dot product is summed in float64 from exact products, scaled in float64, and its
difference from the row maximum rounded once to float32 before exp2: float32 scores in the thousands are
quantized by ~1e-3, which moved P by as much and put the output past twice a float32 naive attention's
error in 8 of 300 random cases with such logits (NumPy emulation, `.bench/f32_emu_sweep.py`; 7 of 300 on
the H100), none with float64 scores. A modification takes the float64 score rounded to float32.
"""

import math

import numpy as np
from numba import cuda, types
from numba.cuda.np.numpy_support import from_dtype

from ... import masks
from ...mods import NONE
from .. import elements
from ..blocks import query_blocks, write_hidden_rows
from ..intrinsics import group_max, group_sum
from ..fragments import fill
from ..key_tiles import key_tiles, shown, verdict_slot, verdict_word
from ..sequences import forward_operands
from ..mods import kernel_type, modifiers
from .tiles import in_parts, outer_product, patch_writer, stagers, vector_width


def layout(D, tiles):
    """Row lengths (elements) and offsets of the shared-memory arrays; rows padded by 4 (16 bytes)."""
    bm, bn = tiles.block_m, tiles.block_n
    ldq, ldk, ldv, ldp = bm + 4, bn + 4, D, bm + 4
    sizes = (D * ldq, D * ldk, bn * ldv, bn * ldp)
    offsets = tuple(sum(sizes[:i]) for i in range(5))
    return (ldq, ldk, ldv, ldp), offsets


def smem_elements(D, tiles):
    return layout(D, tiles)[1][-1]


def build(D, tiles, storage, mods=NONE):
    """The kernel for padded head dim ``D``, ``Tiles`` and a storage dtype name, and its signature.

    Every size is a compile-time constant of the returned function; `kernels.compiled` compiles it.
    """
    operands = forward_operands(mods)
    PACKED = mods.packed
    ACC, to_acc, from_acc = elements.codec(storage)
    acc_bytes = np.dtype(str(ACC)).itemsize
    BLOCK_M, BLOCK_N, TM, TN = tiles.block_m, tiles.block_n, tiles.thread_m, tiles.thread_n
    COLS_T, THREADS = tiles.cols_t, tiles.threads
    TD = D // COLS_T  # output columns per thread
    VV = vector_width(TD, acc_bytes)  # output columns per vector
    (LDQ, LDK, LDV, LDP), (Q_AT, K_AT, V_AT, P_AT, END) = layout(D, tiles)
    ZERO, ONE, NEG_INF, LN2, LOG2E = ACC(0), ACC(1), ACC(-np.inf), ACC(math.log(2.0)), ACC(math.log2(math.e))
    # Unpacked: a kernel calls functions it closes over, not attributes of an object numba cannot type.
    modifier = modifiers(mods, ACC)
    MODIFIED, MASKED, prepare, logit, visible = (modifier.modified, modifier.masked, modifier.prepare, modifier.logit,
                                                 modifier.visible)
    tile_count, tile_start, _ = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot, word_of = verdict_slot(mods, BLOCK_M), verdict_word(mods)
    SPARSE = mods.block_sparse  # a partial tile's verdicts come from the block mask's bits, not the mask_mod
    stage_q, _ = stagers(BLOCK_M, D, THREADS, ZERO, to_acc)
    stage_k, stage_v = stagers(BLOCK_N, D, THREADS, ZERO, to_acc)
    WIDE = tiles.float64_scores
    SCORE = types.float64 if WIDE else ACC  # the scores' type, and the row maxima's
    scores_patch = in_parts(outer_product(TM, TN, 1, 0, SCORE if WIDE else None), 32)  # S = Q K^T over the head dim
    output_patch = outer_product(TM, VV, TD // VV, COLS_T * VV)  # acc += P V over the keys
    write_row = patch_writer(TD, VV, COLS_T, from_acc)

    storage_type = types.Array(from_dtype(elements.kernel_dtype(storage)), 4, "A")
    signature = (storage_type, storage_type, storage_type, storage_type, types.Array(ACC, 3, "A"), ACC,
                 types.int64, types.int64, types.boolean, kernel_type(mods, ACC))

    query_block = query_blocks(mods)

    def attention_forward(q, k, v, out, lse, scale_log2, left, right, vec, mod):
        # q, out: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
        # lse: (batch, nheads, seqlen_q)
        # a varlen call's block narrows its operands to its own sequence (`kernels.sequences`)
        q, k, v, out, lse = operands(mod, cuda.blockIdx.z, q, k, v, out, lse)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        r, c = tid // COLS_T, tid % COLS_T

        if lo >= hi:  # the mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, from_acc(ZERO), tid, THREADS)
            return
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if SPARSE and ntiles <= 0:  # the block mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, from_acc(ZERO), tid, THREADS)
            return

        smem = cuda.shared.array(0, ACC)
        q_t = smem[Q_AT:K_AT]  # (D, LDQ): Q^T, pre-scaled (unscaled with float64 scores)
        k_t = smem[K_AT:V_AT]  # (D, LDK): K^T
        v_s = smem[V_AT:P_AT]  # (BLOCK_N, LDV): V
        p_t = smem[P_AT:END]  # (BLOCK_N, LDP): P^T
        stage_q(q_t, LDQ, q, b, row_start, h, ONE if WIDE else scale_log2, tid, vec)

        m_i = cuda.local.array(TM, SCORE)
        l_i = cuda.local.array(TM, ACC)
        acc = cuda.local.array((TM, TD), ACC)
        pv = cuda.local.array((TM, TD), ACC)  # this tile's P V, summed into acc once (see add_tile)
        alpha_i = cuda.local.array(TM, ACC)
        s = cuda.local.array((TM, TN), SCORE)
        s_part = cuda.local.array((TM, TN), SCORE)
        for a in range(TM):
            m_i[a] = NEG_INF
            l_i[a] = ZERO
        fill(acc, TM, TD, ZERO)

        for it in range(ntiles):
            n_start = tile_start(mod, b, h, row_start, n_base, it)
            # the tile's slot in the block mask's bits, -1 where it shows the tile whole (and without a block mask)
            slot = tile_slot(mod, b, h, row_start, it)
            masked = slot >= 0 if SPARSE else MASKED  # mask_mod not known true on all of it
            # Everyone is done reading the previous K, V and P tiles (and the Q tile is complete).
            cuda.syncthreads()
            stage_k(k_t, LDK, k, b, n_start, hk, ONE, tid, vec)
            stage_v(v_s, LDV, v, b, n_start, hk, ONE, tid, vec)
            cuda.syncthreads()  # the K and V tiles are complete

            fill(s, TM, TN, ZERO)
            scores_patch(s, s_part, TM, TN, q_t, r * TM, LDQ, k_t, c * TN, LDK, D)
            if WIDE:
                for a in range(TM):
                    for bb in range(TN):
                        s[a, bb] *= SCORE(scale_log2)

            # Only tiles that straddle the mask edge or the end of the keys pay for per-element masking,
            # unless modifications (`kernels.mods`) turn every visible score or a mask_mod may hide some. A block
            # mask's full tile (slot -1) is whole to every mask (`BlockMask.unmasked`): no edge test.
            whole = (SPARSE and slot < 0) or masks.tile_is_full(row_start, row_end, n_start, n_start + BLOCK_N,
                                                                seqlen_q, seqlen_k, left, right)
            if MODIFIED or masked or not whole:
                for a in range(TM):
                    row = row_start + r * TM + a
                    lo_a, hi_a = masks.key_range(row, seqlen_q, seqlen_k, left, right)
                    distance = ACC(row + seqlen_k - seqlen_q - n_start - c * TN)  # ALiBi's, for the first key
                    # the row's verdicts on the thread's TN keys: one word (TN divides 32), loaded here, as the TM
                    # words loaded before the tile's copies and products took 16 bytes of local memory at d = 64
                    word = word_of(mod, slot, r * TM + a, c * TN, 0) if SPARSE and masked else types.int32(0)
                    for bb in range(TN):
                        key = n_start + c * TN + bb
                        hidden = key < lo_a or key >= hi_a or row >= seqlen_q
                        if masked and not hidden:  # the user's mask_mod sees only indices in bounds
                            hidden = not (shown(word, c * TN, bb) if SPARSE else visible(b, h, row, key, bh))
                        if hidden:
                            s[a, bb] = NEG_INF
                        elif MODIFIED:  # Q was scaled by softmax_scale: natural-log scores
                            s[a, bb] = logit(ACC(s[a, bb]), b, h, row, key, abs(distance - ACC(bb)), bh) * LOG2E

            # Online softmax: the new row max, and a rescale of what was summed against the old one.
            for a in range(TM):
                row_max = s[a, 0]
                for bb in range(1, TN):
                    row_max = max(row_max, s[a, bb])
                m_new = max(m_i[a], group_max(row_max, COLS_T))
                # A row that has seen only hidden keys keeps m = -inf; exponentiate it against 0.
                base = m_new if m_new != NEG_INF else ZERO
                alpha_i[a] = math.exp2(ACC(m_i[a] - base))
                m_i[a] = m_new
                row_sum = ZERO
                for bb in range(TN):
                    p = math.exp2(ACC(s[a, bb] - base))
                    p_t[(c * TN + bb) * LDP + r * TM + a] = p
                    row_sum += p
                # l_i stays a per-thread partial sum; the row group adds its partials once, at the end.
                l_i[a] = l_i[a] * alpha_i[a] + row_sum
            cuda.syncthreads()  # P^T is complete

            fill(pv, TM, TD, ZERO)
            output_patch(pv, p_t, r * TM, LDP, v_s, c * VV, LDV, BLOCK_N)
            # Rescale what was accumulated against the old max, and add this tile (a two-level sum).
            for a in range(TM):
                for x in range(TD):
                    acc[a, x] = acc[a, x] * alpha_i[a] + pv[a, x]

        # One normalization at the end; O and LSE written once.
        for a in range(TM):
            l_row = group_sum(l_i[a], COLS_T)
            row = row_start + r * TM + a
            if row < seqlen_q:
                write_row(out, b, row, h, acc, a, ONE / l_row if l_row != ZERO else ZERO, c)  # NaN stays NaN
                if c == 0:
                    lse[b, h, row] = (m_i[a] + math.log2(l_row)) * LN2 if l_row != ZERO else NEG_INF

    return attention_forward, signature
