"""Kernel v5 backward: the wgmma backward with a producer warpgroup and bulk tensor copies (FlashAttention-3's
warp specialization): deterministic, with no atomics, or (``deterministic=False``) one pass with an atomic dQ.

v3's backward (`wgmma.backward`) runs one warpgroup per block that both copies (cp.async) and computes,
with a barrier of the whole block per tile, and the tensor cores wait while it forms P and dS. Here, as
in the v5 forward (`ws_forward`), warpgroup 0 only copies and the ``CONSUMERS`` warpgroups after it only
compute, 64 keys (or query rows) each, waiting for their tiles on "full" mbarriers and releasing them on
"empty" ones (`pipeline`); the consumers of a block share each streamed tile, and while one forms P and
dS on the CUDA cores the tensor cores run the other's products.

* ``preprocess`` (`simt.backward.build_staged_preprocess`): D = rowsum(dO * O) and the base-2 LSE of every
  row, into ``stats`` (batch, nheads, 2, query rows padded to whole tiles), which the kernels below take in
  place of ``delta``: a tile's statistics are two aligned runs of floats.
* ``dkdv``: one block per (key block, kv head, batch element). One producer thread copies the block's K
  and V once, then each query tile's Q and dO (every query head of the GQA group in turn) into a ring
  of ``stages``, and the tile's LSE and D beside them (``cp.async.bulk``, no tensor map), with ALiBi the tile's
  head's slope too (written by the producer's lane 0 before the arrival that lands the stage). A consumer's
  step is v3's: S^T = K Q^T and dP^T = V dO^T, P^T, dV += P^T dO, dS^T, dK += dS^T Q. A stage is
  released by its consumers' threads arriving at a named barrier (one per consumer and stage) where the
  producer's warp waits, in place of an empty mbarrier: see `_build_key_pass`.
* ``dq``: one block per (query block, head, batch element); Q and dO once, then K and V tiles through
  the ring: S = Q K^T, dP = dO V^T, dS, dQ += dS K, the rows' LSE and D in registers. With
  ``tiles.dq_deferred`` (the planned tiles) a tile's dQ += dS K is issued after the next tile's S and dP and
  runs under that tile's dS; its stage is released a tile later, so the ring has three stages
  (`tiling.WGMMA_BACKWARD_TILES` keeps the runs).
* ``dkdv_dq`` (``deterministic=False``, in place of both): the ``dkdv`` kernel whose consumers also store
  their dS^T in shared memory and, after a barrier between them, form dQ = dS K for the tile (wgmma,
  both operands MN-major) and add it to a float32 dQ with atomics (`dq_accumulator`); a row-by-row pass
  then rounds dQ (`simt.backward.build_dq_postprocess`). Five products per tile pair instead of seven.

On the H100 (fp16 and bf16, N = 2048 to 16384, causal and not; scripts/bench.py) the two passes ran
1.22-1.51x SDPA flash's backward at headdim 128 and 0.89-1.19x at 64, against mma.sync's 0.51-0.63x
before the steps skipped their per-score tests on whole tiles; the atomic dQ 0.82-1.02x at 64 (fp16), so
no plan picks it by itself (`tiling.WGMMA_ATOMIC_DQ_HEADDIMS`); `tiling` keeps the tile comparison.

Packed (varlen) sequences run both deterministic passes (not the atomic dQ): the copies start at the block's
sequence's rows, the staged stats at its segment (`sequences.stats_start`), and the streamed tiles that reach
past the sequence (Q and dO in the dK/dV pass, K and V in the dQ pass) have the next sequence's rows zeroed by
the producer's first warp (`pipeline.tail_zeroer`).
"""

from numba import cuda, types

from ...mods import NONE
from ..blocks import key_block, query_blocks, tensor_core_backward
from ..fragments import fill, fragment_writer
from ..gradients import row_steps
from ..intrinsics import (bulk_load, device_function, fence_proxy_async, mbarrier_arrive_expect_tx, mbarrier_init,
                         named_barrier_arrive, named_barrier_sync, red_add2, shared_address, tensormap_acquire,
                         wgmma_commit, wgmma_fence, wgmma_ss, wgmma_wait0, wgmma_wait1)
from ..key_tiles import key_tiles, verdict_slot
from ..mods import modifiers
from ..query_tiles import query_tiles
from . import tensor_maps
from .backward import dkdv_step, dq_parts, dq_step
from ..sequences import sequence_starts, sequences, stats_tile_rows
from .pipeline import (BARRIER_ELEMENTS, PRODUCER, bulk_copier, check_registers, hand_over, register_moves, release,
                       tail_zeroer, wait)
from .tiles import ALIGN, ATOM, advance, aligned_base, operand

# Registers per thread after setmaxnreg (see `pipeline.REGISTERS`): when its warp also copied LSE and D through
# registers, the dK/dV producer spilled 8 bytes with 24 (ptxas, sm_90a, headdim 64); with 40, none.
REGISTERS = check_registers({1: (56, 256), 2: (40, 232)})
SHARED_REGISTERS = check_registers({1: (40, 216)}, 2)  # two blocks per multiprocessor (`pipeline.SHARED_REGISTERS`)
# Launch bounds of at least one block per multiprocessor: with the thread count alone ptxas cannot tell the
# registers at entry, ignores setmaxnreg (warning C7508) and keeps every thread at 168, where the headdim-64
# dK/dV kernel spilled 188 bytes.
MIN_BLOCKS = 1
DS_TILES = 2  # dS^T tiles of the dK/dV kernel that accumulates dQ: one is written while the other is read
DS_BARRIER = 1  # the named barrier of its consumers
FIRST_RELEASE_BARRIER = 2  # the dK/dV kernels' release barriers, one per consumer and stage (8 at most of 16)
DQ_ACC = types.Array(types.float32, 4, "C")
STATS = types.Array(types.float32, 4, "C")  # the staged preprocess's (batch, nheads, 2, padded rows)


def tensor_map_args(q, k, v, dout, tiles):
    """The two kernels' map sets: ``(dkdv, dq)``, each of Q, dO, K and V with the rows of its tiles."""
    streamed, owned = tiles.block_n, tiles.block_m
    return (tensor_maps.maps([(q, streamed), (dout, streamed), (k, owned), (v, owned)]),
            tensor_maps.maps([(q, owned), (dout, owned), (k, streamed), (v, streamed)]))


SLOPE_ELEMENTS = 8  # 16-bit elements of a stage's slope slot: 16 bytes, as the rings' alignment


def layout_dkdv(D, tiles, accumulate_dq=False):
    """Element offsets from the aligned base: K and V (block_m rows), the Q and dO rings (stages of block_n
    rows), with ``accumulate_dq`` two dS^T tiles (block_m keys x block_n queries; none otherwise), the rings'
    LSE and D (float32), each stage's head's ALiBi slope (float32, 16 bytes a stage), the mbarriers (K and V full;
    full per stage; a packed sequence's last tiles), the end."""
    sizes = (tiles.block_m * D, tiles.block_m * D, tiles.stages * tiles.block_n * D,
             tiles.stages * tiles.block_n * D, DS_TILES * tiles.block_m * tiles.block_n if accumulate_dq else 0,
             tiles.stages * 2 * tiles.block_n * 2, tiles.stages * SLOPE_ELEMENTS, (2 + tiles.stages) * BARRIER_ELEMENTS)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def layout_dq(D, tiles):
    """Element offsets from the aligned base: Q and dO (block_m rows), the K and V rings, the mbarriers (Q and dO
    full; full and empty per stage; a packed sequence's last tile)."""
    sizes = (tiles.block_m * D, tiles.block_m * D, tiles.stages * tiles.block_n * D,
             tiles.stages * tiles.block_n * D, (2 + 2 * tiles.stages) * BARRIER_ELEMENTS)
    return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))


def smem_bytes_dkdv(D, tiles, accumulate_dq=False):
    return 2 * layout_dkdv(D, tiles, accumulate_dq)[-1] + ALIGN


def smem_bytes_dq(D, tiles):
    return 2 * layout_dq(D, tiles)[-1] + ALIGN


def pair_copier(D):
    """``copy_pair(smem, landed, maps, which, first_at, second_at, head, row, at, rows, extra)``: rows ``row ..``
    of ``head`` of two operands, maps ``which`` and ``which + 1`` (Q and dO, or K and V), into the tiles at
    ``first_at`` and ``second_at``, landing on ``landed``, which expects them and ``extra`` bytes more (copied
    after)."""
    copy_tile = bulk_copier(D)

    @device_function
    def copy_pair(smem, landed, maps, which, first_at, second_at, head, row, at, rows, extra):
        mbarrier_arrive_expect_tx(smem, landed, 2 * 2 * rows * D + extra)
        copy_tile(smem, first_at, landed, maps, which, head, row, at, rows)
        copy_tile(smem, second_at, landed, maps, which + 1, head, row, at, rows)

    return copy_pair


def pair_zeroer(D):
    """``zero_pair(smem, words, first_at, second_at, rows, first, full, lane)``: the producer's first warp zeroes
    rows ``first ..`` of the two streamed ``rows``-row tiles a packed sequence's last tile brought past its end,
    and hands them to the consumers on ``full`` (`pipeline.tail_zeroer`)."""
    zero_rows = tail_zeroer(D)

    @device_function
    def zero_pair(smem, words, first_at, second_at, rows, first, full, lane):
        zero_rows(words, first_at, rows, first, lane)
        zero_rows(words, second_at, rows, first, lane)
        hand_over(smem, full, lane)

    return zero_pair


def build_dkdv(D, tiles, storage, mods=NONE):
    """The dK/dV kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` with a producer, float16/bfloat16."""
    return _build_key_pass(D, tiles, storage, mods, accumulate_dq=False)


def build_dkdv_dq(D, tiles, storage, mods=NONE):
    """The dK/dV kernel that also accumulates dQ (``deterministic=False``): it takes a float32 ``dq_acc``
    (batch, nheads, seqlen_q rounded up to block_n, D) of zeros after dv, and adds dS K into it."""
    return _build_key_pass(D, tiles, storage, mods, accumulate_dq=True)


def ds_storer(BLOCK_N):
    """``store(d_s, words, ds_word, warp, g, t)``: a warp's 16 keys (``warp`` counts 16-key groups from the
    block's first key) of dS^T, as its A words, into a swizzled keys x 64 queries tile from ``words[ds_word]``
    (``words``: shared memory as 32-bit words), where wgmma reads it as the MN-major A of dQ = dS K: key r,
    query c at byte (r // 8) 1024 + (r % 8) 128 + ((c // 8) ^ (r % 8)) 16 + 2 (c % 8). Each store of a warp
    covers 8 keys' 16-byte chunks, which the swizzle puts on distinct banks."""
    if BLOCK_N != 64:
        raise ValueError(f"dS^T is stored as 64-query rows (one swizzle atom); got tiles of {BLOCK_N} queries")

    @device_function
    def store(d_s, words, ds_word, warp, g, t):
        for ks in range(BLOCK_N // 16):
            for r in range(4):
                lo, hi = r & 1, r >> 1  # key row g + 8 lo; query columns 16 ks + 8 hi + 2 t, + 1
                byte = (2 * warp + lo) * 1024 + g * 128 + ((2 * ks + hi) ^ g) * 16 + 4 * t
                words[ds_word + byte // 4] = d_s[ks, r]

    return store


def dq_accumulator(D, tiles, storage):
    """``add_dq(smem, address, ds_at, k_at, dq, dq_acc, it, wg, b, h, q_start, warp, g, t)``: dQ += dS K for the
    query tile of iteration ``it``, from the dS^T tile at element ``ds_at`` (every consumer's 64 keys) and the
    block's K at ``k_at``, in 64-column chunks of the head dim: chunk c is warpgroup (it + c) % CONSUMERS's, so
    at headdim 64 two consumers take turns. A chunk's 64 x 64 float32 (``dq``: its (8, 4) fragment array) is
    added to ``dq_acc`` with atomics. Waits for every wgmma of the warpgroup.

    Each consumer adding its own keys' part instead (no barrier between the consumers, twice the atomics) ran
    0.66-0.73x SDPA flash at headdim 64 against 0.69-0.78x (H100, fp16, .bench/atomicbwd.py). Letting the
    consumer that owns no chunk of a tile only arrive at the barrier and go on (safe with alternating dS^T
    tiles) ran 0.64-0.77x, within the runs' spread, so the simpler wait of both stays."""
    BLOCK_M, CONSUMERS, CHUNKS = tiles.block_m, tiles.warpgroups, D // ATOM
    first, product = wgmma_ss(ATOM, storage, mn_major=True, fresh=True), wgmma_ss(ATOM, storage, mn_major=True)
    K_STEP = 16 * ATOM * 2  # bytes: 16 rows of a 64-column atom, along both operands' K (keys)

    @device_function
    def add_dq(smem, address, ds_at, k_at, dq, dq_acc, it, wg, b, h, q_start, warp, g, t):
        ds_desc = operand(address, ds_at, BLOCK_M, True)
        row = q_start + 16 * warp + g
        # The chunks with (it + c) % CONSUMERS == wg; a loop from a computed start, where one over every chunk
        # with a test in it left 8 bytes of local memory at headdim 64 and ran 5% slower (H100 JIT).
        for c in range((wg - it) % CONSUMERS, CHUNKS, CONSUMERS):
            k_desc = operand(address, k_at + c * BLOCK_M * ATOM, BLOCK_M, True)
            wgmma_fence()
            first(dq, smem, ds_desc, k_desc, 0)  # dq's old values are not inputs: not live between tiles
            for ks in range(1, BLOCK_M // 16):
                product(dq, smem, advance(ds_desc, ks * K_STEP), advance(k_desc, ks * K_STEP), 1)
            wgmma_commit()
            wgmma_wait0()
            for j in range(ATOM // 8):
                for half in range(2):
                    red_add2(dq_acc, (b, h, row + 8 * half, c * ATOM + 8 * j + 2 * t), dq[j, 2 * half],
                             dq[j, 2 * half + 1])

    return add_dq


def _build_key_pass(D, tiles, storage, mods, accumulate_dq):
    BLOCK_M, BLOCK_N, CONSUMERS, STAGES = tiles.block_m, tiles.block_n, tiles.warpgroups, tiles.stages
    NT, DT, PS, AT = BLOCK_N // 8, D // 8, BLOCK_N // 16, ATOM // 8
    K_AT, V_AT, Q_AT, DO_AT, DS_AT, STATS_AT, SLOPE_AT, BAR_AT, _ = layout_dkdv(D, tiles, accumulate_dq)
    KV_FULL, FULL, TAIL = BAR_AT, BAR_AT + BARRIER_ELEMENTS, BAR_AT + (1 + STAGES) * BARRIER_ELEMENTS
    PACKED = mods.packed
    if PACKED and accumulate_dq:
        raise ValueError(f"{tiles}: the atomic dQ does not take packed (varlen) sequences")
    starts = sequence_starts(mods, stats_tile_rows(tiles))
    sequence = sequences(mods)
    copy_pair, zero_pair = pair_copier(D), pair_zeroer(D)
    TILE = BLOCK_N * D  # elements of one Q or dO stage
    STATS_BYTES = 2 * 4 * BLOCK_N  # a tile's LSE and D
    ACCUMULATE_DQ = accumulate_dq
    RELEASE_THREADS = 128 + 32  # a consumer warpgroup arriving, the producer's warp waiting
    operands, step = dkdv_step(D, tiles, storage, mods)
    store_ds = ds_storer(BLOCK_N) if accumulate_dq else None
    add_dq = dq_accumulator(D, tiles, storage) if accumulate_dq else None
    tile_count, tile_of, tile_full = query_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, prepare_staged, slope_of, natural = (modifier.prepare, modifier.prepare_staged, modifier.slope,
                                                  modifier.natural)
    # The head's slope staged with each tile by the producer: a consumer that loaded it and divided for the
    # tile's head ran 100 more warp instructions a tile than the plain kernel (ncu, H200, headdim 64)
    ALIBI = mods.alibi
    write_grad = fragment_writer(D, storage)
    release_registers, take_registers = register_moves(tiles, (REGISTERS, SHARED_REGISTERS))
    ZERO, ONE = types.float32(0), types.float32(1)

    @device_function
    def copy_query_tile(smem, base, delta, maps, h, q_start, it, q_seq, stats_first, at, landed):
        # Query tile it (head h, from row q_start)'s Q and dO, and its LSE and D, into its stage, landing on
        # ``landed`` (the stage's full mbarrier, or a packed sequence's tail's); q_seq, stats_first, at: where the
        # block's sequence lies in the operands and the staged stats (`sequences.sequence_starts`).
        s = it % STAGES
        copy_pair(smem, landed, maps, 0, base + Q_AT + s * TILE, base + DO_AT + s * TILE, h, q_seq + q_start, at,
                  BLOCK_N, STATS_BYTES)
        # The tile's LSE, then its D (float32: two 16-bit elements each), as the consumers read them.
        stats_at = base + STATS_AT + s * 4 * BLOCK_N
        bulk_load(smem, stats_at, delta, (at, h, 0, stats_first + q_start), STATS_BYTES // 2, landed)
        bulk_load(smem, stats_at + 2 * BLOCK_N, delta, (at, h, 1, stats_first + q_start), STATS_BYTES // 2, landed)

    @device_function
    def slope_slot(base, stage):
        # float32 index of ring stage ``stage``'s ALiBi slope (written by the producer, read by the consumers)
        return (base + SLOPE_AT) // 2 + stage * (SLOPE_ELEMENTS // 2)

    @device_function
    def release_barrier(wg, it):
        # The named barrier of consumer wg's release of tile it's stage: one per consumer and stage, so that a
        # consumer's arrivals for the next tile (which it reaches before the producer waits for this one) count
        # towards another barrier.
        return FIRST_RELEASE_BARRIER + wg * STAGES + it % STAGES

    @device_function
    def freed(it):
        # Until every consumer's threads arrived at the end of tile it: its stage is free.
        for c in range(CONSUMERS):
            named_barrier_sync(release_barrier(c, it), RELEASE_THREADS)

    @device_function
    def produce(smem, words, base, delta, maps, mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, ntiles, lane):
        # By the producer's first warp: its lane 0 issues the copies, the whole warp joins the consumers' barriers
        # (and zeroes a packed sequence's last query tiles' extra rows, `pipeline.tail_zeroer`).
        q_seq, k_seq, stats_first, at = starts(mod, b)
        if lane == 0:
            for which in range(4):  # Q, dO, K, V
                tensormap_acquire(maps, which)
            copy_pair(smem, base + KV_FULL, maps, 2, base + K_AT, base + V_AT, hk, k_seq + key_start, at, BLOCK_M, 0)
        tails = 0  # one per query head of the group: the tail mbarrier's phases
        for it in range(ntiles):
            # A block mask's table is read while the consumers finish the stage's last tile.
            h, q_start = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it)
            if it >= STAGES:  # the stage's last tile, it - STAGES, is done with
                freed(it - STAGES)
            s = it % STAGES
            full = base + FULL + s * BARRIER_ELEMENTS
            tail = PACKED and q_start + BLOCK_N > seqlen_q
            if lane == 0:
                if ALIBI:  # before the arrival that lands the stage (the consumers' wait orders their read after it)
                    slopes = cuda.shared.array(0, types.float32)
                    slopes[slope_slot(base, s)] = slope_of(prepare(b, h, mod))
                copy_query_tile(smem, base, delta, maps, h, q_start, it, q_seq, stats_first, at,
                                base + TAIL if tail else full)
            if tail:
                wait(smem, base + TAIL, tails & 1)
                zero_pair(smem, words, base + Q_AT + s * TILE, base + DO_AT + s * TILE, BLOCK_N, seqlen_q - q_start,
                          full, lane)
                tails += 1
        for it in range(max(ntiles - STAGES, 0), ntiles):  # every consumer's arrivals are met
            freed(it)

    @device_function
    def key_pass(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale_log2, left, right, vec, maps, mod):
        # q, dout: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v, dk, dv: (batch, seqlen_k, nheads_kv,
        # headdim); lse: (batch, nheads, seqlen_q), unread; delta: the staged preprocess's stats (batch, nheads, 2,
        # rows padded); dq_acc: see build_dkdv_dq (unused without it)
        if PACKED:  # a varlen call: the block's own sequence (`kernels.sequences`), q and k for their lengths
            q_seq, q_end, k_seq, k_end = sequence(mod, cuda.blockIdx.z)
            q, k = q[:, q_seq:q_end], k[:, k_seq:k_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        b, hk, key_start, q_lo, q_hi = key_block(cuda.blockIdx, q, k, BLOCK_M, left, right)
        if PACKED and key_start >= seqlen_k:  # past its sequence's key blocks: the grid covers the longest
            return
        tid = cuda.threadIdx.x
        ntiles = tile_count(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q)  # 0: dK = dV = 0

        smem = cuda.shared.array(0, types.uint16)
        base = aligned_base(smem)
        if tid == 0:
            mbarrier_init(smem, base + KV_FULL, 1)
            mbarrier_init(smem, base + TAIL, 1)
            for s in range(STAGES):
                mbarrier_init(smem, base + FULL + s * BARRIER_ELEMENTS, 1)
        cuda.syncthreads()

        if tid < PRODUCER:
            release_registers()
            if tid < 32 and ntiles > 0:  # the first warp: one thread issues the bulk copies
                produce(smem, cuda.shared.array(0, types.uint64), base, delta, maps, mod, b, hk, key_start, group,
                        q_lo, q_hi, seqlen_q, ntiles, tid)
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
            words = cuda.shared.array(0, types.uint32)  # and in 32-bit words: the dS^T tiles
            # A: the warpgroup's 64 keys of K and V; B: the streamed Q and dO, K-major for S^T and dP^T,
            # MN-major for dK and dV.
            descs = operands(shared_address(smem, base), K_AT, V_AT, Q_AT, DO_AT, wg)
            s = cuda.local.array((NT, 4), types.float32)  # S^T, then P^T: 64 keys x BLOCK_N queries
            dp = cuda.local.array((NT, 4), types.float32)  # dP^T, then dS^T
            dlogit = cuda.local.array((NT, 4), types.float32)  # with modifications: d modified / d score
            p = cuda.local.array((PS, 4), types.uint32)  # P^T rounded to 16 bits: the A operand of dV += P^T dO
            d_s = cuda.local.array((PS, 4), types.uint32)  # dS^T rounded: of dK += dS^T Q
            dq_frag = cuda.local.array((AT, 4), types.float32)  # a 64 x 64 chunk of dS K
            wait(smem, base + KV_FULL, 0)

            for it in range(ntiles):
                # A block mask's table is read before the wait (the forward's reason)
                h, q_start = tile_of(mod, b, hk, key_start, group, q_lo, q_hi, seqlen_q, it)
                full, slot = tile_full(mod, b, hk, key_start, it), tile_slot(mod, b, hk, key_start, it)
                stage = it % STAGES
                at = 2 * stage * TILE  # bytes into the rings
                st = (base + STATS_AT) // 2 + stage * 2 * BLOCK_N
                wait(smem, base + FULL + stage * BARRIER_ELEMENTS, (it // STAGES) & 1)
                # what the modifications read for this head (`kernels.mods`); its slope as the producer staged it,
                # read after the wait (read before it, racecheck found 24 hazards: the producer refills the slot once
                # the stage's last tile is released, which may come after this consumer reaches the read)
                bh = prepare_staged(mod, stats[slope_slot(base, stage)]) if ALIBI else prepare(b, h, mod)

                step(smem, descs, at, s, dp, dlogit, p, d_s, dk_acc, dv_acc, stats, st, q_start, warp_key, key_start,
                     g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh, full, mod, slot)
                # The warpgroup's threads read the stage's LSE and D with ordinary loads; each then arrives at
                # the stage's release barrier, where the producer's warp waits before the copy engine overwrites
                # the stage. With a barrier of the warpgroup and then one thread's arrival on an empty mbarrier
                # instead, racecheck reported 12 hazards on these reads: it does not follow that chain (nor a
                # warp's bar.warp.sync before its lane 0's arrival); an arrival on it by every thread, which it
                # followed, ran 0.73-0.75x SDPA flash at headdim 128 against 0.93-0.98x (H100, fp16). Waiting at
                # a barrier of the warpgroup and the producer's warp instead, synccheck reported the barrier
                # divergent (the warp reaches it from other code).
                if ACCUMULATE_DQ:
                    ds_at = DS_AT + (it % DS_TILES) * BLOCK_M * BLOCK_N
                    store_ds(d_s, words, (base + ds_at) // 2, (warp_key - key_start) // 16, g, t)
                    fence_proxy_async()  # the stores reach wgmma's (async proxy) reads of the tile
                    # Every consumer's dS^T is in its tile; the tile written next was last read by the products
                    # of two tiles ago, which every consumer waited for before this barrier.
                    named_barrier_sync(DS_BARRIER, 128 * CONSUMERS)
                    add_dq(smem, shared_address(smem, base), ds_at, K_AT, dq_frag, dq_acc, it, wg, b, h, q_start,
                           warp, g, t)
                named_barrier_arrive(release_barrier(wg, it), RELEASE_THREADS)

        # dK = scale dS^T Q with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_k are dropped.
        scale = natural(scale_log2)
        if PACKED:  # narrowed here, not kept live through the loop (the forward's reason)
            _, _, k_seq, k_end = sequence(mod, cuda.blockIdx.z)
            dk, dv = dk[:, k_seq:k_end], dv[:, k_seq:k_end]
        write_grad(dk, b, warp_key, hk, dk_acc, 0, scale, scale, g, t)
        write_grad(dv, b, warp_key, hk, dv_acc, 0, ONE, ONE, g, t)

    if accumulate_dq:
        def attention_backward_dkdvdq_wgmma_ws(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale_log2, left, right, vec,
                                               maps, mod):
            key_pass(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale_log2, left, right, vec, maps, mod)

        signature = _signature(2, mods)
        return attention_backward_dkdvdq_wgmma_ws, signature[:8] + (DQ_ACC,) + signature[8:]

    def attention_backward_dkdv_wgmma_ws(q, k, v, dout, lse, delta, dk, dv, scale_log2, left, right, vec, maps, mod):
        key_pass(q, k, v, dout, lse, delta, dk, dv, dk, scale_log2, left, right, vec, maps, mod)

    return attention_backward_dkdv_wgmma_ws, _signature(2, mods)


def build_dq(D, tiles, storage, mods=NONE):
    """The dQ kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` with a producer, float16/bfloat16."""
    BLOCK_M, BLOCK_N, CONSUMERS, STAGES = tiles.block_m, tiles.block_n, tiles.warpgroups, tiles.stages
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_AT, DO_AT, K_AT, V_AT, BAR_AT, _ = layout_dq(D, tiles)
    QDO_FULL, FULL, EMPTY = BAR_AT, BAR_AT + BARRIER_ELEMENTS, BAR_AT + (1 + STAGES) * BARRIER_ELEMENTS
    TAIL = BAR_AT + (1 + 2 * STAGES) * BARRIER_ELEMENTS
    PACKED = mods.packed
    starts = sequence_starts(mods, stats_tile_rows(tiles))
    sequence = sequences(mods)
    copy_pair, zero_pair = pair_copier(D), pair_zeroer(D)
    TILE = BLOCK_N * D  # elements of one K or V stage
    parts = dq_parts(D, tiles, storage, mods)
    _, scores, form_ds, add_dq, pack = parts
    operands, step = dq_step(parts)
    DEFERRED = tiles.dq_deferred
    rows, _ = row_steps(1, NT, mods, staged=True)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)

    @device_function
    def tile_info(mod, b, h, row_start, n_base, it):
        # key tile it's first key, and a block mask's full bit and verdicts' slot, read before the tile's wait (the
        # forward's reason)
        return (tile_start(mod, b, h, row_start, n_base, it), tile_full(mod, b, h, row_start, it),
                tile_slot(mod, b, h, row_start, it))
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, natural = modifier.prepare, modifier.natural
    write_grad = fragment_writer(D, storage)
    release_registers, take_registers = register_moves(tiles, (REGISTERS, SHARED_REGISTERS))
    ZERO = types.float32(0)

    @device_function
    def produce(smem, words, base, maps, mod, b, h, hk, row_start, n_base, ntiles, seqlen_k, lane):
        # Lane 0 issues the copies; with packed sequences the whole first warp runs it, and zeroes the extra rows
        # of the sequence's last key tile (`pipeline.tail_zeroer`): dQ = dS K would take an inf there times a
        # zero dS.
        q_seq, k_seq, _, at = starts(mod, b)
        if lane == 0:
            for which in range(4):  # Q, dO, K, V
                tensormap_acquire(maps, which)
            copy_pair(smem, base + QDO_FULL, maps, 0, base + Q_AT, base + DO_AT, h, q_seq + row_start, at, BLOCK_M, 0)
        for it in range(ntiles):
            s = it % STAGES
            n_start = tile_start(mod, b, h, row_start, n_base, it)  # a block mask's table read while the stage drains
            wait(smem, base + EMPTY + s * BARRIER_ELEMENTS, ((it // STAGES) & 1) ^ 1)
            full = base + FULL + s * BARRIER_ELEMENTS
            tail = PACKED and n_start + BLOCK_N > seqlen_k
            landed = base + TAIL if tail else full
            if lane == 0:
                copy_pair(smem, landed, maps, 2, base + K_AT + s * TILE, base + V_AT + s * TILE, hk, k_seq + n_start,
                          at, BLOCK_N, 0)
            if tail:  # the last tile: one per block
                wait(smem, base + TAIL, 0)
                zero_pair(smem, words, base + K_AT + s * TILE, base + V_AT + s * TILE, BLOCK_N, seqlen_k - n_start,
                          full, lane)

    query_block = query_blocks(mods)

    def attention_backward_dq_wgmma_ws(q, k, v, dout, lse, delta, dq, scale_log2, left, right, vec, maps, mod):
        # q, dout, dq: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv,
        # headdim); lse: (batch, nheads, seqlen_q), unread; delta: the staged preprocess's stats
        if PACKED:  # a varlen call: the block's own sequence (`kernels.sequences`), q and k for their lengths
            q_seq, q_end, k_seq, k_end = sequence(mod, cuda.blockIdx.z)
            q, k = q[:, q_seq:q_end], k[:, k_seq:k_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        tid = cuda.threadIdx.x
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)  # 0: these rows see no key, dQ = 0

        smem = cuda.shared.array(0, types.uint16)
        base = aligned_base(smem)
        if tid == 0:
            mbarrier_init(smem, base + QDO_FULL, 1)
            mbarrier_init(smem, base + TAIL, 1)
            for s in range(STAGES):
                mbarrier_init(smem, base + FULL + s * BARRIER_ELEMENTS, 1)
                mbarrier_init(smem, base + EMPTY + s * BARRIER_ELEMENTS, CONSUMERS)
        cuda.syncthreads()

        if tid < PRODUCER:
            release_registers()
            if tid < (32 if PACKED else 1) and ntiles > 0:  # one thread issues the bulk copies
                produce(smem, cuda.shared.array(0, types.uint64), base, maps, mod, b, h, hk, row_start, n_base,
                        ntiles, seqlen_k, tid)
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
            _, _, stats_first, at = starts(mod, b)  # a packed sequence's rows in the stats' one batch element
            rows(lse2, dsum, lo_r, hi_r, lse, delta[:, :, :, stats_first:], at, h, warp_row, g, seqlen_q, seqlen_k,
                 left, right)
            # A: the warpgroup's 64 rows of Q and dO; B: the streamed K (K-major for S, MN-major for dQ) and V.
            descs = operands(shared_address(smem, base), Q_AT, DO_AT, K_AT, V_AT, wg)
            s = cuda.local.array((NT, 4), types.float32)  # S: 64 rows x BLOCK_N keys per warpgroup
            dp = cuda.local.array((NT, 4), types.float32)  # dP, then dS
            d_s = cuda.local.array((PS, 4), types.uint32)  # dS rounded to 16 bits: the A operand of dQ += dS K
            wait(smem, base + QDO_FULL, 0)

            if DEFERRED:
                # Tile it's dQ += dS K is issued after tile it + 1's S and dP, and runs under that tile's dS; its
                # stage is released once it is done. Nothing is in flight across the loop's edge.
                n_start, full, slot = tile_info(mod, b, h, row_start, n_base, 0)
                wait(smem, base + FULL, 0)
                scores(smem, descs, 0, s, dp)
                wgmma_wait0()
                form_ds(s, dp, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start, g, t, seqlen_q, seqlen_k,
                        left, right, scale_log2, b, h, bh, full, mod, slot)
                pack(d_s, dp)
                last = 0  # the stage of the tile whose dS is in d_s
                for it in range(1, ntiles):
                    n_start, full, slot = tile_info(mod, b, h, row_start, n_base, it)
                    stage = it % STAGES
                    wait(smem, base + FULL + stage * BARRIER_ELEMENTS, (it // STAGES) & 1)
                    scores(smem, descs, 2 * stage * TILE, s, dp)
                    add_dq(smem, descs, 2 * last * TILE, d_s, dq_acc)
                    wgmma_commit()
                    wgmma_wait1()  # S and dP are done; the last tile's dQ may still run under dS below
                    form_ds(s, dp, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row, n_start, g, t, seqlen_q,
                            seqlen_k, left, right, scale_log2, b, h, bh, full, mod, slot)
                    wgmma_wait0()  # d_s and the last tile's K are no longer read
                    release(smem, base + EMPTY + last * BARRIER_ELEMENTS, ctid)
                    pack(d_s, dp)
                    last = stage
                wgmma_fence()
                add_dq(smem, descs, 2 * last * TILE, d_s, dq_acc)
                wgmma_commit()
                wgmma_wait0()
                release(smem, base + EMPTY + last * BARRIER_ELEMENTS, ctid)
            else:
                for it in range(ntiles):
                    n_start, full, slot = tile_info(mod, b, h, row_start, n_base, it)
                    stage = it % STAGES
                    at = 2 * stage * TILE  # bytes into the rings
                    wait(smem, base + FULL + stage * BARRIER_ELEMENTS, (it // STAGES) & 1)
                    step(smem, descs, at, s, dp, d_s, dq_acc, lse2, dsum, lo_r, hi_r, row_start, row_end, warp_row,
                         n_start, g, t, seqlen_q, seqlen_k, left, right, scale_log2, b, h, bh, full, mod, slot)
                    release(smem, base + EMPTY + stage * BARRIER_ELEMENTS, ctid)

        # dQ = scale dS K with scale = scale_log2 ln(2) (the scale argument with modifications); the rows past
        # seqlen_q are dropped.
        scale = natural(scale_log2)
        if PACKED:
            q_seq, q_end, _, _ = sequence(mod, cuda.blockIdx.z)
            dq = dq[:, q_seq:q_end]
        write_grad(dq, b, warp_row, h, dq_acc, 0, scale, scale, g, t)

    return attention_backward_dq_wgmma_ws, _signature(1, mods)


def min_blocks(tiles):
    """The launch bounds' blocks per multiprocessor (`compiled.kernel`): `MIN_BLOCKS` for every tiling."""
    return MIN_BLOCKS


build_dkdv.min_blocks = build_dkdv_dq.min_blocks = build_dq.min_blocks = min_blocks


def _signature(n_outputs, mods):
    """The tensor-core backward's signature with the staged preprocess's stats in place of delta and the tensor
    maps' address before the modifications' values."""
    base = tensor_core_backward(n_outputs, mods)
    return base[:5] + (STATS,) + base[6:-1] + (types.int64,) + base[-1:]
