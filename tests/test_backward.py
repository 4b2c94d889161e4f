"""The backward kernels against the float64 reference, finite differences, and determinism."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

import numbaflash
from cases import Case, cases, check_backward, gpu_cases, inputs
from numbaflash import masks, tiling
from numbaflash.tiling import MmaTiles
import sim
import sim.hardware
from test_forward import HOPPER

# Three launches per call on the simulator: half the examples of the forward property.
FEWER = settings(max_examples=max(1, settings().max_examples // 2))


@FEWER
@given(case=cases(extreme_logits=False))
def test_backward_matches_reference(case, arrays, poisoned):
    check_backward(case, numbaflash.attention, numbaflash.attention_backward, *arrays)


@pytest.mark.parametrize("dtype,headdim,kernel", [("float16", 40, "wgmma_tma_backward"), ("bfloat16", 200, "simt_backward"),
                                                  ("float64", 256, "simt_backward")])
def test_production_tilings_on_small_shapes(dtype, headdim, kernel, arrays, poisoned):
    """The H100's own block sizes (wgmma v5: two consumer warpgroups beside a producer; 256 threads on the CUDA
    cores), on the simulator."""
    case = Case(1, 11, 19, 2, 1, headdim, dtype, causal=True, seed=4)
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(case))
    fwd = numbaflash.plan(q, k, v, causal=True, device=HOPPER)
    bwd = numbaflash.plan(q, k, v, causal=True, device=HOPPER, backward=True)
    assert bwd.kernel == kernel and bwd.tiles.threads >= 128
    check_backward(case, lambda *a, **kw: numbaflash.attention(*a, plan=fwd, **kw),
                   lambda *a, **kw: numbaflash.attention_backward(*a, plan=bwd, **kw), *arrays)


# Head dims the bulk tensor copies can read (a multiple of 8), one padded.
WGMMA_CASES = [Case(1, 70, 45, 2, 1, 64, "float16", causal=True, seed=21),
               Case(1, 33, 70, 1, 1, 72, "bfloat16", window_size=(20, 3), seed=22)]


@pytest.mark.parametrize("case,tiles", [(c, tiling.SIMULATOR_WGMMA_BACKWARD_TILES) for c in WGMMA_CASES]
                         + [(WGMMA_CASES[0], tiling.WGMMA_CP_ASYNC_BACKWARD_TILES[64])])
def test_wgmma_backward_matches_reference(case, tiles, arrays, poisoned):
    """The Hopper backwards: v5 (a producer's bulk tensor copies through a ring of 16-row tiles, one consumer
    warpgroup of 64 keys or rows) and v3 (cp.async, 64-row tiles): masks, GQA, odd lengths over several tiles, a
    padded head dim, both dtypes."""
    shape = (case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim, case.dtype)
    bwd = tiling.make_plan(*shape, backward=True, tiles=tiles)
    assert bwd.kernel == ("wgmma_tma_backward" if tiles.producer else "wgmma_backward")
    assert "64 keys (dK/dV)" in bwd.describe() and ("TMA" in bwd.describe()) == tiles.producer
    check_backward(case, numbaflash.attention, lambda *a, **kw: numbaflash.attention_backward(*a, plan=bwd, **kw),
                   *arrays)


@pytest.mark.parametrize("case", [Case(1, 20, 12, 1, 1, 16, "float16", causal=True, seed=24),
                                  Case(1, 24, 40, 2, 1, 16, "bfloat16", window_size=(20, 2), seed=25,
                                       modifications=dict(softcap=1.5))])
def test_the_deferred_dq_pass_equals_the_one_that_waits_for_each_dq(case, arrays, mode):
    """v5's dQ pass issuing each key tile's dQ += dS K after the next tile's S and dP (`WgmmaTiles.dq_deferred`, the
    planned tiles; every v5 backward test runs it) gives the dQ of the pass that waits for it at every tile, bit for
    bit (the same products in the same order): one key tile, and several with rows that see no key (causal, more
    queries than keys), a window over GQA with softcap; and it needs a ring of three stages or more, on v5."""
    deferred = tiling.SIMULATOR_WGMMA_BACKWARD_TILES if mode == "simulator" else tiling.WGMMA_BACKWARD_TILES[64]
    shape = (case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim, case.dtype)
    assert deferred.dq_deferred and "dQ += dS K after the next tile's S and dP" in tiling.make_plan(
        *shape, backward=True, tiles=deferred).describe()
    to_device, to_host = arrays
    q, k, v, dout = (to_device(x) for x in inputs(case, extra=[(case.batch, case.seqlen_q, case.nheads, case.headdim)]))
    options = case.options(to_device)
    out, lse = numbaflash.attention(q, k, v, return_lse=True, **options)
    dq, dq_waiting = (to_host(numbaflash.attention_backward(dout, q, k, v, out, lse, plan=tiling.make_plan(
        *shape, backward=True, tiles=tiles), **options)[0])
        for tiles in (deferred, dataclasses.replace(deferred, dq_deferred=False)))
    assert np.isfinite(dq.astype(np.float32)).all()
    assert np.array_equal(dq.view(np.uint16), dq_waiting.view(np.uint16))
    for refused in (dict(stages=2), dict(tma=False, producer=False, stages=2)):
        with pytest.raises(ValueError, match="dq_deferred"):
            dataclasses.replace(deferred, **refused)


ATOMIC_TILES = tiling.WgmmaTiles(64, 64, 1, producer=True, tma=True)  # v5's smallest tiles that stream 64 rows


def test_atomic_dq_backward_matches_reference(arrays, poisoned):
    """deterministic=False: v5's dK/dV kernel adds dS K into a float32 dQ with atomics (two consumers taking
    turns, as the H100 runs it), then a pass rounds it: a window, GQA, odd lengths, a padded head dim."""
    case = Case(1, 50, 130, 2, 1, 40, "bfloat16", window_size=(50, 7), seed=23)
    shape = (case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim, case.dtype)
    bwd = tiling.make_plan(*shape, backward=True, tiles=tiling.WGMMA_BACKWARD_TILES[64], deterministic=False)
    assert bwd.dq_strategy == "atomic" and "atomics" in bwd.reason
    assert [launch.kernel for launch in bwd.launches[1:]] == ["wgmma_tma_backward_dkdvdq", "backward_dq_postprocess"]
    check_backward(case, numbaflash.attention,
                   lambda *a, **kw: numbaflash.attention_backward(*a, plan=bwd, deterministic=False, **kw), *arrays)


def test_softcap_plans_the_atomic_dq(arrays, mode, poisoned):
    """deterministic=False with softcap, alone or with ALiBi, at head dims padded to 64 plans v5's atomic dQ, whose one
    pass forms each score's tanh and ex2 once where the two passes form them twice (`tiling.ATOMIC_DQ_SOFTCAP_REASON`);
    not with a user function, packed sequences, a block mask, without softcap, at 128 or deterministic. Held to the
    reference rule with ALiBi under a causal mask: a GPU's plan, and on the simulator (which plans mma.sync's
    backward) v5's smallest tiles that stream 64 rows."""
    shape = (1, 2, 1, 40, 70)

    def planned(headdim=40, device=HOPPER, deterministic=False, softcap=1.5, **options):
        return tiling.make_plan(*shape, headdim, "float16", backward=True, device=device, deterministic=deterministic,
                                softcap=softcap, **options)

    assert planned().dq_strategy == "atomic" and tiling.ATOMIC_DQ_SOFTCAP_REASON in planned().reason
    for options in (dict(user_functions=True), dict(packed=True), dict(block_sparse=True), dict(softcap=0.0),
                    dict(headdim=128), dict(deterministic=True)):
        assert planned(**options).dq_strategy == "separate", options
    assert "run faster than v5's atomic dQ" in planned(softcap=0.0).reason
    here = (planned(device=None) if mode == "gpu" else
            tiling.make_plan(*shape, 40, "float16", backward=True, tiles=ATOMIC_TILES, deterministic=False))
    assert here.dq_strategy == "atomic"
    slopes = np.random.default_rng(8).uniform(0.05, 0.5, (1, 2)).astype(np.float32)
    case = Case(1, 40, 70, 2, 1, 40, "float16", causal=True, logit_scale=2.0, seed=8,
                modifications=dict(softcap=1.5, alibi_slopes=slopes))
    check_backward(case, numbaflash.attention,
                   lambda *a, **kw: numbaflash.attention_backward(*a, plan=here, deterministic=False, **kw), *arrays)


def test_deterministic_false_plans_and_refusals(arrays):
    """The atomic dQ with v5's tiles asked for at head dims padded to 64; the two passes elsewhere, and in every
    planned call without softcap (faster), and why; a plan with atomics refused to a deterministic call;
    deterministic must be a bool."""
    shape = (2, 4, 2, 300, 200)
    atomic = tiling.make_plan(*shape, 64, "float16", backward=True, device=HOPPER, deterministic=False,
                              tiles=tiling.WGMMA_BACKWARD_TILES[64])
    assert atomic.dq_strategy == "atomic" and atomic.launches[1].grid == (2, 2, 2)  # 128 keys a block, one pass
    for headdim, dtype, tiles in ((64, "float16", None), (128, "float16", None), (64, "float32", None),
                                  (128, "bfloat16", tiling.WGMMA_BACKWARD_TILES[128])):
        plan = tiling.make_plan(*shape, headdim, dtype, backward=True, device=HOPPER, deterministic=False, tiles=tiles)
        assert plan.dq_strategy == "separate" and len(plan.launches) == 3 and "deterministic=False" in plan.reason
    assert "run faster" in tiling.make_plan(*shape, 64, "float16", backward=True, device=HOPPER,
                                            deterministic=False).reason
    assert "atomic dQ runs v5's tiles" in tiling.make_plan(*shape, 128, "bfloat16", backward=True, device=HOPPER,
                                                           deterministic=False, tiles=tiling.WGMMA_BACKWARD_TILES[128]).reason
    case = Case(1, 20, 20, 1, 1, 64, "float16", seed=3)
    to_device, _ = arrays
    q, k, v, dout = (to_device(x) for x in inputs(case, extra=[(1, 20, 1, 64)]))
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    atomic = tiling.make_plan(1, 1, 1, 20, 20, 64, "float16", backward=True, tiles=ATOMIC_TILES, deterministic=False)
    with pytest.raises(ValueError, match="deterministic=False"):
        numbaflash.attention_backward(dout, q, k, v, out, lse, plan=atomic)
    for call in (lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, deterministic="no"),
                 lambda: numbaflash.plan(q, k, v, backward=True, deterministic=1),
                 lambda: numbaflash.explain(q, k, v, backward=True, deterministic=None)):
        with pytest.raises(TypeError, match="deterministic"):
            call()


@pytest.mark.parametrize("causal", [False, True])
def test_sim_counts_the_atomic_dq_schedule(causal):
    """`sim` counts deterministic=False's one pass (128 keys streaming 64 query rows) with dQ summed in a float32
    dQ_acc (zeroed, read and written per visible tile, read once more by the rounding pass), as its closed form
    says; against the two passes, Q is read half as often and dQ_acc takes the place of the dQ pass. sim.hardware
    walks its kernels: the two passes' dK/dV kernel's accesses and the reductions, then the rounding pass."""
    plan = tiling.make_plan(1, 2, 1, 300, 250, 64, "float16", backward=True, device=HOPPER, deterministic=False,
                            tiles=tiling.WGMMA_BACKWARD_TILES[64])
    sizes = dict(seqlen_k=250, nheads=2, nheads_kv=1, causal=causal, backward=True)
    counted = sim.count_io(300, 64, plan=plan, **sizes)
    assert counted.matches_prediction and counted.max_rel_error < 1e-10 and counted.dq == "atomic"
    assert sim.predict_io(300, 64, plan=plan, **sizes)["total"] == counted.total
    acc = counted.per_tensor["dQ_acc"]
    assert acc["reads"] == acc["writes"] > 2 * 300 * 64 and counted.per_tensor["dQ"] == {"reads": 0, "writes": 2 * 300 * 64}
    two_passes = sim.count_io(300, 64, plan=tiling.make_plan(1, 2, 1, 300, 250, 64, "float16", backward=True,
                                                              device=HOPPER), **sizes)
    assert counted.per_tensor["Q"]["reads"] < two_passes.per_tensor["Q"]["reads"]
    # sim.hardware walks the one pass as the two passes' dK/dV kernel plus its reductions: whole 64-row tiles
    # of the padded float32 dQ (128-key blocks x 64-row tiles that see them), then the rounding pass.
    atomic = sim.hardware.predict(plan, causal=causal, gpu=sim.hardware.H100)
    separate = sim.hardware.predict(tiling.make_plan(1, 2, 1, 300, 250, 64, "float16", backward=True, device=HOPPER),
                                    causal=causal, gpu=sim.hardware.H100)
    assert [k.kernel for k in atomic.kernels] == [launch.kernel for launch in plan.launches]
    key_pass, post = atomic.kernels[1], atomic.kernels[2]
    same = ("load_bytes", "copy_bytes", "tma_bytes", "store_bytes")
    assert [getattr(key_pass, f) for f in same] == [getattr(separate.kernels[1], f) for f in same]
    left, right = masks.normalize_window(causal, (-1, -1))
    tiles = sum(len(range((lo // 64) * 64, hi, 64)) for lo, hi in
                (masks.query_range(k0, min(k0 + 128, 250), 300, 250, left, right) for k0 in range(0, 250, 128)) if lo < hi)
    assert key_pass.reduce_bytes == 2 * tiles * 64 * 64 * 4 > 0
    assert (post.load_bytes, post.store_bytes, post.reduce_bytes) == (2 * 300 * 64 * 4, 2 * 300 * 64 * 2, 0)
    assert atomic.global_bytes > 0 and atomic.dram_bytes > 0


def test_hopper_backward_plans():
    """v5 wherever the copy engine reads the operands, mma.sync with the reason otherwise; the producer's
    ring over several stages."""
    shape = (2, 4, 2, 300, 200)
    for headdim, D in ((40, 64), (64, 64), (72, 128), (128, 128)):
        plan = tiling.make_plan(*shape, headdim, "bfloat16", backward=True, device=HOPPER)
        assert plan.kernel == "wgmma_tma_backward" and plan.tiles == tiling.WGMMA_BACKWARD_TILES[D]
        assert [launch.threads for launch in plan.launches[1:]] == [384, 384]
        assert plan.launches[1].grid == (2, 2, 2) and plan.launches[2].grid == (3, 4, 2)  # 128 keys, 128 rows a block
    unaligned = tiling.make_plan(*shape, 64, "float16", backward=True, device=HOPPER, aligned=False)
    assert (unaligned.kernel == "mma_backward" and "not 16-byte aligned" in unaligned.reason
            and "wgmma backward (v5)" in unaligned.reason)
    packed = tiling.make_plan(*shape, 64, "float16", backward=True, device=HOPPER, packed=True)  # v5 takes varlen
    assert packed.kernel == "wgmma_tma_backward" and packed.staged_statistics
    # Each sequence's statistics, padded to whole tiles, in a segment of its own inside the workspace
    from numbaflash.kernels.sequences import stats_start

    cu_seqlens_q, whole = (0, 300, 301, 1000), 128  # lcm of the tiles' 128 and 64 rows
    rows = tiling.packed_delta_shape(dataclasses.replace(packed, batch=3), cu_seqlens_q[-1])[-1]
    segments = [(stats_start(cu_seqlens_q[b], b, whole), -(-(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) // whole) * whole)
                for b in range(3)]
    assert all(start % 4 == 0 for start, _ in segments)  # 16-byte aligned for the bulk copies
    assert all(a + n <= b for (a, n), (b, _) in zip(segments, segments[1:])) and segments[-1][0] + segments[-1][1] <= rows
    plan = tiling.make_plan(*shape, 32, "float16", backward=True, device=HOPPER)
    assert plan.kernel == "mma_backward" and "starts at headdim 33" in plan.reason
    device = tiling.current_device()  # the simulator's plans keep mma.sync
    here = tiling.make_plan(*shape, 64, "float16", backward=True, device=device)
    assert here.kernel == ("wgmma_tma_backward" if tiling.uses_wgmma_backward("float16", device, 64) else "mma_backward")


def test_wgmma_backward_refuses_what_it_cannot_run():
    producer = dict(producer=True, tma=True)
    for tiles, match in ((tiling.WgmmaTiles(64, 16, 1), "square tiles"),
                         (tiling.WgmmaTiles(128, 64, 2, producer=True), "tma=True"),
                         (tiling.WgmmaTiles(128, 64, 2, pingpong=True, **producer), "without ping-pong"),
                         (tiling.WgmmaTiles(192, 64, 3, **producer), "1 or 2 consumer warpgroups"),
                         (tiling.WgmmaTiles(64, 64, 1), "packed")):
        with pytest.raises(ValueError, match=match):
            tiling.make_plan(1, 2, 2, 64, 64, 64, "float16", backward=True, tiles=tiles, packed=match == "packed")
    with pytest.raises(ValueError, match="bulk tensor copy engine"):
        tiling.make_plan(1, 2, 2, 64, 64, 64, "float16", backward=True, tiles=tiling.WGMMA_BACKWARD_TILES[64],
                         aligned=False)
    with pytest.raises(ValueError, match="wgmma backward runs head dims up to 128"):
        tiling.make_plan(1, 2, 2, 64, 64, 200, "float16", backward=True, tiles=tiling.WgmmaTiles(64, 64, 1))


@pytest.mark.parametrize("tiles", [tiling.WGMMA_CP_ASYNC_BACKWARD_TILES[64], tiling.WGMMA_BACKWARD_TILES[64]])
@pytest.mark.parametrize("causal", [False, True])
def test_sim_counts_the_wgmma_backward_schedule(tiles, causal):
    """`sim` counts the wgmma backwards' schedules as it counts the mma.sync one's, v5's with its own blocks in
    each pass (128 keys streaming 64 query rows, then 128 rows streaming 64 keys), and `sim.hardware` walks
    their launches (cp.async tiles, or bulk tensor copies, LSE and D among them, staged by v5's preprocess)."""
    import sim.hardware

    plan = tiling.make_plan(1, 2, 1, 300, 250, 64, "float16", backward=True, tiles=tiles, device=HOPPER)
    counted = sim.count_io(300, 64, seqlen_k=250, nheads=2, nheads_kv=1, plan=plan, causal=causal, backward=True)
    assert counted.matches_prediction and counted.max_rel_error < 1e-10
    predicted = sim.predict_io(300, 64, seqlen_k=250, nheads=2, nheads_kv=1, plan=plan, causal=causal, backward=True)
    assert predicted["total"] == counted.total
    if tiles.producer:
        # v5's preprocess reads each row's LSE once and writes it beside D; the passes read that copy.
        assert counted.per_tensor["LSE"] == {"reads": 2 * 300, "writes": 0}
        assert counted.per_tensor["LSE2"]["writes"] == 2 * 300 and counted.per_tensor["LSE2"]["reads"] > 0
    else:
        assert "LSE2" not in counted.per_tensor
    if tiles.producer:  # the dK/dV pass reads Q once per 128-key block: fewer reads than 64 x 64 blocks
        square = tiling.make_plan(1, 2, 1, 300, 250, 64, "float16", backward=True, device=HOPPER,
                                  tiles=tiling.WGMMA_CP_ASYNC_BACKWARD_TILES[64])
        assert counted.per_tensor["Q"]["reads"] < sim.count_io(300, 64, seqlen_k=250, nheads=2, nheads_kv=1, plan=square,
                                                               causal=causal, backward=True).per_tensor["Q"]["reads"]
    traffic = {k.kernel: k for k in sim.hardware.predict(plan, causal=causal, gpu=sim.hardware.H100).kernels}
    moved = "tma_bytes" if tiles.producer else "copy_bytes"
    assert getattr(traffic[plan.kernel + "_dkdv"], moved) > 0 and getattr(traffic[plan.kernel + "_dq"], moved) > 0


def test_tensor_core_backward_with_one_m_tile_per_warp(arrays, poisoned):
    """Warps of 16 keys or rows, as the headdim-128 plan runs (smaller head dims give a warp two m-tiles)."""
    case = Case(1, 19, 23, 4, 2, 20, "float16", causal=True, seed=6)
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(case))
    one = tiling.make_plan(1, 4, 2, 19, 23, 20, "float16", backward=True, tiles=MmaTiles(16, 16, 1))
    assert numbaflash.plan(q, k, v, causal=True, backward=True).tiles.m_tiles == 2 and one.kernel == "mma_backward"
    check_backward(case, numbaflash.attention, lambda *a, **kw: numbaflash.attention_backward(*a, plan=one, **kw),
                   *arrays)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1))])
def test_float64_kernels_match_central_differences(mask, arrays):
    """Directional derivatives of sum(dout * attention(q, k, v)) by central differences of the float64
    forward kernel, along random directions, against <gradient, direction> from the backward kernels."""
    to_device, to_host = arrays
    case = Case(1, 6, 7, 2, 1, 5, "float64", seed=7, **mask)
    q, k, v, dout = inputs(case, extra=[(1, 6, 2, 5)])
    out, lse = numbaflash.attention(*(to_device(x) for x in (q, k, v)), return_lse=True, **mask)
    grads = [to_host(g) for g in numbaflash.attention_backward(*(to_device(x) for x in (dout, q, k, v)), out, lse, **mask)]
    loss = lambda *qkv: float(np.sum(dout * to_host(numbaflash.attention(*(to_device(x) for x in qkv), **mask))))
    rng, eps = np.random.default_rng(8), 1e-6
    for which, grad in enumerate(grads):
        for _ in range(2):
            direction = rng.standard_normal(grad.shape)
            plus, minus = [q, k, v], [q, k, v]
            plus[which], minus[which] = plus[which] + eps * direction, minus[which] - eps * direction
            numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
            np.testing.assert_allclose(np.sum(grad * direction), numeric, rtol=1e-7, atol=1e-9)


def test_gradients_are_bitwise_reproducible(arrays):
    to_device, to_host = arrays
    case = Case(1, 23, 17, 2, 1, 12, "float32", causal=True, seed=9)
    q, k, v, dout = (to_device(x) for x in inputs(case, extra=[(1, 23, 2, 12)]))
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    first = [to_host(g) for g in numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    again = [to_host(g) for g in numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()


def test_backward_refuses_a_wrong_lse(arrays):
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(Case(1, 8, 8, 2, 2, 16, "float32")))
    out = numbaflash.attention(q, k, v)
    with pytest.raises(ValueError, match=r"lse must be attention's log-sum-exp: shape \(1, 2, 8\)"):
        numbaflash.attention_backward(out, q, k, v, out, out)


@pytest.mark.gpu
@FEWER
@given(case=gpu_cases(max_rows=4096))
def test_backward_matches_reference_at_real_sizes(case, arrays, poisoned):
    check_backward(case, numbaflash.attention, numbaflash.attention_backward, *arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gradients_are_bitwise_reproducible_over_10_calls(dtype, arrays):
    to_device, to_host = arrays
    case = Case(2, 1025, 1025, 8, 2, 128, dtype, causal=True, seed=23)
    q, k, v, dout = (to_device(x) for x in inputs(case, extra=[(2, 1025, 8, 128)]))
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    first = [to_host(g).tobytes() for g in numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    for _ in range(9):
        again = [to_host(g).tobytes() for g in numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
        assert again == first


def test_explain_names_the_tensor_core_backward(arrays):
    to_device, _ = arrays
    q, k, v = (to_device(x) for x in inputs(Case(1, 64, 64, 4, 2, 64, "bfloat16")))
    text = numbaflash.explain(q, k, v, causal=True, backward=True)
    plan = numbaflash.plan(q, k, v, causal=True, backward=True)  # mma.sync, or on Hopper wgmma v5
    rows = 64 if plan.kernel == "wgmma_tma_backward" else plan.tiles.rows_per_warp  # 32: two m-tiles per warp
    assert plan.kernel in ("mma_backward", "wgmma_tma_backward")
    assert f"{plan.kernel}_dkdv" in text and f"{plan.kernel}_dq" in text and f"{rows} keys (dK/dV)" in text
    assert "GQA" in text and "standard attention" in text
