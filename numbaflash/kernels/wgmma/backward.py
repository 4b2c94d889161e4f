"""Kernel v3 backward: FlashAttention-2's gradients on Hopper's warpgroup tensor cores (wgmma).

The schedule of the mma.sync backward (`mma.backward`), deterministic, with no atomics: D =
rowsum(dO * O) by the shared preprocess kernel, then two kernels whose products are wgmma reading
their operands from swizzled shared memory (`wgmma.tiles`), with P and dS from registers:

* ``dkdv``: one block per (key block, kv head, batch element); each warpgroup owns 64 keys. K and V
  stay in shared memory while query tiles (Q, dO, and the rows' LSE and D) stream past, double-buffered
  with cp.async, for every query head of the GQA group in a fixed order. Per tile a warpgroup issues
  S^T = K Q^T and dP^T = V dO^T together; once S^T is done it forms P^T (`gradients`) while dP^T
  runs, issues dV += P^T dO, forms dS^T = P^T (dP^T - D) while that runs, and issues dK += dS^T Q.
  The same Q and dO tiles are the K-major B of the first two products and the MN-major B of the last
  two: only their descriptors differ.
* ``dq``: one block per (query block, head, batch element); each warpgroup owns 64 query rows, whose
  LSE and D sit in registers; K and V tiles stream past: S = Q K^T and dP = dO V^T, dS, dQ += dS K.

A warpgroup keeps its 64 x D dK and dV (or dQ) accumulators for the whole kernel, beside the 64 x
BLOCK_N S and dP: at headdim 128 that is 192 float32 registers per thread, so blocks are one warpgroup
of 64 keys (or rows) and 64-wide streamed tiles, two blocks per multiprocessor.
"""

from numba import cuda, types

from ... import masks
from ...mods import NONE
from ..blocks import key_block, query_blocks, tensor_core_backward
from ..fragments import fill, fragment_writer
from ..gradients import row_steps, stats_stager, transposed_steps
from ..intrinsics import (cp_async_commit, cp_async_wait_all, cp_async_wait_one, device_function, fence_proxy_async,
                         shared_address, wgmma_commit, wgmma_fence, wgmma_wait0, wgmma_wait1)
from ..key_tiles import key_tiles, verdict_slot
from ..mods import modifiers
from ..query_tiles import query_tiles
from .tiles import ALIGN, ATOM, advance, aligned_base, operand, pack_p, products, stager


def layout_dkdv(D, tiles):
    """Element offsets from the aligned base: K and V (block_m rows), Q and dO (two stages of block_n rows),
    then two stages of the query tile's LSE and D (float32), and the end."""
    sizes = (tiles.block_m * D, tiles.block_m * D, 2 * tiles.block_n * D, 2 * tiles.block_n * D,
             2 * 2 * tiles.block_n * 2)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def layout_dq(D, tiles):
    """Element offsets from the aligned base: Q and dO (block_m rows), K and V (two stages of block_n rows)."""
    sizes = (tiles.block_m * D, tiles.block_m * D, 2 * tiles.block_n * D, 2 * tiles.block_n * D)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def smem_bytes_dkdv(D, tiles):
    return 2 * layout_dkdv(D, tiles)[-1] + ALIGN


def smem_bytes_dq(D, tiles):
    return 2 * layout_dq(D, tiles)[-1] + ALIGN


def dkdv_step(D, tiles, storage, mods=NONE):
    """``(operands, step)`` of the dK/dV kernels (v3 and v5): ``operands(address, k_at, v_at, q_at, do_at, wg)``
    gives the descriptors ``(k, v, q, do, q_mn, do_mn)`` of a block's tiles (warpgroup ``wg``'s 64 keys of K
    and V; the first stage of the streamed Q and dO, K-major and MN-major); ``step(smem, descs, at, ...)`` runs
    one streamed query tile ``at`` bytes into the stages: S^T = K Q^T and dP^T = V dO^T together, P^T while
    dP^T runs, dV += P^T dO, dS^T while that runs, dK += dS^T Q. It returns with every product done, and
    dS^T, rounded, in ``d_s``."""
    BLOCK_M, BLOCK_N = tiles.block_m, tiles.block_n
    # S^T and dP^T overwritten without their last tile's values as inputs: kept as inputs (a loop phi), once
    # v5's consumers released their stage on a barrier instead of an arrival, LLVM copied one of them between
    # two wgmma, ptxas waited for the products there (C7517) and at headdim 128 spilled 888 bytes (ptxas
    # 13.0). The v5 forward at headdim 64 spills 80 bytes with fresh scores, so only this step takes them.
    scores, accumulate = products(BLOCK_N, D, BLOCK_M, BLOCK_N, storage, fresh=True)
    pack = pack_p(BLOCK_N, storage)
    # Modified scores at headdim 128 wait for dP^T too and form dS^T with P^T, keeping no dlogit: its 32
    # registers beside dK's and dV's 128 spilled 128-136 bytes (softcap, softcap with ALiBi; ptxas 13.0). At 64
    # there is room, and dP^T's product runs under P^T.
    FUSED = mods.scores_modified and D > 64
    probabilities, ds = transposed_steps(1, BLOCK_N // 8, mods, fused=FUSED)

    @device_function
    def operands(address, k_at, v_at, q_at, do_at, wg):
        return (operand(address, k_at + wg * 64 * ATOM, BLOCK_M, False),
                operand(address, v_at + wg * 64 * ATOM, BLOCK_M, False),
                operand(address, q_at, BLOCK_N, False), operand(address, do_at, BLOCK_N, False),
                operand(address, q_at, BLOCK_N, True), operand(address, do_at, BLOCK_N, True))

    @device_function
    def step(smem, descs, at, s, dp, dlogit, p, d_s, dk_acc, dv_acc, stats, st, q_start, warp_key, key_start, g, t,
             seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh, block_full, mod, slot):
        k_desc, v_desc, q_desc, do_desc, q_mn, do_mn = descs
        wgmma_fence()
        scores(s, smem, k_desc, advance(q_desc, at))  # S^T = K Q^T
        wgmma_commit()
        scores(dp, smem, v_desc, advance(do_desc, at))  # dP^T = V dO^T
        wgmma_commit()
        if FUSED:
            wgmma_wait0()
        else:
            wgmma_wait1()  # S^T is done; dP^T may still run under P^T below
        probabilities(s, dp, dlogit, stats, st, st + BLOCK_N, q_start, 0, warp_key, key_start, key_start + BLOCK_M, g,
                      t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh, block_full, mod, slot)
        pack(p, s)
        wgmma_fence()
        accumulate(dv_acc, p, smem, advance(do_mn, at))  # dV += P^T dO
        wgmma_commit()
        if not FUSED:
            wgmma_wait1()  # dP^T is done; dV's product may still run under dS^T below
            ds(s, dp, dlogit, stats, st + BLOCK_N, t)
        pack(d_s, dp)
        wgmma_fence()
        accumulate(dk_acc, d_s, smem, advance(q_mn, at))  # dK += dS^T Q
        wgmma_commit()
        wgmma_wait0()

    return operands, step


def dq_parts(D, tiles, storage, mods=NONE):
    """``(operands, scores, form_ds, add_dq, pack)`` of the dQ kernels (v3 and v5): ``operands(address, q_at, do_at,
    k_at, v_at, wg)`` gives ``(q, do, k, v, k_mn)`` (warpgroup ``wg``'s 64 rows of Q and dO; the first stage of the
    streamed K, K-major and MN-major, and V); for the streamed key tile ``at`` bytes into the stages, ``scores`` issues
    S = Q K^T and dP = dO V^T (a group each), ``form_ds`` turns the finished S and dP into dS in ``dp``, ``pack(d_s,
    dp)`` rounds it, and ``add_dq`` issues dQ += dS K from ``d_s``."""
    BLOCK_M, BLOCK_N = tiles.block_m, tiles.block_n
    products_of, accumulate = products(BLOCK_N, D, BLOCK_M, BLOCK_N, storage)
    _, ds = row_steps(1, BLOCK_N // 8, mods)

    @device_function
    def operands(address, q_at, do_at, k_at, v_at, wg):
        return (operand(address, q_at + wg * 64 * ATOM, BLOCK_M, False),
                operand(address, do_at + wg * 64 * ATOM, BLOCK_M, False),
                operand(address, k_at, BLOCK_N, False), operand(address, v_at, BLOCK_N, False),
                operand(address, k_at, BLOCK_N, True))

    @device_function
    def scores(smem, descs, at, s, dp):
        q_desc, do_desc, k_desc, v_desc, _ = descs
        wgmma_fence()
        products_of(s, smem, q_desc, advance(k_desc, at))  # S = Q K^T
        wgmma_commit()
        products_of(dp, smem, do_desc, advance(v_desc, at))  # dP = dO V^T
        wgmma_commit()

    @device_function
    def form_ds(s, dp, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start, g, t, seqlen_q, seqlen_k, left,
                right, scale_log2, b, h, bh, block_full, mod, slot):
        # a block mask's full tile is whole to the causal/window mask too (`BlockMask.unmasked`): no test
        full = block_full or masks.tile_is_full(row_start, row_end, n_start, n_start + BLOCK_N, seqlen_q, seqlen_k,
                                                left, right)
        ds(s, dp, lse2, dsum, lo_r, hi_r, full, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, b, h, bh,
           block_full, mod, slot, row_start, 0)

    @device_function
    def add_dq(smem, descs, at, d_s, dq_acc):
        accumulate(dq_acc, d_s, smem, advance(descs[4], at))  # dQ += dS K

    return operands, scores, form_ds, add_dq, pack_p(BLOCK_N, storage)


def dq_step(parts):
    """``(operands, step)`` of the dQ kernels from their `dq_parts`; ``step(smem, descs, at, ...)`` runs one streamed
    key tile ``at`` bytes into the stages: S = Q K^T and dP = dO V^T, dS, dQ += dS K, and returns with every product
    done."""
    operands, scores, form_ds, add_dq, pack = parts

    @device_function
    def step(smem, descs, at, s, dp, d_s, dq_acc, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start, g, t,
             seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh, block_full, mod, slot):
        scores(smem, descs, at, s, dp)
        wgmma_wait0()
        form_ds(s, dp, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start, g, t, seqlen_q, seqlen_k, left,
                right, scale_log2, b, h, bh, block_full, mod, slot)
        pack(d_s, dp)
        wgmma_fence()
        add_dq(smem, descs, at, d_s, dq_acc)
        wgmma_commit()
        wgmma_wait0()

    return operands, step


def build_dkdv(D, tiles, storage, mods=NONE):
    """The dK/dV kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` and float16/bfloat16."""
    if mods.packed:  # its plans refuse packed sequences (`tiling`): a plan made for a batch stops here
        raise ValueError(f"{tiles}: v3's wgmma backward does not take packed (varlen) sequences")
    BLOCK_M, BLOCK_N, WARPGROUPS = tiles.block_m, tiles.block_n, tiles.warpgroups
    THREADS = 128 * WARPGROUPS
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    K_AT, V_AT, Q_AT, DO_AT, STATS_AT, _ = layout_dkdv(D, tiles)
    TILE = BLOCK_N * D  # elements of one Q or dO stage
    stage_kv, stage_q = stager(D, BLOCK_M, THREADS), stager(D, BLOCK_N, THREADS)
    operands, step = dkdv_step(D, tiles, storage, mods)
    load_stats, store_stats, PER_THREAD = stats_stager(BLOCK_N, THREADS)
    tile_count, tile_of, tile_full = query_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    write_grad = fragment_writer(D, storage)
    ZERO, ONE = types.float32(0), types.float32(1)

    def attention_backward_dkdv_wgmma(q, k, v, dout, lse, delta, dk, dv, scale_log2, left, right, vec, mod):
        # q, dout: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v, dk, dv: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        b, hk, key_start, q_lo, q_hi = key_block(cuda.blockIdx, q, k, BLOCK_M, left, right)
        tid = cuda.threadIdx.x
        wg, warp, lane = tid // 128, (tid % 128) // 32, tid % 32
        g, t = lane >> 2, lane & 3
        dk_acc = cuda.local.array((DT, 4), types.float32)  # 64 keys x D per warpgroup
        dv_acc = cuda.local.array((DT, 4), types.float32)
        fill(dk_acc, DT, 4, ZERO)
        fill(dv_acc, DT, 4, ZERO)
        warp_key = key_start + wg * 64 + warp * 16

        ntiles = tile_count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q)
        if ntiles > 0:  # block-uniform: no query sees these keys otherwise, and dK = dV = 0
            smem = cuda.shared.array(0, types.uint16)
            stats = cuda.shared.array(0, types.float32)  # the same memory: LSE and D stages after the tiles
            base = aligned_base(smem)
            stats_at = (base + STATS_AT) // 2
            h_next, q_next = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, 0)
            stage_kv(smem, base + K_AT, k, b, key_start, hk, tid, vec)
            stage_kv(smem, base + V_AT, v, b, key_start, hk, tid, vec)
            stage_q(smem, base + Q_AT, q, b, q_next, h_next, tid, vec)
            stage_q(smem, base + DO_AT, dout, b, q_next, h_next, tid, vec)
            cp_async_commit()
            next_stat = cuda.local.array(PER_THREAD, types.float32)
            load_stats(next_stat, lse, delta, b, h_next, q_next, tid)
            store_stats(stats, stats_at, next_stat, tid)
            # A: the warpgroup's 64 keys of K and V; B: the streamed Q and dO, K-major for S^T and dP^T,
            # MN-major for dK and dV.
            descs = operands(shared_address(smem, base), K_AT, V_AT, Q_AT, DO_AT, wg)
            s = cuda.local.array((NT, 4), types.float32)  # S^T, then P^T: 64 keys x BLOCK_N queries
            dp = cuda.local.array((NT, 4), types.float32)  # dP^T, then dS^T
            dlogit = cuda.local.array((NT, 4), types.float32)  # with modifications: d modified / d score
            p = cuda.local.array((PS, 4), types.uint32)  # P^T rounded to 16 bits: the A operand of dV += P^T dO
            d_s = cuda.local.array((PS, 4), types.uint32)  # dS^T rounded: of dK += dS^T Q

            for it in range(ntiles):
                h, q_start = h_next, q_next
                bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
                at = (it % 2) * TILE
                st = stats_at + (it % 2) * 2 * BLOCK_N
                if it + 1 < ntiles:
                    # The other stage was last read in the previous iteration, which ended with a barrier.
                    h_next, q_next = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it + 1)
                    stage_q(smem, base + Q_AT + TILE - at, q, b, q_next, h_next, tid, vec)
                    stage_q(smem, base + DO_AT + TILE - at, dout, b, q_next, h_next, tid, vec)
                    cp_async_commit()
                    # The next tile's LSE and D go to registers now and to shared memory after this tile's
                    # products, so the load's latency hides behind them.
                    load_stats(next_stat, lse, delta, b, h_next, q_next, tid)
                    cp_async_wait_one()  # this tile has landed; the next may still be in flight
                else:
                    cp_async_wait_all()
                fence_proxy_async()  # cp.async wrote through the generic proxy; wgmma reads through the async one
                cuda.syncthreads()  # every thread's copies and statistics of this tile are visible

                step(smem, descs, 2 * at, s, dp, dlogit, p, d_s, dk_acc, dv_acc, stats, st, q_start, warp_key,
                     key_start, g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh,
                     tile_full(mod, b, hk, key_start, it), mod, tile_slot(mod, b, hk, key_start, it))
                if it + 1 < ntiles:
                    store_stats(stats, stats_at + ((it + 1) % 2) * 2 * BLOCK_N, next_stat, tid)
                cuda.syncthreads()  # this stage is free for the copies issued at the top of the next iteration

        # dK = scale dS^T Q with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_k are dropped.
        scale = natural(scale_log2)
        write_grad(dk, b, warp_key, hk, dk_acc, 0, scale, scale, g, t)
        write_grad(dv, b, warp_key, hk, dv_acc, 0, ONE, ONE, g, t)

    return attention_backward_dkdv_wgmma, tensor_core_backward(2, mods)


def build_dq(D, tiles, storage, mods=NONE):
    """The dQ kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` and float16/bfloat16."""
    if mods.packed:  # its plans refuse packed sequences (`tiling`): a plan made for a batch stops here
        raise ValueError(f"{tiles}: v3's wgmma backward does not take packed (varlen) sequences")
    BLOCK_M, BLOCK_N, WARPGROUPS = tiles.block_m, tiles.block_n, tiles.warpgroups
    THREADS = 128 * WARPGROUPS
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_AT, DO_AT, K_AT, V_AT, _ = layout_dq(D, tiles)
    TILE = BLOCK_N * D  # elements of one K or V stage
    stage_q, stage_kv = stager(D, BLOCK_M, THREADS), stager(D, BLOCK_N, THREADS)
    operands, step = dq_step(dq_parts(D, tiles, storage, mods))
    rows, _ = row_steps(1, NT, mods)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    write_grad = fragment_writer(D, storage)
    ZERO = types.float32(0)

    query_block = query_blocks(mods)

    def attention_backward_dq_wgmma(q, k, v, dout, lse, delta, dq, scale_log2, left, right, vec, mod):
        # q, dout, dq: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        wg, warp, lane = tid // 128, (tid % 128) // 32, tid % 32
        g, t = lane >> 2, lane & 3
        dq_acc = cuda.local.array((DT, 4), types.float32)  # 64 rows x D per warpgroup
        fill(dq_acc, DT, 4, ZERO)
        warp_row = row_start + wg * 64 + warp * 16

        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if ntiles > 0:  # block-uniform: these rows see no key otherwise, and dQ = 0
            smem = cuda.shared.array(0, types.uint16)
            base = aligned_base(smem)
            n_next = tile_start(mod, b, h, row_start, n_base, 0)
            stage_q(smem, base + Q_AT, q, b, row_start, h, tid, vec)
            stage_q(smem, base + DO_AT, dout, b, row_start, h, tid, vec)
            stage_kv(smem, base + K_AT, k, b, n_next, hk, tid, vec)
            stage_kv(smem, base + V_AT, v, b, n_next, hk, tid, vec)
            cp_async_commit()
            lse2 = cuda.local.array(2, types.float32)
            dsum = cuda.local.array(2, types.float32)
            lo_r = cuda.local.array(2, types.int64)
            hi_r = cuda.local.array(2, types.int64)
            rows(lse2, dsum, lo_r, hi_r, lse, delta, b, h, warp_row, g, seqlen_q, seqlen_k, left, right)
            # A: the warpgroup's 64 rows of Q and dO; B: the streamed K (K-major for S, MN-major for dQ) and V.
            descs = operands(shared_address(smem, base), Q_AT, DO_AT, K_AT, V_AT, wg)
            s = cuda.local.array((NT, 4), types.float32)  # S: 64 rows x BLOCK_N keys per warpgroup
            dp = cuda.local.array((NT, 4), types.float32)  # dP, then dS
            d_s = cuda.local.array((PS, 4), types.uint32)  # dS rounded to 16 bits: the A operand of dQ += dS K

            for it in range(ntiles):
                n_start = n_next
                at = (it % 2) * TILE
                if it + 1 < ntiles:
                    # The other stage was last read in the previous iteration, which ended with a barrier.
                    n_next = tile_start(mod, b, h, row_start, n_base, it + 1)
                    stage_kv(smem, base + K_AT + TILE - at, k, b, n_next, hk, tid, vec)
                    stage_kv(smem, base + V_AT + TILE - at, v, b, n_next, hk, tid, vec)
                    cp_async_commit()
                    cp_async_wait_one()  # this tile has landed; the next may still be in flight
                else:
                    cp_async_wait_all()
                fence_proxy_async()
                cuda.syncthreads()  # every thread's copies of this tile (and of Q, dO) are visible

                step(smem, descs, 2 * at, s, dp, d_s, dq_acc, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row,
                     n_start, g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh,
                     tile_full(mod, b, h, row_start, it), mod, tile_slot(mod, b, h, row_start, it))
                cuda.syncthreads()  # this stage is free for the copies issued at the top of the next iteration

        # dQ = scale dS K with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_q are dropped.
        scale = natural(scale_log2)
        write_grad(dq, b, warp_row, h, dq_acc, 0, scale, scale, g, t)

    return attention_backward_dq_wgmma, tensor_core_backward(1, mods)
