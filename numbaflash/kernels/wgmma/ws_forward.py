"""Kernels v4 and v5: the wgmma forward with a producer warpgroup (FlashAttention-3's warp specialization).

v3 (`wgmma.forward`) makes every thread both copy tiles and compute, with a barrier of the whole block
per key tile. Here warpgroup 0 only copies: Q once, then K and V tile by tile into rings of ``stages`` tiles,
each 16-byte cp.async landing on an mbarrier (``cp.async.mbarrier.arrive.noinc``). The ``CONSUMERS``
warpgroups after it only compute, 64 query rows each, exactly as v3's warpgroups do (S of the next
tile overlapped with the last tile's P V), and wait for their tiles on the "full" mbarriers; once a
stage has been read they arrive on its "empty" mbarrier, which the producer waits on before it refills
it. No barrier of the whole block runs in the loop, and ``setmaxnreg`` moves registers from the
producer, which needs few, to the consumers, whose accumulators need many.

Measured on the H200 (fp16, N = 4096 and 16384, against SDPA flash in the same run): 0.60-0.73x at
headdim 64 (128 x 128) and 0.61-0.67x at 128 (128 x 96), below v3's 0.68-0.90x, so the plans run v3.
The producer's four warps issue every 16-byte copy of a tile (12 to 16 each per tile and operand), and
that issue rate, not the tensor cores, bounds it; the copy engine's bulk tensor copies (TMA), one
instruction per tile, are what this structure is for. Selected with ``WgmmaTiles(..., producer=True)``.

v5 (``tma=True``) is that: one producer thread issues each tile as bulk tensor copies (one per 64-column
swizzle atom) through `tensor_maps`, delivered to the "full" mbarriers by byte count (expect-tx), K one
tile ahead of V. It acquires the maps once per block: acquired before every copy, each copy invalidated
the copy engine's descriptor cache and waited for all outstanding loads, and the consumers waited for
tiles a quarter of the time. Since then it runs 0.67-1.37x SDPA flash at headdim 64, 0.88-1.82x at 128
and 1.09-2.24x at 256 (H100, N = 2048 to 16384; `tiling` keeps the records), and every Hopper plan
runs it.

With ``pingpong`` (FlashAttention-3's inter-warpgroup schedule) the consumers take turns: each waits on
its named barrier before it issues a tile's two products and then arrives on the next consumer's, so
while one runs its softmax on the CUDA cores the tensor cores work through the other's products. The
last consumer's first arrival lets the first go; its last arrival is left out, since no turn waits for
it (a barrier left half-arrived at exit). Every consumer of a block visits the same key tiles, so their
turns pair up.

With ALiBi alone and ``tiles.alibi_columns`` each tile's S starts from ALiBi's column term, one more bfloat16
k-step whose operands the block writes into shared memory once (`alibi_columns`). With ``tiles.row_sums`` the
tensor cores sum each row's P beside P V, into 8 more columns of O's accumulators (`row_sums`), and with float16
storage the ``exp2_fma`` chunks take their exponentials as float16 pairs when P is packed (`tiles.pack_p`).

With ``tiles.scores_ahead`` each consumer issues a key tile's S one tile early, into a second register set, beside
the P V before it (`step_ahead`): a tile's softmax starts without waiting for a product, while the tensor cores work
through the last tile's P V and the next tile's S, and both are waited for after it, so no product is in flight
across a branch or the loop's edge. K's copies then run two tiles ahead of V's. softcap alone at headdim 128 ran 4%
faster with it than on two consumers' ping-pong, and 2% slower than on three consumers
(`tiling.WGMMA_SOFTCAP_TILES`, which keeps the runs): no plan takes it now; ``tiles=`` does.

Packed (varlen) sequences run v5 (not v4): the tensor maps span the packed operands, a block's copies start at
its sequence's rows (`sequences.sequence_starts`), and the last V tile of a sequence that ends inside it has
the next sequence's rows zeroed by the producer's first warp before the consumers take it
(`pipeline.tail_zeroer`).
"""

from numba import cuda, types

from ...mods import NONE
from ..blocks import TENSOR_CORE_FORWARD, query_blocks, write_hidden_rows
from ..intrinsics import (cp_async_mbarrier_arrive, cp_async_wait_all, device_function, fence_proxy_async,
                         mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, named_barrier_arrive,
                         named_barrier_sync, shared_address, tensormap_acquire, warp_uniform, wgmma_commit,
                         wgmma_fence, wgmma_wait0, wgmma_wait1)
from ..fragments import fragment_writer
from ..key_tiles import key_tiles, tile_order, verdict_slot
from ..mods import alibi_columns_units, alibi_side, kernel_type, modifiers
from ..sequences import sequence_starts, sequences
from ..softmax import steps
from . import alibi_columns, row_sums, tensor_maps
from .forward import layout
from .pipeline import BARRIER_ELEMENTS, PRODUCER, bulk_copier, hand_over, register_moves, release, tail_zeroer, wait
from .tiles import ALIGN, advance, aligned_base, descriptors, pack_p, products, stager

# Ping-pong: consumer warpgroup w waits on named barrier TURN + w before it issues a tile's products and
# then arrives on the next one's; each barrier completes with the waiting warpgroup and the arriving one.
TURN, TURN_THREADS = 1, 256


def min_blocks(tiles):
    """The launch bounds' blocks per multiprocessor (`compiled.kernel`): one with ``scores_ahead``, whose second S
    needs the registers setmaxnreg gives the consumers; with the thread count alone ptxas cannot tell the registers at
    entry, ignores setmaxnreg (warning C7508) and spilled 256 bytes at 168 (headdim 64, 128 x 96; ptxas 13.0). The
    other tilings keep the bounds they were measured with."""
    return 1 if tiles.scores_ahead else None


def tensor_map_args(q, k, v, tiles):
    """The kernel's last argument: the address of the Q, K and V tensor maps with ``tiles.tma``, else 0."""
    if not tiles.tma:
        return 0
    return tensor_maps.maps([(q, tiles.block_m), (k, tiles.block_n), (v, tiles.block_n)])


def barriers(tiles):
    """mbarriers of a block: Q full; K full, V full, K empty, V empty per stage; a packed sequence's last V tile."""
    return 1 + 4 * tiles.stages + 1


def columns_elements(tiles):
    """16-bit elements of ALiBi's column operands after v3's tiles (``tiles.alibi_columns``), else 0."""
    return alibi_columns.elements(tiles.block_n) if tiles.alibi_columns else 0


def ones_elements(tiles):
    """16-bit elements of the row sums' ones after the column operands (``tiles.row_sums``), else 0."""
    return row_sums.elements() if tiles.row_sums else 0


def smem_bytes(D, tiles):
    """Dynamic shared memory of a block: v3's tiles, ALiBi's column operands, the row sums' ones, the mbarriers,
    and room to align them."""
    return 2 * (layout(D, tiles)[-1] + columns_elements(tiles) + ones_elements(tiles)) + 8 * barriers(tiles) + ALIGN


def build(D, tiles, storage, mods=NONE):
    """The kernel for padded head dim ``D`` (64, 128 or 256), `WgmmaTiles` with a producer and float16/bfloat16."""
    BLOCK_M, BLOCK_N, CONSUMERS, STAGES = tiles.block_m, tiles.block_n, tiles.warpgroups, tiles.stages
    THREADS = PRODUCER + 128 * CONSUMERS
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_AT, K_AT, V_AT, COLUMNS_AT = layout(D, tiles)
    ONES_AT = COLUMNS_AT + columns_elements(tiles)
    BAR_AT = ONES_AT + ones_elements(tiles)
    Q_FULL, K_FULL, V_FULL = BAR_AT, BAR_AT + BARRIER_ELEMENTS, BAR_AT + (1 + STAGES) * BARRIER_ELEMENTS
    K_EMPTY, V_EMPTY = BAR_AT + (1 + 2 * STAGES) * BARRIER_ELEMENTS, BAR_AT + (1 + 3 * STAGES) * BARRIER_ELEMENTS
    V_TAIL = BAR_AT + (1 + 4 * STAGES) * BARRIER_ELEMENTS
    TILE_N = BLOCK_N * D  # elements of one K or V stage
    TMA, PINGPONG, AHEAD = tiles.tma, tiles.pingpong, tiles.scores_ahead
    K_LEAD = 2 if AHEAD else 1  # key tiles by which K's copies run ahead of V's: the consumers' order of reading them
    PACKED = mods.packed
    if PACKED and not TMA:  # v4 runs in no plan, and no test runs it on packed sequences
        raise ValueError(f"{tiles}: v4 (a producer without tma) does not take packed (varlen) sequences")
    sequence, starts = sequences(mods), sequence_starts(mods)
    zero_rows = tail_zeroer(D)
    FULL_ARRIVALS = 1 if TMA else PRODUCER  # one thread issues the bulk copies; every copier arrives otherwise
    stage_q, stage_kv = stager(D, BLOCK_M, PRODUCER), stager(D, BLOCK_N, PRODUCER)
    COLUMNS = tiles.alibi_columns and mods.alibi_alone  # ALiBi's column term from the tensor cores
    # with scores_ahead the first k-step of a tile's S takes no input: its register set holds the dead scores of two
    # tiles before. That is the build timed (`tiling.WGMMA_SOFTCAP_TILES`); without it ptxas 13.0 emits the same
    # instructions but 8, in another register allocation.
    scores, accumulate = products(BLOCK_N, D, BLOCK_M, BLOCK_N, storage, fresh=AHEAD and not COLUMNS, onto=COLUMNS)
    PAIRS = tiles.exp2_pairs(storage)
    pack = pack_p(BLOCK_N, storage, tiles.exp2_fma if PAIRS else 0)
    modifier = modifiers(mods, types.float32, fast=True)
    prepare, slope_of = modifier.prepare, modifier.slope
    fill_columns, add_columns = alibi_columns.column_bias(BLOCK_N)
    SUMS = tiles.row_sums  # the softmax's row sums from the tensor cores
    ACC_ROWS = DT + int(SUMS)  # O's accumulator blocks, then the sums'
    fill_ones, ones_descriptor, add_sums = row_sums.row_sums(D, BLOCK_N, storage)
    start, mask, online_softmax, rescale_o, finish, write_lse = steps(1, NT, DT, mods, tiles.exp2_fma, COLUMNS,
                                                                      SUMS, tiles.bounded_max, PAIRS)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    order = tile_order(mods, BLOCK_M, BLOCK_N)
    SPARSE = mods.block_sparse
    write_out = fragment_writer(D, storage)
    release_registers, take_registers = register_moves(tiles)

    @device_function
    def landed(smem, barrier, vec):
        # Copies arrive when they land; element-by-element stores are done, and the arrive releases them.
        if vec:
            cp_async_mbarrier_arrive(smem, barrier)
        else:
            mbarrier_arrive(smem, barrier)

    copy_bulk = bulk_copier(D)

    @device_function
    def copy_tile(smem, dst, full, maps, which, head, row, b, rows):
        mbarrier_arrive_expect_tx(smem, full, 2 * rows * D)
        copy_bulk(smem, dst, full, maps, which, head, row, b, rows)

    @device_function
    def tail(n_start, seqlen_k, which):
        # A packed sequence's V tile that reaches past the sequence (`pipeline.tail_zeroer`); K's extra rows need
        # nothing: the mask overwrites their scores.
        return PACKED and TMA and which == 2 and n_start + BLOCK_N > seqlen_k

    @device_function
    def load_tile(smem, base, at, full, empty, it, tile, src, maps, which, mod, b, h, hk, row_start, n_base, tid, vec,
                  k_start, map_b, seqlen_k):
        # The `it`-th copy of K (which 1) or V (which 2), key tile `tile` (`order`), into its ring stage, once the
        # consumers have emptied it (the first round finds every stage empty): bulk tensor copies with TMA, else
        # the producer's cp.async.
        s, parity = it % STAGES, ((it // STAGES) & 1) ^ 1
        n_start = tile_start(mod, b, h, row_start, n_base, tile)  # a block mask's table read while the stage drains
        wait(smem, base + empty + s * BARRIER_ELEMENTS, parity)
        if TMA:
            landed_on = base + (V_TAIL if tail(n_start, seqlen_k, which) else full + s * BARRIER_ELEMENTS)
            copy_tile(smem, base + at + s * TILE_N, landed_on, maps, which, hk, k_start + n_start, map_b, BLOCK_N)
        else:
            stage_kv(smem, base + at + s * TILE_N, src, b, n_start, hk, tid, vec)
            landed(smem, base + full + s * BARRIER_ELEMENTS, vec)

    @device_function
    def zero_tail(smem, base, words, it, n_start, seqlen_k, lane):
        # The producer's first warp zeroes the rows of V's last tile past the sequence (`tail`).
        s = it % STAGES
        wait(smem, base + V_TAIL, 0)  # one tail per block
        zero_rows(words, base + V_AT + s * TILE_N, BLOCK_N, seqlen_k - n_start, lane)
        hand_over(smem, base + V_FULL + s * BARRIER_ELEMENTS, lane)

    @device_function
    def produce(smem, words, base, q, k, v, maps, mod, b, h, hk, row_start, n_base, ntiles, tid, vec, seqlen_q,
                seqlen_k):
        # K runs K_LEAD tiles ahead of V, the order the consumers read them in (S_it with P_{it-1} V_{it-1}, or
        # S_{it+1} with it ahead): V_it waits for P_{it-2} V_{it-2} to release its stage, and K_{it+1} issued after it
        # would wait too. In the order K, V, K, V the consumers' wait for K took 26% of the warps' stall samples (ncu,
        # d128).
        if TMA and tid >= (32 if PACKED else 1):
            return  # one thread issues the bulk copies (a packed sequence's tail takes its warp)
        q_start, k_start, _, map_b = starts(mod, b)  # where the maps find the block's sequence
        if tid == 0 or not TMA:
            if TMA:
                for which in range(3):  # Q, K, V
                    tensormap_acquire(maps, which)
                copy_tile(smem, base + Q_AT, base + Q_FULL, maps, 0, h, q_start + row_start, map_b, BLOCK_M)
            else:
                stage_q(smem, base + Q_AT, q, b, row_start, h, tid, vec)
                landed(smem, base + Q_FULL, vec)
            for it in range(-K_LEAD, ntiles):
                if it + K_LEAD < ntiles:
                    tile = order(it + K_LEAD, row_start, n_base, ntiles, seqlen_q, seqlen_k)
                    load_tile(smem, base, K_AT, K_FULL, K_EMPTY, it + K_LEAD, tile, k, maps, 1, mod, b, h, hk,
                              row_start, n_base, tid, vec, k_start, map_b, seqlen_k)
                if it >= 0:
                    tile = order(it, row_start, n_base, ntiles, seqlen_q, seqlen_k)
                    load_tile(smem, base, V_AT, V_FULL, V_EMPTY, it, tile, v, maps, 2, mod, b, h, hk, row_start,
                              n_base, tid, vec, k_start, map_b, seqlen_k)
        if not TMA:
            cp_async_wait_all()  # leave only once every copy has landed
        elif PACKED:
            last = tile_start(mod, b, h, row_start, n_base, ntiles - 1)
            if tail(last, seqlen_k, 2):
                zero_tail(smem, base, words, ntiles - 1, last, seqlen_k, tid)

    @device_function
    def my_turn(wg):
        if PINGPONG:
            named_barrier_sync(TURN + wg, TURN_THREADS)

    @device_function
    def next_turn(wg, it, ntiles):
        # The last warpgroup's last arrival is left out: no turn of the first would wait for it.
        if PINGPONG and (wg < CONSUMERS - 1 or it < ntiles - 1):
            named_barrier_arrive(TURN + (wg + 1) % CONSUMERS, TURN_THREADS)

    @device_function
    def take(smem, base, full, stage, phase):
        # The tile in ring stage ``stage``, filled for the ``phase``-th time (mod 2), has landed. cp.async writes
        # through the generic proxy, so its tiles need a proxy fence before wgmma reads them; bulk tensor copies
        # write through the async proxy, which wgmma reads through, so the mbarrier's completion orders them (the
        # fence cost a MEMBAR.ALL.CTA per take).
        wait(smem, base + full + stage * BARRIER_ELEMENTS, phase)
        if not TMA:
            fence_proxy_async()

    @device_function
    def next_stage(stage, phase):
        # The next tile's ring stage and fill parity, as int32 counters: from the tile's index, `it % STAGES` and
        # `it // STAGES` in int64 with Python's signs took 20-23 more instructions a tile (ptxas 13.0, three stages)
        wrapped = stage == STAGES - 1
        return (types.int32(0) if wrapped else types.int32(stage + 1)), (phase ^ types.int32(1) if wrapped else phase)

    @device_function
    def tile_scores(s, smem, q_desc, k_desc, stage, side):
        # S = Q K_stage^T, onto ALiBi's column term on a tile on one side of the warpgroup's diagonal (zeros on one
        # across it). The column operands' descriptor comes from K's (kept in registers, it spilled 12 bytes in
        # three consumers at 64).
        if COLUMNS:
            add_columns(s, smem, advance(k_desc, 2 * (COLUMNS_AT - K_AT)), side)
        scores(s, smem, q_desc, advance(k_desc, 2 * stage * TILE_N))

    @device_function
    def weigh(acc, p, smem, v_stage, ones):
        # O += P V, and the rows' sums of P beside it (P [V | 1]) where the tensor cores take them
        accumulate(acc, p, smem, v_stage)
        if SUMS:
            add_sums(acc, p, smem, ones)

    @device_function
    def side_of(wg_row, n_start, seqlen_q, seqlen_k):
        # The tile's side whatever the units: where the softmax cannot take them (`alibi_columns_units`' ok), the
        # column operands hold zeros (a predicate of it live through the loop spilled 8 bytes in three consumers at
        # 64). Integer comparisons with the block's constants, as the products wait for it: from the float offset
        # the softmax takes (`kernels.mods.alibi_columns_side`), its conversion queued behind the exponentials.
        return alibi_side(wg_row, wg_row + 64, n_start, n_start + BLOCK_N, seqlen_q - seqlen_k) if COLUMNS else 0

    @device_function
    def softmax_scores(s, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k,
                       left, right, scale_log2, bh, block_full, mod, slot):
        shift = cuda.local.array((2, 2), types.float32)  # ALiBi's row terms (`softmax`)
        mask(s, shift, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left, right, scale_log2,
             bh, block_full, mod, slot)
        online_softmax(s, shift, m_i, l_i, alpha, scale_log2, bh)

    @device_function
    def tile_info(it, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k):
        # Key tile ``it``'s first key, whether a block mask found it full, and its verdicts' slot (`key_tiles`)
        tile = order(it, row_start, n_base, ntiles, seqlen_q, seqlen_k)
        return (tile_start(mod, b, h, row_start, n_base, tile), tile_full(mod, b, h, row_start, tile),
                tile_slot(mod, b, h, row_start, tile))

    @device_function
    def side_after(it, wg, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k):
        # `side_of` the tile after ``it``, whose S ``scores_ahead`` issues with tile ``it``'s softmax (past the last
        # tile the last's: that S is never read)
        tile = order(min(it + 1, ntiles - 1), row_start, n_base, ntiles, seqlen_q, seqlen_k)
        return side_of(row_start + wg * 64, tile_start(mod, b, h, row_start, n_base, tile), seqlen_q, seqlen_k)

    @device_function
    def step_ahead(it, s, s_next, acc, p, m_i, l_i, alpha, smem, base, q_desc, k_desc, v_desc, ones_desc, k_stage,
                   k_phase, v_stage, v_phase, wg, ctid, ntiles, row_start, row_end, n_base, seqlen_q, seqlen_k, mod, b,
                   h, warp_row, g, t, left, right, scale_log2, bh):
        # Key tile ``it`` with ``scores_ahead``: its S is in ``s`` (from K's ring stage ``k_stage``), P_{it-1} in ``p``
        # and V_{it-1} in V's stage ``v_stage``. P_{it-1} V_{it-1} and S_{it+1} (into ``s_next``) are issued first, and
        # the softmax starts at once, with no wait for a product; they are waited for after it, so no product is in
        # flight across a branch or the loop's edge, where the compiler's copies of its accumulators would serialize
        # it (ptxas 13.0, C7514). Returns the stages of S_{it+1} and of V_it.
        n_start, full, slot = tile_info(it, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k)
        ahead = it + 1 < ntiles
        next_k, next_k_phase = next_stage(k_stage, k_phase)
        side = side_after(it, wg, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k)
        if ahead:
            take(smem, base, K_FULL, next_k, next_k_phase)
        take(smem, base, V_FULL, v_stage, v_phase)
        my_turn(wg)
        wgmma_fence()  # S_{it+1}, P and O were last written by ordinary instructions
        weigh(acc, p, smem, advance(v_desc, 2 * v_stage * TILE_N), ones_desc)
        # Past the last tile too, from a stage no copy writes any more, its S unread: a wgmma in a branch made the
        # compiler copy the untaken branch's accumulators between the group's products (C7515).
        tile_scores(s_next, smem, q_desc, k_desc, next_k, side)
        wgmma_commit()
        next_turn(wg, it, ntiles)
        softmax_scores(s, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left,
                       right, scale_log2, bh, full, mod, slot)
        wgmma_wait0()  # O and P are no longer read by the tensor cores, S_{it+1} is written
        if ahead:
            release(smem, base + K_EMPTY + next_k * BARRIER_ELEMENTS, ctid)
        release(smem, base + V_EMPTY + v_stage * BARRIER_ELEMENTS, ctid)
        rescale_o(acc, alpha)
        pack(p, s)
        next_v, next_v_phase = next_stage(v_stage, v_phase)
        return next_k, next_k_phase, next_v, next_v_phase

    query_block = query_blocks(mods)

    def attention_forward_wgmma_ws(q, k, v, out, lse, scale_log2, left, right, vec, maps, mod):
        # q, out: (batch, seqlen_q, nheads, headdim) 16-bit words; k, v: (batch, seqlen_k, nheads_kv, headdim)
        # lse: (batch, nheads, seqlen_q)
        if PACKED:  # a varlen call: the block's own sequence (`kernels.sequences`), q and k for their lengths
            q_start, q_end, k_start, k_end = sequence(mod, cuda.blockIdx.z)
            q, k = q[:, q_start:q_end], k[:, k_start:k_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        b, h, hk, row_start, row_end, lo, hi = query_block(cuda.blockIdx, q, k, BLOCK_M, left, right, mod)
        if PACKED and row_start < 0:  # past its sequence's query blocks: the grid covers the longest
            return
        bh = prepare(b, h, mod)  # what the modifications read for this head (`kernels.mods`)
        tid = cuda.threadIdx.x
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi) if lo < hi else 0
        if lo >= hi or (SPARSE and ntiles <= 0):  # the mask (or the block mask) hides every key from these rows
            if PACKED:
                out, lse = out[:, q_start:q_end], lse[:, :, q_start:q_end]
            write_hidden_rows(out, lse, b, h, row_start, row_end, types.uint16(0), tid, THREADS)
            return

        smem = cuda.shared.array(0, types.uint16)
        words = cuda.shared.array(0, types.uint64)  # the same memory, 8 bytes an element (`zero_tail`)
        base = aligned_base(smem)
        if tid == 0:
            mbarrier_init(smem, base + Q_FULL, FULL_ARRIVALS)
            mbarrier_init(smem, base + V_TAIL, 1)
            for s in range(STAGES):
                mbarrier_init(smem, base + K_FULL + s * BARRIER_ELEMENTS, FULL_ARRIVALS)
                mbarrier_init(smem, base + V_FULL + s * BARRIER_ELEMENTS, FULL_ARRIVALS)
                mbarrier_init(smem, base + K_EMPTY + s * BARRIER_ELEMENTS, CONSUMERS)
                mbarrier_init(smem, base + V_EMPTY + s * BARRIER_ELEMENTS, CONSUMERS)
        if COLUMNS:
            _, gamma, columns_ok = alibi_columns_units(scale_log2, slope_of(bh))
            fill_columns(words, base + COLUMNS_AT, gamma if columns_ok else types.float32(0), tid, THREADS)
        if SUMS:
            fill_ones(words, base + ONES_AT, tid, THREADS)
        if COLUMNS or SUMS:
            fence_proxy_async()  # written through the generic proxy, read by wgmma through the async one
        cuda.syncthreads()

        if tid < PRODUCER:
            release_registers()
            produce(smem, words, base, q, k, v, maps, mod, b, h, hk, row_start, n_base, ntiles, tid, vec, seqlen_q,
                    seqlen_k)
        else:
            take_registers()
            ctid = tid - PRODUCER
            # the warpgroup as a uniform value: the column term's side and descriptor, which the products wait for,
            # then come from uniform registers (from per-thread ones, each tile's wgmma waited for their moves)
            wg, warp, lane = warp_uniform(ctid // 128), (ctid % 128) // 32, ctid % 32
            g, t = lane >> 2, lane & 3
            q_desc, k_desc, v_desc = descriptors(shared_address(smem, base), Q_AT, K_AT, V_AT, BLOCK_N, wg)
            ones_desc = ones_descriptor(shared_address(smem, base), ONES_AT)

            acc = cuda.local.array((ACC_ROWS, 4), types.float32)  # O fragments: 64 x D per warpgroup (+ 8 sums)
            s = cuda.local.array((NT, 4), types.float32)  # S, then P, fragments: 64 x BLOCK_N per warpgroup
            p = cuda.local.array((PS, 4), types.uint32)  # P rounded to 16 bits: the A operand of P V
            # Row r of m_i, l_i is row `fragments.lane_row(r, g)` of the warp's 16.
            m_i = cuda.local.array(2, types.float32)
            l_i = cuda.local.array(2, types.float32)
            alpha = cuda.local.array(2, types.float32)
            start(acc, m_i, l_i)
            warp_row = row_start + wg * 64 + warp * 16

            if PINGPONG and wg == CONSUMERS - 1:  # the first warpgroup takes the first turn
                named_barrier_arrive(TURN, TURN_THREADS)

            # The first tile: its scores alone (no P V yet; with scores_ahead the second tile's too), then its
            # softmax. A block mask's table is read before the waits, whose asm orders memory: read after them, each
            # load's latency stood between a tile's S and its softmax.
            n_start, full, slot = tile_info(0, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k)
            wait(smem, base + Q_FULL, 0)
            stage, phase = types.int32(0), types.int32(0)  # K's ring position of the tile (V's a tile behind)
            take(smem, base, K_FULL, stage, phase)
            s_next = cuda.local.array((NT, 4), types.float32)  # with scores_ahead, the next tile's S
            second, second_phase = next_stage(stage, phase)
            side = side_of(row_start + wg * 64, n_start, seqlen_q, seqlen_k)
            if AHEAD:
                side_next = side_after(0, wg, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k)
                if ntiles > 1:
                    take(smem, base, K_FULL, second, second_phase)
            my_turn(wg)
            wgmma_fence()
            tile_scores(s, smem, q_desc, k_desc, stage, side)
            wgmma_commit()
            if AHEAD:  # a single tile's too (`step_ahead`)
                tile_scores(s_next, smem, q_desc, k_desc, second, side_next)
                wgmma_commit()
            next_turn(wg, 0, ntiles)
            if AHEAD:
                wgmma_wait1()  # the second tile's S runs under the first's softmax
            else:
                wgmma_wait0()
            release(smem, base + K_EMPTY, ctid)
            softmax_scores(s, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k,
                           left, right, scale_log2, bh, full, mod, slot)
            if AHEAD:
                wgmma_wait0()
                if ntiles > 1:
                    release(smem, base + K_EMPTY + second * BARRIER_ELEMENTS, ctid)
            rescale_o(acc, alpha)
            pack(p, s)

            if AHEAD:
                # Two tiles a pass, their S in the two register sets in turn (an array chosen at run time would live
                # in local memory).
                k_stage, k_phase, v_stage, v_phase = second, second_phase, types.int32(0), types.int32(0)
                for it in range(1, ntiles, 2):
                    k_stage, k_phase, v_stage, v_phase = step_ahead(
                        it, s_next, s, acc, p, m_i, l_i, alpha, smem, base, q_desc, k_desc, v_desc, ones_desc, k_stage,
                        k_phase, v_stage, v_phase, wg, ctid, ntiles, row_start, row_end, n_base, seqlen_q, seqlen_k,
                        mod, b, h, warp_row, g, t, left, right, scale_log2, bh)
                    if it + 1 < ntiles:
                        k_stage, k_phase, v_stage, v_phase = step_ahead(
                            it + 1, s, s_next, acc, p, m_i, l_i, alpha, smem, base, q_desc, k_desc, v_desc, ones_desc,
                            k_stage, k_phase, v_stage, v_phase, wg, ctid, ntiles, row_start, row_end, n_base, seqlen_q,
                            seqlen_k, mod, b, h, warp_row, g, t, left, right, scale_log2, bh)
                stage, phase = v_stage, v_phase  # the last tile's V
            else:
                # Steady state, with no branch around a wgmma (see v3).
                for it in range(1, ntiles):
                    n_start, full, slot = tile_info(it, mod, b, h, row_start, n_base, ntiles, seqlen_q, seqlen_k)
                    side = side_of(row_start + wg * 64, n_start, seqlen_q, seqlen_k)
                    v_stage, v_phase = stage, phase
                    stage, phase = next_stage(stage, phase)
                    take(smem, base, K_FULL, stage, phase)
                    take(smem, base, V_FULL, v_stage, v_phase)
                    my_turn(wg)
                    wgmma_fence()  # S, P and O were last written by ordinary instructions
                    tile_scores(s, smem, q_desc, k_desc, stage, side)
                    wgmma_commit()
                    weigh(acc, p, smem, advance(v_desc, 2 * v_stage * TILE_N), ones_desc)
                    wgmma_commit()
                    next_turn(wg, it, ntiles)
                    wgmma_wait1()  # S_it is done; P_{it-1} V_{it-1} may still run under the softmax below
                    release(smem, base + K_EMPTY + stage * BARRIER_ELEMENTS, ctid)
                    softmax_scores(s, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q,
                                   seqlen_k, left, right, scale_log2, bh, full, mod, slot)
                    wgmma_wait0()  # O and P are no longer read by the tensor cores
                    release(smem, base + V_EMPTY + v_stage * BARRIER_ELEMENTS, ctid)
                    rescale_o(acc, alpha)
                    pack(p, s)

            # The last tile's P V.
            take(smem, base, V_FULL, stage, phase)
            wgmma_fence()
            weigh(acc, p, smem, advance(v_desc, 2 * stage * TILE_N), ones_desc)
            wgmma_commit()
            wgmma_wait0()

            # One normalization at the end; O and LSE written once.
            inv = cuda.local.array(2, types.float32)
            finish(acc, l_i, inv)
            if PACKED:  # narrowed here: the views, live through the loop, kept 60-120 bytes of local memory
                q_start, q_end, _, _ = sequence(mod, cuda.blockIdx.z)
                out, lse = out[:, q_start:q_end], lse[:, :, q_start:q_end]
            write_out(out, b, warp_row, h, acc, 0, inv[0], inv[1], g, t)
            write_lse(lse, b, h, warp_row, g, t, m_i, l_i, scale_log2, bh)

    return attention_forward_wgmma_ws, TENSOR_CORE_FORWARD + (types.int64, kernel_type(mods, types.float32))


build.min_blocks = min_blocks
