"""`sim.hardware`: sector counts against counts derived by hand, the L2 model on hand-made schedules, and
what `explain` says with them. (`scripts/measure_io.py` holds the same model against ncu on a GPU.)"""

import dataclasses

import numpy as np
import pytest

import numbaflash
from numbaflash import tiling
from sim import hardware
from sim.hardware import l2, schedules
from sim.hardware.sectors import box_bytes, copy_sectors, sectors

HOPPER = tiling.Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 227 * 1024)


def traffic(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward=False, tiles=None, **mask):
    plan = tiling.make_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward=backward,
                            device=HOPPER, tiles=tiles)
    return hardware.predict(plan, gpu=hardware.H100, **mask).kernels


def test_a_warp_instruction_costs_its_distinct_sectors():
    lane = np.arange(32)
    # 32 two-byte stores, lane 4g + t at row g (rows 128 bytes apart), column 2t: one sector per row.
    assert sectors((lane // 4) * 128 + (lane % 4) * 4) == 8
    # 32 aligned 16-byte loads of 512 contiguous bytes: 16 sectors; shifted by 16 bytes they touch 17.
    assert sectors(lane * 16) == 16
    assert sectors(lane * 16 + 16) == 17
    # A lane without an access costs nothing; the same sector twice counts once.
    assert sectors(np.where(lane < 2, 0, -1)) == 1


def test_a_copy_costs_the_shared_sectors_of_each_global_line():
    # Four 128-byte rows, 8 chunks of 16 bytes each, one instruction. Landing in rows 144 bytes apart
    # (the mma.sync stager's padding), rows 1 and 3 start 16 bytes into a shared sector and span five:
    # 4 + 5 + 4 + 5 = 18 sectors. Landing 128 bytes apart (wgmma's swizzled rows), 16.
    row, chunk = np.arange(32) // 8, np.arange(32) % 8
    addresses = row * 128 + chunk * 16
    assert copy_sectors(addresses[None], (row * 144 + chunk * 16)[None]) == 18
    assert copy_sectors(addresses[None], (row * 128 + chunk * 16)[None]) == 16


def test_a_box_row_delivers_its_box_width_and_a_sector_for_a_ragged_end():
    # Three rows inside the tensor with 80 bytes of columns each, one past it; boxes of 128-byte rows.
    assert box_bytes([0, 80, 160, -1], 80, 128) == 4 * 128 + 3 * 32
    assert box_bytes([0, 128, -1], 128, 128) == 3 * 128


def test_tensor_core_forward_by_hand():
    # One head, N = 128, d = 64, float16, 128 x 64 tiles of 4 warps with 2 m-tiles: Q once (128 rows of
    # 128 bytes), K and V in two tiles of 64 rows. Every cp.async instruction lands 4 rows in rows
    # 144 bytes apart: 18 sectors per 16 sectors of data, 9/8 of the bytes. O goes out in 16-bit
    # stores, 8 rows x 8 bytes per instruction: four times its 16 KiB. LSE: 128 rows of 4 bytes,
    # 8 consecutive rows per instruction, one sector each.
    (kernel,) = traffic(1, 1, 1, 128, 128, 64, "float16", tiles=tiling.MMA_TILES[64])
    assert kernel.copy_bytes == 16384 * 9 // 8 + 2 * 2 * 8192 * 9 // 8
    assert kernel.store_bytes == 4 * 16384 + 512
    assert kernel.load_bytes == kernel.tma_bytes == 0


def test_wgmma_outputs_go_out_in_four_byte_stores():
    # The same head on v5's 128-row blocks: O's column pairs go out in 32-bit stores (`kernels.fragments`), 8 rows
    # x 16 bytes per instruction, a sector each: twice its 16 KiB, where mma.sync's 16-bit stores cost four times.
    # With an odd head dim no row is 4-byte aligned: 16-bit stores, each instruction's 8 rows x 8 bytes at least a
    # sector per row, so at least four times O's 128 x 126 bytes.
    tiles = tiling.WgmmaTiles(128, 64, 2, producer=True, tma=True)
    (kernel,) = traffic(1, 1, 1, 128, 128, 64, "float16", tiles=tiles)
    assert kernel.store_bytes == 2 * 16384 + 512
    (odd,) = traffic(1, 1, 1, 128, 128, 63, "float16", tiles=tiles)
    assert odd.store_bytes >= 4 * 128 * 126 + 512


def test_masked_key_tiles_are_not_loaded():
    # Causal, N = 256: rows 128-255 see keys 0-255 (four tiles of 64), rows 0-127 keys 0-127 (two tiles).
    (kernel,) = traffic(1, 1, 1, 256, 256, 64, "float16", tiles=tiling.MMA_TILES[64], causal=True)
    tile = 64 * 128 * 9 // 8
    assert kernel.copy_bytes == 2 * 16384 * 9 // 8 + 2 * 6 * tile


def test_rows_that_see_no_key_are_written_and_load_nothing():
    # seqlen_q 256 over 64 keys, causal (bottom-right): rows 0-191 see nothing. The block of rows 0-127
    # writes O = 0 by consecutive threads (128 rows x 128 bytes, whole sectors) and LSE = -inf by the
    # thread at column 0 of each row, alone in its instruction (a sector each). The block of rows 128-255
    # loads Q and one K and one V tile and writes as in test_tensor_core_forward_by_hand.
    (kernel,) = traffic(1, 1, 1, 256, 64, 64, "float16", tiles=tiling.MMA_TILES[64], causal=True)
    assert kernel.store_bytes == 128 * 128 + 128 * 32 + 4 * 16384 + 512
    assert kernel.copy_bytes == 16384 * 9 // 8 + 2 * 64 * 128 * 9 // 8


def test_padded_head_dims_are_not_loaded():
    # float32, d = 40 on the 64-wide bucket: 16-byte loads of 10 of each row's 16 slots. A row is 160
    # bytes, five whole sectors. One block of 128 rows: Q and K, V (two tiles of 64 rows) cost exactly their
    # bytes. The Hopper plan's blocks of 64 rows (float64 scores) read K and V once per block.
    (kernel,) = traffic(1, 1, 1, 128, 128, 40, "float32", tiles=tiling.Tiles(128, 64, 4, 4))
    assert kernel.load_bytes == 128 * 160 + 2 * 2 * 64 * 160
    (kernel,) = traffic(1, 1, 1, 128, 128, 40, "float32")
    assert kernel.kernel == "simt_forward" and kernel.load_bytes == 128 * 160 + 2 * 2 * 2 * 64 * 160


def test_unaligned_rows_cost_the_sectors_they_straddle():
    # The backward's preprocess reads O and dO, one warp per row in 32-element steps. d = 40 in float16:
    # 80-byte rows, which start on a sector (even rows) or 16 bytes into one (odd rows). Even rows cost
    # 2 sectors for elements 0-31 and 1 for 32-39; odd rows 3 and 1. Eight rows: 4 x 3 + 4 x 4 = 28
    # sectors per array. D: one 4-byte store per row, alone in its instruction.
    preprocess = traffic(1, 1, 1, 8, 8, 40, "float16", backward=True, tiles=tiling.MMA_BACKWARD_TILES[64])[0]
    assert preprocess.kernel == "simt_backward_preprocess"
    assert preprocess.load_bytes == 2 * 28 * 32
    assert preprocess.store_bytes == 8 * 32
    # O and dO are dense (rows back to back): DRAM reads their bytes, each shared sector once.
    assert preprocess.dram_read_bytes == 2 * 8 * 80


def test_the_staged_preprocess_writes_whole_tiles_of_statistics():
    # v5's preprocess (Hopper's planned backward: 128 x 64 tiles) reads O and dO as above and each row's LSE,
    # and stores the base-2 LSE and D of rows padded to whole tiles: 128 rows of each. A warp takes 4 rows and
    # its lanes 0-3 load and store one each: an instruction of 16 bytes, a sector, per 4 rows. Its loads of O
    # and dO are clamped into the sequence: each of the 120 rows past it repeats row 7's, bytes 560-639 (3
    # sectors in the first 32-element step, 1 in the second).
    preprocess = traffic(1, 1, 1, 8, 8, 40, "float16", backward=True)[0]
    assert preprocess.kernel == "wgmma_tma_backward_preprocess"
    assert preprocess.load_bytes == 2 * (28 + 120 * 4) * 32 + 2 * 32
    assert preprocess.store_bytes == 2 * (128 // 4) * 32
    # The dK/dV kernel's one key block copies K and V (boxes of 128 rows of 128 bytes, plus a sector for each
    # of the 8 rows inside, whose 80 bytes end within one), then its one query tile's Q and dO (64-row boxes)
    # and, in bulk, the tile's 64 LSE and 64 D: 512 bytes.
    dkdv = traffic(1, 1, 1, 8, 8, 40, "float16", backward=True)[1]
    assert dkdv.tma_bytes == 2 * (128 * 128 + 8 * 32) + 2 * (64 * 128 + 8 * 32) + 2 * 64 * 4


def test_lru_reads_a_tile_once_while_it_stays_and_writes_dirty_tiles_when_evicted():
    read = lambda tile, n=100: (tile, n, False)
    write = lambda tile, n=100: (tile, n, True)
    assert l2.lru([read(0), read(1), read(0)], capacity=250) == (200, 0)
    assert l2.lru([read(0), read(1), read(0)], capacity=150) == (300, 0)  # 1 evicts 0, which is read again
    assert l2.lru([write(0), read(1), read(2)], capacity=150) == (200, 100)  # 0 leaves dirty: written
    assert l2.lru([write(0)], capacity=150) == (0, 0)  # still cached at the end: written after the kernel


def test_blocks_run_in_launch_order_resident_at_a_time():
    blocks = [[("a", 1, False), ("b", 1, False)], [("c", 1, False)], [("d", 1, False)]]
    number = lambda accesses: [tile for tile, _, _ in accesses]
    assert number(l2.schedule(blocks, 1)) == [0, 1, 2, 3]  # a b c d
    assert number(l2.schedule(blocks, 2)) == [0, 1, 2, 3]  # a c | b d: c's slot takes d once c is done
    assert [t for t, _, _ in l2.schedule([[("x", 1, False)], [("x", 1, False)]], 2)] == [0, 0]
    # Two blocks of one wave read the same tile: DRAM reads it once.
    assert l2.dram_bytes([[("x", 64, False)], [("x", 64, False)]], 2, 1 << 20) == (64, 0)


def test_roofline_follows_the_flops_and_the_dram_bytes():
    plan = tiling.make_plan(1, 2, 2, 128, 128, 64, "float16", device=HOPPER)
    causal = hardware.predict(plan, causal=True, gpu=hardware.H100)
    full = hardware.predict(plan, gpu=hardware.H100)
    assert full.flops == 4 * 64 * 2 * 128 * 128
    assert causal.flops == 4 * 64 * 2 * (128 * 129 // 2)
    kind, ridge = full.bound()
    assert ridge == pytest.approx(989e12 / 3.35e12)
    assert kind == ("memory" if full.intensity < ridge else "compute")
    unknown = hardware.Gpu("unknown GPU", 100, 2**25, 2**17)
    assert hardware.predict(plan, gpu=unknown).bound() is None


@pytest.mark.parametrize("call, error", [
    (lambda plan: hardware.predict("plan"), TypeError),
    (lambda plan: hardware.predict(plan, causal="yes"), TypeError),
    (lambda plan: hardware.predict(plan, window_size=(-2, 0)), ValueError),
    (lambda plan: hardware.predict(plan, gpu="H100"), TypeError),
    (lambda plan: hardware.predict(plan, operands={"x": None}), ValueError),
    (lambda plan: hardware.predict(plan, operands={"q": hardware.Operand.contiguous((1, 2, 3), 2)}), ValueError),
    (lambda plan: hardware.predict(plan, block_mask="causal"), TypeError),
    (lambda plan: hardware.predict(plan, block_mask=numbaflash.block_mask(causal_mask, 1, 1, 16, 17)), ValueError),
])
def test_bad_arguments_are_refused(call, error):
    plan = tiling.make_plan(1, 1, 1, 16, 16, 16, "float16", device=HOPPER)
    with pytest.raises(error):
        call(plan)


def test_explain_gives_the_gpu_traffic_and_the_bound(monkeypatch):
    from numbaflash import interface

    q = np.random.default_rng(0).standard_normal((1, 64, 2, 32)).astype(np.float16)
    text = numbaflash.explain(q, q, q, causal=True)
    assert "requested in 32-byte sectors" in text and "after the L2 model" in text
    assert "FLOP per DRAM byte" in text and ("memory-bound" in text or "compute-bound" in text)
    monkeypatch.setattr(interface, "EXPLAIN_TILE_VISITS", 1)
    assert "not modelled here" in numbaflash.explain(q, q, q)


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def same_document(b, h, q_idx, kv_idx, doc):
    return doc[q_idx] == doc[kv_idx]


# The kernels the walks model, as (dtype, forward tiles, backward tiles, deterministic); None: the plan's own.
# CUDA cores, mma.sync, wgmma v3 (cp.async) and v5 (bulk tensor copies), and v5's one-pass atomic dQ.
BLOCK_MASK_PLANS = {
    "simt": ("float32", None, None, True),
    "mma": ("float16", tiling.MMA_TILES[64], tiling.MMA_BACKWARD_TILES[64], True),
    "wgmma v3": ("float16", tiling.WGMMA_CP_ASYNC_TILES[64], tiling.WgmmaTiles(64, 64, 1), True),
    "wgmma v5": ("float16", None, None, True),
    "wgmma v5, atomic dQ": ("float16", None, tiling.WGMMA_BACKWARD_TILES[64], False),
}


@pytest.mark.parametrize("family", BLOCK_MASK_PLANS)
def test_a_block_mask_equal_to_causal_moves_what_causal_moves(family):
    """The kernels visit a block mask's non-empty tiles in the order the causal mask's visible ones are
    visited, so a mask_mod that is causal moves every byte the built-in causal mask moves, in every kernel,
    with the same FLOPs (bottom-right: the first rows see no key)."""
    dtype, forward_tiles, backward_tiles, deterministic = BLOCK_MASK_PLANS[family]
    batch, nheads, nheads_kv, seqlen_q, seqlen_k = 1, 2, 1, 300, 250
    mask = numbaflash.block_mask(lambda b, h, i, j: j <= i + seqlen_k - seqlen_q, None, None, seqlen_q, seqlen_k)
    for backward, tiles in ((False, forward_tiles), (True, backward_tiles)):
        plan = tiling.make_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, 64, dtype, backward=backward,
                                device=HOPPER, tiles=tiles, deterministic=deterministic)
        causal = hardware.predict(plan, causal=True, gpu=hardware.H100)
        masked = hardware.predict(plan, block_mask=mask, gpu=hardware.H100)
        assert masked.flops == causal.flops
        for with_mask, without in zip(masked.kernels, causal.kernels):
            if schedules.family(plan.tiles) and hardware.WALKS[without.kernel] in ("forward", "dkdv", "dkdvdq", "dq"):
                # and reads the block mask's schedule (`test_the_kernels_read_a_block_masks_schedule_as_compiled`)
                assert with_mask.load_bytes > without.load_bytes
                with_mask = dataclasses.replace(with_mask, load_bytes=without.load_bytes,
                                                dram_read_bytes=without.dram_read_bytes)
            assert with_mask == without
        # the tiles of causal's, fewer than the unmasked call's (v5's schedule reads aside: at this size they
        # outweigh what the skipped tiles save)
        assert causal.global_bytes < hardware.predict(plan, gpu=hardware.H100).global_bytes


def test_the_kernels_read_a_block_masks_schedule_as_compiled():
    """The kernels read a block mask's schedule in warp instructions of their own (`sim.hardware.schedules`, each count
    held against ncu's on the H100): v5, mma.sync and the CUDA cores. A causal block mask, one head, N = 256, d = 64.

    v5 on the block masks' tiles: every one of a block's 8 warps loads its count and, in a forward or dQ pass, the
    query tile its grid position runs (one sector each, all lanes at one address); per visit, each of the 4 consumer warps its entry and its slot, and the producer's thread the entry of
    each copy (2 in the forward, K and V; 1 in each backward pass); per partial tile each consumer warp loads its rows
    g and g + 8 at each 32-column word (8 rows of verdicts a load, 16 bytes apart in the forward: 4 sectors; 8 bytes
    apart in the backward's 64-column tiles: 2), the dQ pass once per 8-column chunk."""
    seqlen = 256
    mask = numbaflash.block_mask(causal_mask, None, None, seqlen, seqlen)
    # forward, 64 x 128 tiles: query blocks see 1, 1, 2, 2 key tiles, one partial each
    (forward,) = traffic(1, 1, 1, seqlen, seqlen, 64, "float16", tiles=tiling.WGMMA_BLOCK_SPARSE_TILES[64],
                         block_mask=mask)
    assert forward.load_bytes == 32 * (4 * 8 * 2 + 6 * (2 + 4 * 2) + 4 * (4 * 2 * 4 * 4))
    # backward, 64 x 64 tiles: dQ blocks see 1, 2, 3, 4 key tiles, dK/dV blocks 4, 3, 2, 1 query tiles, one partial each
    kernels = traffic(1, 1, 1, seqlen, seqlen, 64, "float16", backward=True,
                      tiles=tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64], block_mask=mask)
    unmasked = traffic(1, 1, 1, seqlen, seqlen, 64, "float16", backward=True,
                       tiles=tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64], causal=True)
    reads = {k.kernel: k.load_bytes - u.load_bytes for k, u in zip(kernels, unmasked)}
    assert reads == {"wgmma_tma_backward_preprocess": 0,
                     "wgmma_tma_backward_dkdv": 32 * (4 * 8 + 10 * (1 + 4 * 2) + 4 * (4 * 2 * 2 * 2)),
                     "wgmma_tma_backward_dq": 32 * (4 * 8 * 2 + 10 * (1 + 4 * 2) + 4 * (4 * 2 * 2 * 4 * 2))}
    # mma.sync's forward, 128 x 64 tiles of 4 warps with 2 m-tiles: query blocks see 2 and 4 key tiles, 2 partial each.
    # Each warp loads its grid tile, the count and the first visit's entry, per visit the entry twice, per visit but the last the next
    # one's, per partial tile its slot and 8 verdict words (4 fragment rows x 2 words, rows 8 bytes apart: 2 sectors).
    tiles = tiling.MMA_TILES[64]
    (masked,), (causal,) = (traffic(1, 1, 1, seqlen, seqlen, 64, "float16", tiles=tiles, **mask_)
                            for mask_ in (dict(block_mask=mask), dict(causal=True)))
    warps = 4
    assert masked.load_bytes - causal.load_bytes == 32 * warps * (
        2 * (1 + 1 + 1) + 6 * 2 + (1 + 3) + 4 * 1 + 4 * (4 * 2 * 2))
    assert (masked.copy_bytes, masked.store_bytes) == (causal.copy_bytes, causal.store_bytes)
    # The CUDA-core kernels, 64 x 64 tiles of 16 x 16 threads (8 warps) with 4 x 4 scores each: query blocks see 1, 2,
    # 3, 4 key tiles (dK/dV blocks 4, 3, 2, 1 query tiles), one partial each. Every warp loads the count (and in the
    # forward and dQ pass its grid tile), per visit
    # the entry and the slot, and per partial tile, for each of a thread's 4 rows, the word of its 4 columns: 2 rows
    # a warp, 32 bytes apart (2 words of 4 bytes a row): 2 sectors.
    tiles, warps = tiling.Tiles(64, 64, 4, 4), 8
    for backward in (False, True):
        masked, causal = (traffic(1, 1, 1, seqlen, seqlen, 64, "float32", tiles=tiles, backward=backward, **mask_)
                          for mask_ in (dict(block_mask=mask), dict(causal=True)))
        reads = {k.kernel: k.load_bytes - u.load_bytes for k, u in zip(masked, causal)}
        schedule = 32 * warps * (4 * 1 + 10 * 2 + 4 * 4 * 2)
        ordered = schedule + 32 * warps * 4  # each of the 4 query blocks' grid tile
        assert reads == ({"simt_forward": ordered} if not backward else
                         {"simt_backward_preprocess": 0, "simt_backward_dkdv": schedule, "simt_backward_dq": ordered})


def windows_by_head(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx and q_idx - kv_idx < 40 * (h + 1)


@pytest.mark.parametrize("kind", ["forward", "dq", "dkdv"])
def test_the_schedule_model_finds_each_block_where_the_tables_put_it(kind):
    """`schedules.ScheduleReads` reads a block's row of the block mask's table and its partial tiles' slots in the
    bits where `BlockMask.key_tiles` and `query_tiles` put them (the addresses its DRAM bytes come from): a mask
    that depends on the head, GQA groups of 2, and the causal mask beside it."""
    import types

    from numbaflash._arrays import describe

    seqlen, nheads, group = 320, 4, 2
    mask = numbaflash.block_mask(windows_by_head, None, nheads, seqlen, seqlen)
    tiles = tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64] if kind != "forward" else tiling.WGMMA_BLOCK_SPARSE_TILES[64]
    plan = types.SimpleNamespace(tiles=tiles)
    walk = types.SimpleNamespace(plan=plan, block_mask=mask, left=-1, right=0, group=group)
    reads = schedules.ScheduleReads(walk, kind)
    like = describe(np.zeros(1, np.int32), "like")
    if kind == "dkdv":
        table, _ = mask.query_tiles(tiles.block_m, tiles.block_n, -1, 0, group, like)
    else:
        table, _ = mask.key_tiles(tiles.block_m, tiles.block_n, -1, 0, like)
    table = np.asarray(table.obj)
    assert reads.axes == table.shape[:2] and reads.blocks == table.shape[2] and reads.width == table.shape[3]
    half = table.shape[3] // 2
    for b, head, block in np.ndindex(*table.shape[:3]):
        slots = table[b, head, block, half + 1:half + 1 + table[b, head, block, 0]]
        if (slots >= 0).any():
            assert slots[slots >= 0][0] == reads.first_slot[b, head, block]


def test_a_document_mask_loads_only_the_tiles_of_each_document():
    """v5's forward with 128 x 128 tiles over 4 documents of 128 rows (one head, d = 64): each query block
    copies its Q box and the K and V boxes of its own document's one tile, 128 rows of 128 bytes each; the
    FLOPs count each document's 128^2 scores."""
    seqlen, documents = 512, 4
    doc = np.arange(seqlen) // (seqlen // documents)
    mask = numbaflash.block_mask(same_document, None, None, seqlen, seqlen, mod_args=(doc,))
    plan = tiling.make_plan(1, 1, 1, seqlen, seqlen, 64, "float16", device=HOPPER,
                            tiles=tiling.WGMMA_USER_FUNCTION_TILES[64])
    (kernel,) = hardware.predict(plan, block_mask=mask, gpu=hardware.H100).kernels
    box = 128 * 128
    assert kernel.tma_bytes == documents * (box + 2 * box)
    assert hardware.predict(plan, block_mask=mask, gpu=hardware.H100).flops == 4 * 64 * documents * 128 ** 2
    (dense,) = hardware.predict(plan, gpu=hardware.H100).kernels
    assert dense.tma_bytes == documents * (box + 2 * documents * box)


def test_explain_counts_a_block_masks_tiles_on_the_gpu_line(monkeypatch):
    """The GPU line of a causal block mask's call gives the built-in causal call's traffic and FLOPs, and on the
    tensor-core plan the simulator runs (mma.sync) also the kernels' reads of the block mask's schedule."""
    q = np.random.default_rng(0).standard_normal((1, 64, 1, 32)).astype(np.float16)
    mask = numbaflash.block_mask(causal_mask, None, None, 64, 64)
    predicted = []
    real_predict = hardware.predict
    monkeypatch.setattr(hardware, "predict", lambda *a, **k: predicted.append(real_predict(*a, **k)) or predicted[-1])
    masked, causal = (numbaflash.explain(q, q, q, **mask_) for mask_ in (dict(block_mask=mask), dict(causal=True)))
    assert "the GPU line the kernels' reads of the block mask's table and bits as well" in masked
    (with_mask,), (without,) = (p.kernels for p in predicted)
    assert predicted[0].flops == predicted[1].flops
    assert with_mask.load_bytes > without.load_bytes
    assert dataclasses.replace(with_mask, load_bytes=without.load_bytes, dram_read_bytes=without.dram_read_bytes) == \
        without


def test_tiles_of_two_blocks_per_multiprocessor_keep_two_resident():
    """The L2 model runs as many blocks at a time as the GPU holds: tiles compiled for two blocks per
    multiprocessor (a block mask's at headdim 64) keep twice the SMs' count resident, the same tiles compiled
    for one keep one per SM (their 255 registers a thread), and the backward's preprocess its own."""
    shared = tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64]
    for tiles, per_sm in ((shared, 2), (tiling.WgmmaTiles(64, 64, 1, producer=True, tma=True), 1)):
        for backward in (False, True):
            kernels = traffic(1, 4, 4, 2048, 2048, 64, "float16", backward=backward, tiles=tiles)
            assert [k.resident_blocks for k in kernels if "preprocess" not in k.kernel] == \
                [per_sm * hardware.H100.sm_count] * (2 if backward else 1)
            assert all(k.resident_blocks > 2 * hardware.H100.sm_count for k in kernels if "preprocess" in k.kernel)
