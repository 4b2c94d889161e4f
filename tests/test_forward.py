"""The forward kernels against the float64 reference, under flash-attn's accuracy rule."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import numbaflash
import sim
from cases import DTYPES, NP_DTYPES, Case, cases, check_forward, gpu_cases, inputs
from numbaflash import tiling
from numbaflash.tiling import SIMULATOR_WGMMA_TILES, Device, MmaTiles, WgmmaTiles

# GPUs as the planner sees them: their production tilings run on the simulator. Turing (7.5) has no
# bfloat16 mma, so its float16 and bfloat16 take the CUDA-core kernels.
HOPPER = Device("H100 (planned)", (9, 0), 132, 227 * 1024)
TURING = Device("T4 (planned)", (7, 5), 40, 64 * 1024)
AMPERE = Device("A100 (planned)", (8, 0), 108, 163 * 1024)


def with_tiles(case, tiles):
    """`numbaflash.attention` on ``case``'s shapes with the plan of ``tiles``."""
    plan = tiling.make_plan(case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim,
                            case.dtype, tiles=tiles)
    return lambda *a, **kw: numbaflash.attention(*a, plan=plan, **kw)


@given(case=cases())
# float32 with logits in the thousands, where float32 scores are quantized by ~1e-3: with them the CUDA-core forward
# erred past twice the naive implementation's in 7 of 300 random cases on the H100, none with float64 scores
# (`tiling.FLOAT64_SCORES`). Drawn there with float32 scores: out 1.75e-4 against the BLAS naive's 7.6e-5 (its
# chained scores' 4.1e-4, `cases.CHAINED_DTYPES`), 7.5e-6 against 7.4e-6, and the two below.
@example(case=Case(1, 14, 2, 4, 2, 256, "float32", logit_scale=625.0, seed=0))
@example(case=Case(1, 6, 11, 2, 1, 256, "float32", logit_scale=625.0, seed=762))
@example(case=Case(1, 6, 40, 2, 2, 16, "float32", logit_scale=625.0, seed=30))  # 2.7x naive's error on the H100
@example(case=Case(1, 97, 11, 2, 2, 64, "float32", logit_scale=2500.0, seed=173))  # with float32 scores: 2.5x
def test_forward_matches_reference(case, arrays, poisoned):
    check_forward(case, numbaflash.attention, *arrays)


@given(case=cases(headdims=st.integers(1, 40), big_headdims=(64, 128), dtypes=("float16", "bfloat16")))
def test_wgmma_forward_matches_reference(case, arrays, poisoned):
    """The Hopper kernel through every mask, GQA and odd lengths (one warpgroup, 16-key tiles)."""
    check_forward(case, with_tiles(case, SIMULATOR_WGMMA_TILES), *arrays)


PRODUCER_CASES = [Case(1, 70, 45, 2, 1, 64, "float16", seed=11),
                  Case(2, 33, 50, 4, 2, 40, "bfloat16", causal=True, seed=12),
                  Case(1, 40, 90, 2, 2, 104, "float16", window_size=(20, 3), seed=13)]


# v5 (the plans' choice) through every case; v4, a ladder step no plan picks, through the first (CI time);
# a three-stage ring through eight key tiles, so that it wraps around more than twice.
@pytest.mark.parametrize("case,tma,kernel,stages", [(c, True, "wgmma_tma_forward", 2) for c in PRODUCER_CASES]
                         + [(PRODUCER_CASES[0], False, "wgmma_ws_forward", 2),
                            (Case(1, 40, 120, 2, 1, 64, "float16", seed=16), True, "wgmma_tma_forward", 3)])
def test_wgmma_forward_with_a_producer_warpgroup(case, tma, kernel, stages, arrays, poisoned):
    """Kernels v4 (cp.async) and v5 (bulk tensor copies): a producer warpgroup feeds the consumer through
    mbarriers (GQA, masks, odd lengths, padded head dims), K one tile ahead of V."""
    tiles = WgmmaTiles(64, 16, 1, stages, producer=True, tma=tma)
    assert tiling.make_plan(1, 1, 1, 64, 64, 64, "float16", tiles=tiles).kernel == kernel
    check_forward(case, with_tiles(case, tiles), *arrays)


# One block per head: two and three consumer warpgroups are 384 and 512 simulated threads.
PINGPONG_CASES = [(Case(1, 100, 45, 1, 1, 64, "float16", causal=True, seed=14), 2),
                  (Case(1, 140, 40, 1, 1, 96, "bfloat16", window_size=(30, 5), seed=15), 3),
                  (Case(1, 70, 40, 1, 1, 200, "float16", causal=True, seed=17), 2)]  # headdim 256's plans


@pytest.mark.parametrize("case,consumers", PINGPONG_CASES)
def test_wgmma_forward_with_ping_pong_consumers(case, consumers, arrays, poisoned):
    """v5 whose consumer warpgroups take turns on named barriers (the first goes first, the last leaves out
    its last arrival): rows past the sequence in the last consumer, masks, padded head dims up to 256."""
    tiles = WgmmaTiles(64 * consumers, 16, consumers, producer=True, tma=True, pingpong=True)
    check_forward(case, with_tiles(case, tiles), *arrays)


def test_wgmma_forward_with_three_consumers_without_turns(arrays, poisoned):
    """softcap alone's plan at headdim 128 (`tiling.WGMMA_SOFTCAP_TILES`): three consumer warpgroups that issue their
    products without ping-pong, the last one's rows past the sequence, causal."""
    case = Case(1, 150, 50, 1, 1, 128, "float16", causal=True, seed=25, modifications=dict(softcap=30.0))
    check_forward(case, with_tiles(case, WgmmaTiles(192, 16, 3, producer=True, tma=True)), *arrays)


# Each tile's scores issued a tile ahead, into a second register set (softcap alone's plan at headdim 128 before
# three consumers ran it faster, `tiling.WGMMA_SOFTCAP_TILES`): one key
# tile (the second S, past the last tile, is never read), an odd and an even number of them (the loop takes two a
# pass), causal rows that see no key, a window over GQA, two consumers taking turns, and softcap with its bound as
# each row's maximum.
AHEAD_CASES = [(Case(1, 30, 12, 2, 1, 64, "float16", seed=21), 1, {}),
               (Case(1, 70, 45, 2, 1, 64, "bfloat16", causal=True, seed=22), 2, dict(pingpong=True)),
               (Case(1, 50, 64, 2, 1, 128, "float16", window_size=(20, 3), seed=23), 1, {}),
               (Case(1, 60, 75, 2, 1, 128, "bfloat16", causal=True, logit_scale=8.0, seed=24,
                     modifications=dict(softcap=30.0)), 1, dict(bounded_max=True))]


@pytest.mark.parametrize("case,consumers,flags", AHEAD_CASES)
def test_wgmma_forward_with_scores_ahead(case, consumers, flags, arrays, poisoned):
    """v5 whose consumers issue S_{j+1} with P_{j-1} V_{j-1} before the softmax of S_j."""
    tiles = WgmmaTiles(64 * consumers, 16, consumers, producer=True, tma=True, scores_ahead=True, **flags)
    check_forward(case, with_tiles(case, tiles), *arrays)


def test_inputs_the_copy_engine_cannot_read_run_with_cp_async(arrays):
    """A head dim of 36 (72-byte rows, not 16-byte aligned) in a packed qkv: v3 runs, and the plan says why."""
    to_device, to_host = arrays
    aligned = tiling.make_plan(1, 2, 2, 50, 50, 48, "float16", device=HOPPER)
    fallback = tiling.make_plan(1, 2, 2, 50, 50, 36, "float16", device=HOPPER, aligned=False)
    assert aligned.kernel == "wgmma_tma_forward" and fallback.kernel == "wgmma_forward"
    assert "bulk tensor copy engine cannot read" in fallback.reason and not fallback.tiles.tma
    with pytest.raises(ValueError, match="bulk tensor copy engine"):
        tiling.make_plan(1, 2, 2, 50, 50, 36, "float16", aligned=False, tiles=WgmmaTiles(64, 16, 1, producer=True, tma=True))
    qkv = to_device(np.random.default_rng(4).standard_normal((1, 50, 3, 2, 36)).astype(np.float16))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    plan = tiling.make_plan(1, 2, 2, 50, 50, 36, "float16", tiles=WgmmaTiles(64, 16, 1, producer=True, tma=True))
    with pytest.raises(ValueError, match="the plan copies with the bulk tensor copy engine"):
        numbaflash.attention(q, k, v, plan=plan)


@pytest.mark.parametrize("dtype,headdim,device,kernel", [
    ("float32", 64, HOPPER, "simt_forward"), ("float32", 64, TURING, "simt_forward"),
    ("bfloat16", 256, TURING, "simt_forward"),
    ("float64", 64, HOPPER, "simt_forward"), ("float64", 200, HOPPER, "simt_forward"),
    ("float16", 40, AMPERE, "mma_forward"), ("bfloat16", 72, HOPPER, "wgmma_tma_forward"),
    ("float16", 48, HOPPER, "wgmma_tma_forward"),
])
def test_production_tilings_on_small_shapes(dtype, headdim, device, kernel, arrays, poisoned):
    """The GPUs' own block sizes (4 warps; 256-512 threads for the CUDA-core kernel), on the simulator."""
    case = Case(1, 9, 21, 2, 1, headdim, dtype, causal=True, seed=3)
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(case))
    plan = numbaflash.plan(q, k, v, causal=True, device=device)
    assert plan.kernel == kernel and plan.tiles.threads >= 128 and plan.tiles == tiling.make_plan(
        1, 2, 1, 9, 21, headdim, dtype, device=device).tiles
    check_forward(case, lambda *a, **kw: numbaflash.attention(*a, plan=plan, **kw), *arrays)


@pytest.mark.parametrize("device,wide", [(HOPPER, True), (AMPERE, True), (TURING, False)])
def test_float32_forwards_take_float64_scores_where_float64_runs_at_half_rate(device, wide):
    """`tiling.FLOAT64_SCORES`: the float32 CUDA-core forward sums, scales and subtracts its scores in float64 on
    GPUs that run float64 at half the float32 rate, says so in its plan, and keeps float32 scores elsewhere."""
    plan = tiling.make_plan(1, 2, 2, 300, 300, 64, "float32", device=device)
    assert plan.kernel == "simt_forward" and plan.tiles.float64_scores == wide
    assert ("scores in float64" in plan.reason) == wide and ("scores in float32" in plan.reason) != wide
    assert plan.tiles not in tiling.FLOAT64_SCORES_SPILL or not wide
    backward = tiling.make_plan(1, 2, 2, 300, 300, 64, "float32", device=device, backward=True)
    assert not backward.tiles.float64_scores


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(3, 2))])
def test_tensor_core_forward_with_one_m_tile_per_warp(mask, arrays, poisoned):
    """Warps of 16 rows, as the headdim-256 plan runs (the default plans give a warp two m-tiles)."""
    case = Case(2, 21, 13, 2, 1, 24, "bfloat16", seed=5, **mask)
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(case))
    plan = numbaflash.plan(q, k, v, **mask)
    one = tiling.make_plan(2, 2, 1, 21, 13, 24, "bfloat16", tiles=MmaTiles(32, 16, 2))
    assert plan.tiles.m_tiles == 2 and one.kernel == "mma_forward"
    check_forward(case, lambda *a, **kw: numbaflash.attention(*a, plan=one, **kw), *arrays)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seed_blocks_1000_1001_1002_999_stay_finite(dtype, arrays, poisoned):
    """Seed 001: logits [1000, 1001] then [1002, 999] in one row; the answer is softmax-weighted v."""
    to_device, to_host = arrays
    dt = NP_DTYPES[dtype]
    q = np.ones((1, 1, 1, 1), dt)
    k = np.array([1000, 1001, 1002, 999], dt).reshape(1, 4, 1, 1)
    v = np.array([10, 20, 30, 40], dt).reshape(1, 4, 1, 1)
    out, lse = numbaflash.attention(to_device(q), to_device(k), to_device(v), softmax_scale=1.0, return_lse=True)
    logits = k.astype(np.float64).ravel()  # as stored: bfloat16 rounds 1001 and 1002 to multiples of 4
    w = np.exp(logits - logits.max())
    np.testing.assert_allclose(to_host(out).astype(np.float64).ravel(), [w @ [10, 20, 30, 40] / w.sum()], rtol=1e-2)
    np.testing.assert_allclose(to_host(lse).ravel(), [logits.max() + np.log(w.sum())], rtol=1e-6)


def test_qkv_sliced_from_a_packed_tensor_reads_strides_in_place(arrays):
    to_device, to_host = arrays
    rng = np.random.default_rng(0)
    qkv = to_device(rng.standard_normal((2, 19, 3, 2, 8)).astype(np.float32))  # (batch, seqlen, 3, heads, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    strided = to_host(numbaflash.attention(q, k, v, causal=True))
    packed = to_host(numbaflash.attention(*(to_device(np.ascontiguousarray(to_host(x))) for x in (q, k, v)), causal=True))
    np.testing.assert_array_equal(strided, packed)


def test_two_dimensional_call_is_one_head(arrays):
    to_device, to_host = arrays
    case = Case(1, 13, 9, 1, 1, 16, "float32", seed=5)
    q, k, v = inputs(case)
    out, lse = numbaflash.attention(to_device(q[0, :, 0]), to_device(k[0, :, 0]), to_device(v[0, :, 0]),
                                    return_lse=True)
    want, want_lse = numbaflash.attention(to_device(q), to_device(k), to_device(v), return_lse=True)
    assert to_host(out).shape == (13, 16) and to_host(lse).shape == (13,)
    np.testing.assert_array_equal(to_host(out), to_host(want)[0, :, 0])
    np.testing.assert_array_equal(to_host(lse), to_host(want_lse)[0, 0])


def test_fully_masked_rows_give_zero_and_minus_inf(arrays, poisoned):
    to_device, to_host = arrays
    case = Case(1, 40, 6, 1, 1, 8, "float32", causal=True)
    q, k, v = (to_device(x) for x in inputs(case))
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = to_host(out), to_host(lse)
    assert np.all(out[0, :34] == 0) and np.all(np.isneginf(lse[0, 0, :34]))
    assert np.all(np.isfinite(lse[0, 0, 34:]))


def test_explain_names_the_kernel_and_the_traffic(arrays):
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(Case(2, 64, 64, 4, 2, 32, "float16")))
    text = numbaflash.explain(q, k, v, causal=True)
    assert "mma_forward" in text and "tensor cores" in text and "standard attention" in text and "GQA" in text


def test_explain_compares_traffic_the_right_way_round():
    from numbaflash.interface import _compared

    assert _compared({"total": 320}, {"total": 100}) == "3.2x more"
    assert _compared({"total": 90}, {"total": 100}) == "1.1x less"  # tiny problems: standard moves less


def test_hopper_plans_name_the_kernel_family_and_why():
    """wgmma for head dims 33-256 on compute capability 9.0; mma.sync around it, with the reason."""
    wgmma = tiling.make_plan(2, 8, 2, 4096, 4096, 128, "bfloat16", device=HOPPER)
    assert wgmma.kernel == "wgmma_tma_forward" and wgmma.tiles.pingpong and wgmma.tiles.warpgroups == 2
    assert "warpgroups" in wgmma.describe() and "wgmma" in wgmma.reason
    # Headdim 64 runs three consumer warpgroups, unless the user's functions are called per score, which
    # their registers do not hold.
    assert tiling.make_plan(1, 8, 8, 2048, 512, 64, "float16", device=HOPPER).tiles.warpgroups == 3
    user = tiling.make_plan(1, 8, 8, 2048, 512, 64, "float16", device=HOPPER, user_functions=True)
    assert user.tiles.warpgroups == 2 and "the user's functions called per score" in user.reason
    wide = tiling.make_plan(2, 8, 2, 4096, 4096, 256, "float16", device=HOPPER)
    assert wide.kernel == "wgmma_tma_forward" and wide.tiles == tiling.WGMMA_TILES[256]
    # Headdim 256 where v5 cannot run (inputs the copy engine cannot read): v3 has no tiles for it, so
    # mma.sync, and the plan says why. Packed (varlen) sequences run v5.
    fallback = tiling.make_plan(2, 8, 2, 4096, 4096, 256, "float16", device=HOPPER, aligned=False)
    assert fallback.kernel == "mma_forward" and "no headdim-256 tiles" in fallback.reason
    packed = tiling.make_plan(2, 8, 2, 4096, 4096, 256, "float16", device=HOPPER, packed=True)
    assert packed.kernel == "wgmma_tma_forward" and packed.tiles == tiling.WGMMA_TILES[256]
    small = tiling.make_plan(2, 8, 2, 4096, 4096, 32, "float16", device=HOPPER)
    assert small.kernel == "mma_forward" and "pad less" in small.reason
    assert tiling.make_plan(1, 1, 1, 64, 64, 64, "float16", device=AMPERE).kernel == "mma_forward"
    counted = sim.count_io(300, 128, plan=tiling.make_plan(1, 1, 1, 300, 300, 128, "float16", device=HOPPER), causal=True)
    assert counted.total == counted.predicted["total"]  # sim counts the wgmma schedule as it runs
    with pytest.raises(ValueError, match="wgmma tiles run"):
        tiling.make_plan(1, 1, 1, 64, 64, 64, "float32", tiles=WgmmaTiles(64, 16, 1))
    with pytest.raises(ValueError, match="64 x warpgroups"):
        WgmmaTiles(128, 64, 1)
    with pytest.raises(ValueError, match="ping-pong takes turns"):
        WgmmaTiles(64, 64, 1, producer=True, tma=True, pingpong=True)
    for stages, producer in ((3, False), (5, True)):
        with pytest.raises(ValueError, match="two-stage K/V ring"):
            WgmmaTiles(64, 64, 1, stages, producer=producer)


@pytest.mark.gpu
@given(case=gpu_cases())
def test_forward_matches_reference_at_real_sizes(case, arrays, poisoned):
    check_forward(case, numbaflash.attention, *arrays)


@pytest.mark.gpu
def test_forward_is_bitwise_reproducible(arrays):
    to_device, to_host = arrays
    case = Case(2, 1025, 1025, 8, 2, 128, "float16", causal=True, seed=21)
    q, k, v = (to_device(x) for x in inputs(case))
    first = to_host(numbaflash.attention(q, k, v, causal=True))
    for _ in range(9):
        assert to_host(numbaflash.attention(q, k, v, causal=True)).tobytes() == first.tobytes()


@pytest.mark.gpu
def test_torch_tensors_and_numba_device_arrays_are_read_in_place():
    torch = pytest.importorskip("torch")
    from numba import cuda

    case = Case(1, 97, 97, 2, 2, 64, "float32", seed=22)
    q, k, v = inputs(case)
    want = numbaflash.attention(*(torch.tensor(x, device="cuda") for x in (q, k, v)))
    assert isinstance(want, torch.Tensor) and want.is_cuda
    got = numbaflash.attention(*(cuda.to_device(x) for x in (q, k, v)))  # __cuda_array_interface__ only
    np.testing.assert_array_equal(np.asarray(got.get() if hasattr(got, "get") else got.copy_to_host()),
                                  want.cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_production_kernels_keep_their_accumulators_in_registers(dtype):
    """No local memory (spills or register arrays indexed at run time) in any kernel of the plans."""
    from numba import cuda

    from numbaflash import interface, tiling

    for headdim in tiling.MMA_HEADDIMS:  # every bucket of both kernel families
        for backward in (False, True):
            plan = tiling.make_plan(1, 1, 1, 512, 512, headdim, dtype, backward=backward)
            for launch in plan.launches:
                attrs = interface.kernel_for(plan, launch).cufunc().attrs
                assert attrs.local == 0, f"{launch.kernel} {dtype} d={headdim}: {attrs.local} bytes of local memory"
                assert attrs.regs * launch.threads <= cuda.get_current_device().MAX_REGISTERS_PER_BLOCK


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("backward", [False, True])
def test_tensor_core_kernels_sass_has_their_mma_and_no_local_memory(dtype, headdim, backward):
    from numbaflash import interface, tiling

    plan = tiling.make_plan(1, 1, 1, 512, 512, headdim, dtype, backward=backward)
    if backward and headdim > 128:
        assert plan.kernel == "simt_backward" and "headdim 256 > 128" in plan.reason
        return
    device = tiling.current_device()
    hopper = (tiling.uses_wgmma_backward if backward else tiling.uses_wgmma)(dtype, device, headdim)
    assert plan.kernel == ("wgmma_tma_backward" if backward and hopper else "mma_backward" if backward else
                           plan.tiles.kernel if hopper else "mma_forward")
    # A backward's first launch is its preprocess (D = rowsum(dO * O), with v5 the staged LSE too), on the CUDA
    # cores.
    for launch in plan.launches[1:] if backward else plan.launches:
        sass = "\n".join(interface.kernel_for(plan, launch).dispatcher.inspect_sass().values())
        assert "LDL" not in sass and "STL" not in sass, launch.kernel
        tma = isinstance(plan.tiles, tiling.WgmmaTiles) and plan.tiles.tma
        assert ("UTMALDG" if tma else "LDGSTS") in sass, launch.kernel  # bulk tensor copies, or cp.async
        if hopper:
            assert "HGMMA" in sass and "HMMA" not in sass.replace("HGMMA", ""), launch.kernel
        else:
            assert "HMMA" in sass and "LDSM" in sass, launch.kernel  # mma.sync and ldmatrix
