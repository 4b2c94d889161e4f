"""Kernel v5 backward: the wgmma backward with a producer warpgroup and bulk tensor copies (FlashAttention-3's
warp specialization), deterministic, with no atomics.

v3's backward (`wgmma.backward`) runs one warpgroup per block that both copies (cp.async) and computes,
with a barrier of the whole block per tile, and the tensor cores wait while it forms P and dS. Here, as
in the v5 forward (`ws_forward`), warpgroup 0 only copies and the ``CONSUMERS`` warpgroups after it only
compute, 64 keys (or query rows) each, waiting for their tiles on "full" mbarriers and releasing them on
"empty" ones (`pipeline`); the consumers of a block share each streamed tile, and while one forms P and
dS on the CUDA cores the tensor cores run the other's products.

* ``dkdv``: one block per (key block, kv head, batch element). One producer thread copies the block's K
  and V once, then each query tile's Q and dO (every query head of the GQA group in turn) into a ring
  of ``stages``; its warp copies the tile's LSE and D beside them (32 threads, 2 ``block_n`` floats) and
  arrives with them. A consumer's step is v3's: S^T = K Q^T and dP^T = V dO^T, P^T, dV += P^T dO, dS^T,
  dK += dS^T Q.
* ``dq``: one block per (query block, head, batch element); Q and dO once, then K and V tiles through
  the ring: S = Q K^T, dP = dO V^T, dS, dQ += dS K, the rows' LSE and D in registers.

On the H100 (fp16 and bf16, N = 2048 to 16384, causal and not; scripts/bench.py) it ran 0.81-0.98x SDPA
flash's backward at headdim 128 and 0.58-0.75x at 64, against mma.sync's 0.51-0.63x; `tiling` keeps the
tile comparison.
"""

from numba import cuda, types

from ...mods import NONE
from ..blocks import key_block, query_block, tensor_core_backward
from ..fragments import fill, fragment_writer
from ..gradients import row_steps, stats_stager
from ..intrinsics import (device_function, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init,
                         named_barrier_sync, setmaxnreg_dec, setmaxnreg_inc, shared_address, tensormap_acquire)
from ..mods import modifiers
from . import tensor_maps
from .backward import dkdv_step, dq_step
from .pipeline import BARRIER_ELEMENTS, PRODUCER, bulk_copier, check_registers, release, wait
from .tiles import ALIGN, aligned_base

STATS_THREADS = 32  # the producer's first warp copies each query tile's LSE and D
# Registers per thread after setmaxnreg (see `pipeline.REGISTERS`): the dK/dV producer also copies LSE and D,
# and with 24 registers it spilled 8 bytes (ptxas, sm_90a, headdim 64); with 40, none.
REGISTERS = check_registers({1: (56, 256), 2: (40, 232)})
# Launch bounds of at least one block per multiprocessor: with the thread count alone ptxas cannot tell the
# registers at entry, ignores setmaxnreg (warning C7508) and keeps every thread at 168, where the headdim-64
# dK/dV kernel spilled 188 bytes.
MIN_BLOCKS = 1


def tensor_map_args(q, k, v, dout, tiles):
    """The two kernels' map sets: ``(dkdv, dq)``, each of Q, dO, K and V with the rows of its tiles."""
    streamed, owned = tiles.block_n, tiles.block_m
    return (tensor_maps.maps([(q, streamed), (dout, streamed), (k, owned), (v, owned)]),
            tensor_maps.maps([(q, owned), (dout, owned), (k, streamed), (v, streamed)]))


def layout_dkdv(D, tiles):
    """Element offsets from the aligned base: K and V (block_m rows), the Q and dO rings (stages of block_n
    rows), the rings' LSE and D (float32), the mbarriers (K and V full; full and empty per stage), the end."""
    sizes = (tiles.block_m * D, tiles.block_m * D, tiles.stages * tiles.block_n * D,
             tiles.stages * tiles.block_n * D, tiles.stages * 2 * tiles.block_n * 2,
             (1 + 2 * tiles.stages) * BARRIER_ELEMENTS)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def layout_dq(D, tiles):
    """Element offsets from the aligned base: Q and dO (block_m rows), the K and V rings, the mbarriers."""
    sizes = (tiles.block_m * D, tiles.block_m * D, tiles.stages * tiles.block_n * D,
             tiles.stages * tiles.block_n * D, (1 + 2 * tiles.stages) * BARRIER_ELEMENTS)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def smem_bytes_dkdv(D, tiles):
    return 2 * layout_dkdv(D, tiles)[-1] + ALIGN


def smem_bytes_dq(D, tiles):
    return 2 * layout_dq(D, tiles)[-1] + ALIGN


def _registers(tiles):
    low, high = REGISTERS[tiles.warpgroups]
    return setmaxnreg_dec(low), setmaxnreg_inc(high)


def build_dkdv(D, tiles, storage, mods=NONE):
    """The dK/dV kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` with a producer, float16/bfloat16."""
    BLOCK_M, BLOCK_N, CONSUMERS, STAGES = tiles.block_m, tiles.block_n, tiles.warpgroups, tiles.stages
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    K_AT, V_AT, Q_AT, DO_AT, STATS_AT, BAR_AT, _ = layout_dkdv(D, tiles)
    KV_FULL, FULL, EMPTY = BAR_AT, BAR_AT + BARRIER_ELEMENTS, BAR_AT + (1 + STAGES) * BARRIER_ELEMENTS
    TILE = BLOCK_N * D  # elements of one Q or dO stage
    copy_tile = bulk_copier(D)
    operands, step = dkdv_step(D, tiles, storage, mods)
    load_stats, store_stats, PER_THREAD = stats_stager(BLOCK_N, STATS_THREADS)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    write_grad = fragment_writer(D, storage)
    release_registers, take_registers = _registers(tiles)
    ZERO, ONE = types.float32(0), types.float32(1)

    @device_function
    def produce(smem, base, lse, delta, maps, b, hk, key_start, group, q_first, per_head, ntiles, lane):
        stats = cuda.shared.array(0, types.float32)  # the same memory: the rings' LSE and D
        if lane == 0:
            for which in range(4):  # Q, dO, K, V
                tensormap_acquire(maps, which)
            mbarrier_arrive_expect_tx(smem, base + KV_FULL, 2 * 2 * BLOCK_M * D)
            copy_tile(smem, base + K_AT, base + KV_FULL, maps, 2, hk, key_start, b, BLOCK_M)
            copy_tile(smem, base + V_AT, base + KV_FULL, maps, 3, hk, key_start, b, BLOCK_M)
        regs = cuda.local.array(PER_THREAD, types.float32)
        for it in range(ntiles):
            s = it % STAGES
            h = hk * group + it // per_head
            q_start = q_first + (it % per_head) * BLOCK_N
            load_stats(regs, lse, delta, b, h, q_start, lane)  # before the wait: its latency hides under it
            wait(smem, base + EMPTY + s * BARRIER_ELEMENTS, ((it // STAGES) & 1) ^ 1)
            full = base + FULL + s * BARRIER_ELEMENTS
            if lane == 0:
                mbarrier_arrive_expect_tx(smem, full, 2 * 2 * BLOCK_N * D)
                copy_tile(smem, base + Q_AT + s * TILE, full, maps, 0, h, q_start, b, BLOCK_N)
                copy_tile(smem, base + DO_AT + s * TILE, full, maps, 1, h, q_start, b, BLOCK_N)
            store_stats(stats, (base + STATS_AT) // 2 + s * 2 * BLOCK_N, regs, lane)
            mbarrier_arrive(smem, full)  # releases this thread's LSE and D stores with it

    def attention_backward_dkdv_wgmma_ws(q, k, v, dout, lse, delta, dk, dv, scale_log2, left, right, vec, maps, mod):
        # q, dout: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v, dk, dv: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        b, hk, key_start, q_lo, q_hi = key_block(cuda.blockIdx, q, k, BLOCK_M, left, right)
        tid = cuda.threadIdx.x
        q_first = (q_lo // BLOCK_N) * BLOCK_N
        per_head = (q_hi - q_first + BLOCK_N - 1) // BLOCK_N
        ntiles = group * per_head if q_lo < q_hi else 0  # none: no query sees these keys, and dK = dV = 0

        smem = cuda.shared.array(0, types.uint16)
        base = aligned_base(smem)
        if tid == 0:
            mbarrier_init(smem, base + KV_FULL, 1)
            for s in range(STAGES):
                mbarrier_init(smem, base + FULL + s * BARRIER_ELEMENTS, 1 + STATS_THREADS)
                mbarrier_init(smem, base + EMPTY + s * BARRIER_ELEMENTS, CONSUMERS)
        cuda.syncthreads()

        if tid < PRODUCER:
            release_registers()
            if tid < STATS_THREADS and ntiles > 0:
                produce(smem, base, lse, delta, maps, b, hk, key_start, group, q_first, per_head, ntiles, tid)
            return

        take_registers()
        ctid = tid - PRODUCER
        wg, warp, lane = ctid // 128, (ctid % 128) // 32, ctid % 32
        g, t = lane >> 2, lane & 3
        dk_acc = cuda.local.array((DT, 4), types.float32)  # 64 keys x D per warpgroup
        dv_acc = cuda.local.array((DT, 4), types.float32)
        fill(dk_acc, DT, 4, ZERO)
        fill(dv_acc, DT, 4, ZERO)
        warp_key = key_start + wg * 64 + warp * 16

        if ntiles > 0:
            stats = cuda.shared.array(0, types.float32)  # the same memory: the rings' LSE and D
            # A: the warpgroup's 64 keys of K and V; B: the streamed Q and dO, K-major for S^T and dP^T,
            # MN-major for dK and dV.
            descs = operands(shared_address(smem, base), K_AT, V_AT, Q_AT, DO_AT, wg)
            s = cuda.local.array((NT, 4), types.float32)  # S^T, then P^T: 64 keys x BLOCK_N queries
            dp = cuda.local.array((NT, 4), types.float32)  # dP^T, then dS^T
            dlogit = cuda.local.array((NT, 4), types.float32)  # with modifications: d modified / d score
            p = cuda.local.array((PS, 4), types.uint32)  # P^T rounded to 16 bits: the A operand of dV += P^T dO
            d_s = cuda.local.array((PS, 4), types.uint32)  # dS^T rounded: of dK += dS^T Q
            wait(smem, base + KV_FULL, 0)

            for it in range(ntiles):
                h = hk * group + it // per_head
                bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
                q_start = q_first + (it % per_head) * BLOCK_N
                stage = it % STAGES
                at = 2 * stage * TILE  # bytes into the rings
                st = (base + STATS_AT) // 2 + stage * 2 * BLOCK_N
                wait(smem, base + FULL + stage * BARRIER_ELEMENTS, (it // STAGES) & 1)

                step(smem, descs, at, s, dp, dlogit, p, d_s, dk_acc, dv_acc, stats, st, q_start, warp_key, key_start,
                     g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh)
                # The warpgroup's threads read the stage's LSE and D with ordinary loads: its barrier completes
                # those reads before the one arrival, which releases them to the producer's next stores. racecheck
                # does not follow that chain (12 hazards on these reads in scripts/sanitize.py); an arrival by every
                # thread, on one mbarrier or one per warp, satisfied it (0 hazards) but ran 0.73-0.75x SDPA flash
                # at headdim 128 against 0.93-0.98x (H100, fp16, .bench/racebwd.py).
                named_barrier_sync(1 + wg, 128)
                release(smem, base + EMPTY + stage * BARRIER_ELEMENTS, ctid)

        # dK = scale dS^T Q with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_k are dropped.
        scale = natural(scale_log2)
        write_grad(dk, b, warp_key, hk, dk_acc, 0, scale, scale, g, t)
        write_grad(dv, b, warp_key, hk, dv_acc, 0, ONE, ONE, g, t)

    return attention_backward_dkdv_wgmma_ws, _signature(2, mods)


def build_dq(D, tiles, storage, mods=NONE):
    """The dQ kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` with a producer, float16/bfloat16."""
    BLOCK_M, BLOCK_N, CONSUMERS, STAGES = tiles.block_m, tiles.block_n, tiles.warpgroups, tiles.stages
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_AT, DO_AT, K_AT, V_AT, BAR_AT, _ = layout_dq(D, tiles)
    QDO_FULL, FULL, EMPTY = BAR_AT, BAR_AT + BARRIER_ELEMENTS, BAR_AT + (1 + STAGES) * BARRIER_ELEMENTS
    TILE = BLOCK_N * D  # elements of one K or V stage
    copy_tile = bulk_copier(D)
    operands, step = dq_step(D, tiles, storage, mods)
    rows, _ = row_steps(1, NT, mods)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    write_grad = fragment_writer(D, storage)
    release_registers, take_registers = _registers(tiles)
    ZERO = types.float32(0)

    @device_function
    def produce(smem, base, maps, b, h, hk, row_start, n_first, ntiles):
        for which in range(4):  # Q, dO, K, V
            tensormap_acquire(maps, which)
        mbarrier_arrive_expect_tx(smem, base + QDO_FULL, 2 * 2 * BLOCK_M * D)
        copy_tile(smem, base + Q_AT, base + QDO_FULL, maps, 0, h, row_start, b, BLOCK_M)
        copy_tile(smem, base + DO_AT, base + QDO_FULL, maps, 1, h, row_start, b, BLOCK_M)
        for it in range(ntiles):
            s = it % STAGES
            wait(smem, base + EMPTY + s * BARRIER_ELEMENTS, ((it // STAGES) & 1) ^ 1)
            full = base + FULL + s * BARRIER_ELEMENTS
            mbarrier_arrive_expect_tx(smem, full, 2 * 2 * BLOCK_N * D)
            copy_tile(smem, base + K_AT + s * TILE, full, maps, 2, hk, n_first + it * BLOCK_N, b, BLOCK_N)
            copy_tile(smem, base + V_AT + s * TILE, full, maps, 3, hk, n_first + it * BLOCK_N, b, BLOCK_N)

    def attention_backward_dq_wgmma_ws(q, k, v, dout, lse, delta, dq, scale_log2, left, right, vec, maps, mod):
        # q, dout, dq: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv,
        # headdim); lse, delta: (batch, nheads, seqlen_q)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right)
        tid = cuda.threadIdx.x
        n_first = (lo // BLOCK_N) * BLOCK_N
        ntiles = (hi - n_first + BLOCK_N - 1) // BLOCK_N if lo < hi else 0  # none: these rows see no key, dQ = 0

        smem = cuda.shared.array(0, types.uint16)
        base = aligned_base(smem)
        if tid == 0:
            mbarrier_init(smem, base + QDO_FULL, 1)
            for s in range(STAGES):
                mbarrier_init(smem, base + FULL + s * BARRIER_ELEMENTS, 1)
                mbarrier_init(smem, base + EMPTY + s * BARRIER_ELEMENTS, CONSUMERS)
        cuda.syncthreads()

        if tid < PRODUCER:
            release_registers()
            if tid == 0 and ntiles > 0:  # one thread issues the bulk copies
                produce(smem, base, maps, b, h, hk, row_start, n_first, ntiles)
            return

        take_registers()
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        ctid = tid - PRODUCER
        wg, warp, lane = ctid // 128, (ctid % 128) // 32, ctid % 32
        g, t = lane >> 2, lane & 3
        dq_acc = cuda.local.array((DT, 4), types.float32)  # 64 rows x D per warpgroup
        fill(dq_acc, DT, 4, ZERO)
        warp_row = row_start + wg * 64 + warp * 16

        if ntiles > 0:
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
            wait(smem, base + QDO_FULL, 0)

            for it in range(ntiles):
                n_start = n_first + it * BLOCK_N
                stage = it % STAGES
                at = 2 * stage * TILE  # bytes into the rings
                wait(smem, base + FULL + stage * BARRIER_ELEMENTS, (it // STAGES) & 1)
                step(smem, descs, at, s, dp, d_s, dq_acc, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start,
                     g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh)
                release(smem, base + EMPTY + stage * BARRIER_ELEMENTS, ctid)

        # dQ = scale dS K with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_q are dropped.
        scale = natural(scale_log2)
        write_grad(dq, b, warp_row, h, dq_acc, 0, scale, scale, g, t)

    return attention_backward_dq_wgmma_ws, _signature(1, mods)


build_dkdv.min_blocks = build_dq.min_blocks = MIN_BLOCKS


def _signature(n_outputs, mods):
    """The tensor-core backward's signature with the tensor maps' address before the modifications' values."""
    base = tensor_core_backward(n_outputs, mods)
    return base[:-1] + (types.int64,) + base[-1:]
