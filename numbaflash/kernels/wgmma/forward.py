"""Kernel v3: FlashAttention forward on Hopper's warpgroup tensor cores (wgmma), float16 and bfloat16.

One thread block of ``WARPGROUPS`` warpgroups per (query block, head, batch element); each warpgroup
owns 64 query rows, so the online softmax needs no communication between warpgroups. Per key tile a
warpgroup computes its 64 x BLOCK_N scores with wgmma reading Q and K straight from shared memory
(no ldmatrix, no register copies of the operands), and adds P V with P from registers and V from
shared memory. Tiles sit in the 128-byte swizzle (`wgmma.tiles`), staged with cp.async.

The products of consecutive key tiles overlap with the softmax (FlashAttention-3's intra-warpgroup
pipelining): iteration ``it`` issues ``S_it = Q K_it^T`` and then ``O += P_{it-1} V_{it-1}``, waits only
for S, and computes S's softmax while the tensor cores still run the P V product; O is rescaled once
that product is done. K and V each run through a two-stage ring; V trails K by one tile, and one
barrier per iteration both publishes the landed tiles and frees the stages the copies refill.
"""

from numba import cuda, types

from ...mods import NONE
from ..blocks import TENSOR_CORE_FORWARD, query_blocks, write_hidden_rows
from ..intrinsics import (cp_async_commit, device_function, cp_async_wait_all, fence_proxy_async, shared_address, wgmma_commit,
                         wgmma_fence, wgmma_wait0, wgmma_wait1)
from ..fragments import fragment_writer
from ..key_tiles import key_tiles, verdict_slot
from ..sequences import forward_operands
from ..mods import kernel_type, modifiers
from ..softmax import steps
from .tiles import ALIGN, advance, aligned_base, descriptors, pack_p, products, stager

def layout(D, tiles):
    """Element offsets, from the aligned base, of Q (block_m rows), K and V (``tiles.stages`` tiles of block_n
    rows each)."""
    sizes = (tiles.block_m * D, tiles.stages * tiles.block_n * D, tiles.stages * tiles.block_n * D)
    return tuple(sum(sizes[:i]) for i in range(4))


def smem_bytes(D, tiles):
    """Dynamic shared memory of a block: its tiles, and room to align them to a swizzle period."""
    return 2 * layout(D, tiles)[-1] + ALIGN


def build(D, tiles, storage, mods=NONE):
    """The kernel for padded head dim ``D`` (64 or 128), `WgmmaTiles` and float16/bfloat16, and its signature."""
    operands = forward_operands(mods)
    PACKED = mods.packed
    BLOCK_M, BLOCK_N, WARPGROUPS = tiles.block_m, tiles.block_n, tiles.warpgroups
    THREADS = 128 * WARPGROUPS
    NT, DT, PS = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_AT, K_AT, V_AT, _ = layout(D, tiles)
    STAGES = tiles.stages  # 2: the loop below refills a stage as soon as it is read
    TILE_N = BLOCK_N * D  # elements of one K or V stage
    stage_q, stage_kv = stager(D, BLOCK_M, THREADS), stager(D, BLOCK_N, THREADS)
    scores, accumulate = products(BLOCK_N, D, BLOCK_M, BLOCK_N, storage)
    pack = pack_p(BLOCK_N, storage)
    prepare = modifiers(mods, types.float32, fast=True).prepare
    start, mask, online_softmax, rescale_o, finish, write_lse = steps(1, NT, DT, mods, tiles.exp2_fma)
    tile_count, tile_start, tile_full = key_tiles(mods, BLOCK_M, BLOCK_N)
    tile_slot = verdict_slot(mods, BLOCK_M)
    SPARSE = mods.block_sparse
    write_out = fragment_writer(D, storage)

    @device_function
    def sync_tiles():
        # Every thread's copies of K_it and V_{it-1} have landed and are visible to wgmma, and every
        # warpgroup is done with K_{it-1} and V_{it-2}, whose stages `prefetch` refills.
        cp_async_wait_all()
        fence_proxy_async()
        cuda.syncthreads()

    @device_function
    def prefetch(smem, base, k, v, mod, b, h, hk, row_start, n_base, n_start, it, ntiles, tid, vec):
        # K_{it+1} and V_it (V trails K by one tile): both land during iteration it.
        if it + 1 < ntiles:
            stage_kv(smem, base + K_AT + ((it + 1) % STAGES) * TILE_N, k, b, tile_start(mod, b, h, row_start, n_base, it + 1),
                     hk, tid, vec)
        stage_kv(smem, base + V_AT + (it % STAGES) * TILE_N, v, b, n_start, hk, tid, vec)
        cp_async_commit()

    @device_function
    def softmax_tile(s, acc, p, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k,
                     left, right, scale_log2, bh, block_full, mod, slot):
        # mask -> online softmax (while the previous P V may still run) -> rescale O -> P for the next P V
        shift = cuda.local.array((2, 2), types.float32)  # ALiBi's row terms (`softmax`)
        mask(s, shift, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left, right, scale_log2,
             bh, block_full, mod, slot)
        online_softmax(s, shift, m_i, l_i, alpha, scale_log2, bh)
        wgmma_wait0()  # O and P are no longer read by the tensor cores
        rescale_o(acc, alpha)
        pack(p, s)

    query_block = query_blocks(mods)

    def attention_forward_wgmma(q, k, v, out, lse, scale_log2, left, right, vec, mod):
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
        wg, warp, lane = tid // 128, (tid % 128) // 32, tid % 32
        g, t = lane >> 2, lane & 3

        if lo >= hi:  # the mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, types.uint16(0), tid, THREADS)
            return

        smem = cuda.shared.array(0, types.uint16)
        base = aligned_base(smem)
        n_base = (lo // BLOCK_N) * BLOCK_N  # without a block mask, the first tile's first key
        ntiles = tile_count(mod, b, h, row_start, lo, hi)
        if SPARSE and ntiles <= 0:  # the block mask hides every key from these rows
            write_hidden_rows(out, lse, b, h, row_start, row_end, types.uint16(0), tid, THREADS)
            return
        n_first = tile_start(mod, b, h, row_start, n_base, 0)
        stage_q(smem, base + Q_AT, q, b, row_start, h, tid, vec)
        stage_kv(smem, base + K_AT, k, b, n_first, hk, tid, vec)
        cp_async_commit()

        q_desc, k_desc, v_desc = descriptors(shared_address(smem, base), Q_AT, K_AT, V_AT, BLOCK_N, wg)

        acc = cuda.local.array((DT, 4), types.float32)  # O fragments: 64 x D per warpgroup
        s = cuda.local.array((NT, 4), types.float32)  # S, then P, fragments: 64 x BLOCK_N per warpgroup
        p = cuda.local.array((PS, 4), types.uint32)  # P rounded to 16 bits: the A operand of P V
        # Row r of m_i, l_i is row `fragments.lane_row(r, g)` of the warp's 16.
        m_i = cuda.local.array(2, types.float32)
        l_i = cuda.local.array(2, types.float32)
        alpha = cuda.local.array(2, types.float32)
        start(acc, m_i, l_i)
        warp_row = row_start + wg * 64 + warp * 16

        # The first tile: its scores alone (no P V yet), then its softmax.
        sync_tiles()
        prefetch(smem, base, k, v, mod, b, h, hk, row_start, n_base, n_first, 0, ntiles, tid, vec)
        wgmma_fence()
        scores(s, smem, q_desc, k_desc)
        wgmma_commit()
        wgmma_wait0()
        softmax_tile(s, acc, p, m_i, l_i, alpha, b, h, warp_row, g, t, n_first, row_start, row_end, seqlen_q, seqlen_k,
                     left, right, scale_log2, bh, tile_full(mod, b, h, row_start, 0),
                     mod, tile_slot(mod, b, h, row_start, 0))

        # Steady state, with no branch around a wgmma (a branch makes the compiler copy accumulators that
        # are in flight, and ptxas then serializes every wgmma: warning C7514).
        for it in range(1, ntiles):
            n_start = tile_start(mod, b, h, row_start, n_base, it)
            sync_tiles()
            prefetch(smem, base, k, v, mod, b, h, hk, row_start, n_base, n_start, it, ntiles, tid, vec)
            wgmma_fence()  # S, P and O were last written by ordinary instructions
            scores(s, smem, q_desc, advance(k_desc, 2 * (it % STAGES) * TILE_N))
            wgmma_commit()
            accumulate(acc, p, smem, advance(v_desc, 2 * ((it - 1) % STAGES) * TILE_N))
            wgmma_commit()
            wgmma_wait1()  # S_it is done; P_{it-1} V_{it-1} may still run under the softmax below
            softmax_tile(s, acc, p, m_i, l_i, alpha, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q,
                         seqlen_k, left, right, scale_log2, bh, tile_full(mod, b, h, row_start, it),
                         mod, tile_slot(mod, b, h, row_start, it))

        # The last tile's P V.
        sync_tiles()
        wgmma_fence()
        accumulate(acc, p, smem, advance(v_desc, 2 * ((ntiles - 1) % STAGES) * TILE_N))
        wgmma_commit()
        wgmma_wait0()

        # One normalization at the end; O and LSE written once.
        inv = cuda.local.array(2, types.float32)
        finish(acc, l_i, inv)
        write_out(out, b, warp_row, h, acc, 0, inv[0], inv[1], g, t)
        write_lse(lse, b, h, warp_row, g, t, m_i, l_i, scale_log2, bh)

    return attention_forward_wgmma, TENSOR_CORE_FORWARD + (kernel_type(mods, types.float32),)
