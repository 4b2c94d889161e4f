"""`sim.count_io`: exact closed forms, the reference, the SRAM budget, and the scaling laws."""

import os

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import numbaflash
import sim
from sim.blocks import derive, min_sram
from sim.problem import cdiv
from test_forward import HOPPER

DQ = {("flash2", True): ["accumulate", "separate"]}
# Simulated schedules are cheap: twelve times the examples of the active profile (kernel tests' budget).
MANY = settings(max_examples=12 * settings().max_examples)


@st.composite
def problems(draw):
    """Sizes, heads, mask and an SRAM budget that keep the simulated run to a few thousand steps."""
    algorithm = draw(st.sampled_from(sim.ALGORITHMS))
    backward = draw(st.booleans())
    dq = draw(st.sampled_from(DQ.get((algorithm, backward), ["accumulate"])))
    nq = draw(st.integers(1, 300))
    nk = draw(st.one_of(st.just(nq), st.integers(1, 300)))
    d = draw(st.integers(1, 128))
    nheads_kv = draw(st.integers(1, 2))
    nheads = nheads_kv * draw(st.integers(1, 2))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (0, 0), (7, 3), (40, -1), (-1, 25)]))
    low = min_sram(algorithm, d, nk, backward, dq)
    M = draw(st.integers(low, 40 * low))
    blocks = derive(algorithm, M, d, nq, nk, backward, dq)
    assume(cdiv(nq, blocks.rows) * cdiv(nk, blocks.cols) * nheads <= 1500)
    return dict(algorithm=algorithm, backward=backward, dq=dq, seqlen=nq, seqlen_k=nk, headdim=d, nheads=nheads,
                nheads_kv=nheads_kv, causal=causal, window_size=window, sram_bytes=2 * M)


@MANY
@given(problems())
def test_counts_equal_the_closed_form_and_the_result_the_reference(case):
    # count_io itself raises SimulationMismatch unless the result matches float64 to 1e-10 relative.
    report = sim.count_io(**case, batch=2)
    assert report.per_tensor == report.predicted["per_tensor"]
    assert report.total == report.predicted["total"]
    assert report.max_rel_error <= 1e-10
    assert report.peak_sram <= report.sram_elems


@MANY
@given(problems())
def test_counting_without_values_counts_the_same(case):
    assert sim.count_io(**case).per_tensor == sim.count_io(**case, compute=False).per_tensor


@MANY
@given(data=st.data(), d=st.integers(1, 75), extra=st.integers(0, 5000), causal=st.booleans())
def test_flash2_moves_less_than_standard_when_n_at_least_4d_and_m_at_least_4d2(data, d, extra, causal):
    n = data.draw(st.integers(4 * d, 300), label="n")
    M = max(4 * d * d, min_sram("flash2", d, n, False), min_sram("standard", d, n, False)) + extra
    counts = {alg: sim.count_io(n, d, sram_bytes=2 * M, algorithm=alg, causal=causal, compute=False).total
              for alg in ("flash2", "standard")}
    assert counts["flash2"] < counts["standard"]


def test_standard_forward_is_exactly_4n2_plus_4nd_for_any_m():
    n, d = 200, 16
    for M in (400, 1000, 5000, 40000):
        assert sim.count_io(n, d, sram_bytes=2 * M, algorithm="standard").total == 4 * n * n + 4 * n * d


def test_standard_traffic_does_not_depend_on_m():
    totals = {sim.count_io(300, 32, sram_bytes=2 * M, algorithm="standard", backward=bwd, compute=False).total
              for M in (600, 2000, 9000) for bwd in (False,)}
    assert len(totals) == 1


@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
def test_doubling_n_multiplies_flash_traffic_by_about_4(algorithm):
    a, b = (sim.count_io(n, 64, sram_bytes=2 * 16384, algorithm=algorithm, compute=False).total for n in (2048, 4096))
    assert 3.8 <= b / a <= 4.05


@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
def test_halving_m_about_doubles_flash_traffic(algorithm):
    # M >> d^2, where FA1's B_r = min(M/4d, d) sits at its cap and both block rules scale with M.
    a, b = (sim.count_io(8192, 32, sram_bytes=2 * M, algorithm=algorithm, compute=False).total for M in (65536, 32768))
    assert 1.8 <= b / a <= 2.3


def test_causal_and_window_masks_skip_hidden_tiles():
    full = sim.count_io(512, 32, sram_bytes=2 * 8192, algorithm="flash2")
    causal = sim.count_io(512, 32, sram_bytes=2 * 8192, algorithm="flash2", causal=True)
    window = sim.count_io(512, 32, sram_bytes=2 * 8192, algorithm="flash2", window_size=(64, 0))
    assert window.total < causal.total < full.total
    visited = lambda r: sum(1 for s in r.tiles if "j" in s)
    assert visited(causal) < visited(full)


def same_document_causal(b, h, q_idx, kv_idx, docs):
    return docs[b, q_idx] == docs[b, kv_idx] and kv_idx <= q_idx


def schedule_options(schedule, n):
    """count_io's arguments for ``schedule``, and the blocks of each pass as ``(query rows, keys)``: the forward
    and the paper's backward on given blocks; the H100 backward plans, whose passes own 128 keys (then rows)
    and stream 64, two passes or one with the atomic dQ (which runs with v5's tiles asked for)."""
    if schedule in ("forward", "accumulate"):
        return dict(sram_bytes=2**16, block_sizes=(32, 32), backward=schedule != "forward"), [(32, 32)]
    plan = numbaflash.tiling.make_plan(2, 4, 2, n, n, 64, "float16", backward=True, device=HOPPER,
                                       deterministic=schedule == "separate",
                                       tiles=numbaflash.tiling.WGMMA_BACKWARD_TILES[64])
    assert plan.dq_strategy == schedule and (plan.block_m, plan.block_n) == (128, 64)
    return dict(plan=plan, backward=True), [(64, 128)] + ([(128, 64)] if schedule == "separate" else [])


@pytest.mark.parametrize("schedule", ["forward", "accumulate", "separate", "atomic"])
@pytest.mark.parametrize("shared", [True, False])
def test_a_block_mask_counts_only_the_tiles_it_leaves_non_empty(shared, schedule):
    """Documents, causal inside each: every pass of the schedule visits exactly the tiles of the block mask's
    table for its blocks (the closed form sums that table independently of the schedule's loops), moves less
    than dense causal, and computes the reference's values where one mask serves every batch element
    (``shared``)."""
    n = 192
    docs = np.stack([np.arange(n) // 32, np.arange(n) // (32 if shared else 70)]).astype(np.int32)
    mask = numbaflash.block_mask(same_document_causal, None if shared else 2, None, n, n, mod_args=(docs,))
    options, passes = schedule_options(schedule, n)
    sizes = dict(batch=2, nheads=4, nheads_kv=2, **options)
    sparse = sim.count_io(n, 64, block_mask=mask, **sizes)
    dense = sim.count_io(n, 64, causal=True, **sizes)
    assert sparse.matches_prediction and dense.matches_prediction
    assert sparse.predicted["total"] == sim.predict_io(n, 64, block_mask=mask, **sizes)["total"]
    assert sparse.total < dense.total
    tiles = sum(int(np.broadcast_to(visited, (2, 4) + visited.shape[2:]).sum())
                for visited in (mask.visited(*blocks, -1, -1) for blocks in passes))
    assert sum(1 for step in sparse.tiles if "i" in step and "j" in step) == tiles
    if shared:
        assert sparse.max_rel_error <= 1e-10 and "values against the float64 reference" in sparse.checked
    else:
        assert sparse.max_rel_error is None and "differs per batch element or head" in sparse.checked


def test_overflow_names_the_tiles_and_the_budget():
    with pytest.raises(sim.SramOverflow, match=r"S_ij needs 4096 elements .* of the 5000-element budget.*Q\["):
        sim.count_io(256, 16, sram_bytes=2 * 5000, algorithm="flash2", block_sizes=(64, 64))


def test_too_small_an_sram_is_refused_with_the_minimum():
    with pytest.raises(sim.SramOverflow, match="smallest tiles need 515"):
        sim.count_io(64, 128, sram_bytes=2 * 500, algorithm="flash2")


def test_a_wrong_result_is_caught(monkeypatch):
    from sim import online_softmax

    real = online_softmax.finalize
    monkeypatch.setattr(online_softmax, "finalize", lambda m, l, acc: (real(m, l, acc)[0] * 1.001, real(m, l, acc)[1]))
    with pytest.raises(sim.SimulationMismatch):
        sim.count_io(40, 8, sram_bytes=2 * 2000, algorithm="flash2")


def test_bad_arguments_are_refused_with_what_is_accepted():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        sim.count_io(8, 8, sram_bytes=4096, algorithm="flash3")
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        sim.count_io(8, 8, sram_bytes=4096, nheads=3, nheads_kv=2)


def test_ledger_sums_to_the_totals():
    """The ledger holds one (batch, kv head) group's steps; the totals count every group."""
    report = sim.count_io(100, 16, sram_bytes=2 * 3000, algorithm="flash1", causal=True, batch=3, nheads=4,
                          nheads_kv=2)
    assert report.copies == 6 and {s["h"] for s in report.tiles if "h" in s} == {0, 1}
    reads = sum(sum(s["reads"].values()) for s in report.tiles)
    writes = sum(sum(s["writes"].values()) for s in report.tiles)
    assert (reads * 6, writes * 6) == (report.reads, report.writes)


def test_the_figure_2_setting_counts_in_a_memory_budget():
    """The FlashAttention paper's Figure 2 (GPT-2 medium: batch 64, 16 heads, N = 1024, d = 64) with the
    default arguments, values checked on one head: the simulation's peak Python memory stays small."""
    import tracemalloc

    tracemalloc.start()
    for algorithm in ("standard", "flash1"):
        report = sim.count_io(1024, 64, sram_bytes=192 * 1024, algorithm=algorithm, batch=64, nheads=16)
        assert report.matches_prediction and report.max_rel_error is not None
        assert "values against the float64 reference" in report.checked and report.copies == 1024
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_one_head_at_n_131072_counts_under_a_gigabyte():
    """N = 131072 with the default arguments, in a child process whose peak resident memory the OS reports
    (ru_maxrss of all children so far: an upper bound on this one's)."""
    import resource
    import subprocess
    import sys

    code = ("import sim; r = sim.count_io(131072, 64, sram_bytes=192 * 1024, algorithm='flash2'); "
            "assert r.matches_prediction and 'values not checked' in r.checked")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kilobytes on Linux
    assert peak < 2**30, f"peak resident memory {peak / 2**20:.0f} MiB"


def test_values_past_the_check_budget_are_counted_and_the_report_says_so():
    report = sim.count_io(8192, 64, sram_bytes=192 * 1024, algorithm="flash2", causal=True)
    assert report.max_rel_error is None and report.matches_prediction
    assert "values not checked" in report.checked


def test_standard_uncharged_rereads_are_reported():
    report = sim.count_io(128, 16, sram_bytes=2 * 1000, algorithm="standard")
    rows = report.blocks.rows
    # K is re-read for every query block after the first: (T_r - 1) * N * d elements served on chip.
    assert report.uncharged["K"] == (cdiv(128, rows) - 1) * 128 * 16
    assert np.isclose(report.asymptotic["ratio"], 1.0)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(causal="no"), TypeError, "causal must be True or False"),
    (dict(backward="yes"), TypeError, "backward must be True or False"),
    (dict(window_size=(-2, 0)), ValueError, "entries must be >= 0, or -1"),
    (dict(window_size=5), ValueError, "window_size must be a pair of ints"),
    (dict(seqlen_k=64.0), TypeError, "seqlen_k must be an integer >= 1"),
    (dict(batch=0), ValueError, "batch must be an integer >= 1"),
    (dict(sram_bytes=4096.5), TypeError, "sram_bytes must be an integer >= 1"),
    (dict(block_sizes=(16,)), ValueError, "block_sizes must be a pair"),
    (dict(block_sizes=(16, 0)), ValueError, "block_sizes entries must be an integer >= 1"),
    (dict(dq="both"), ValueError, "dq must be one of"),
    (dict(plan="fast"), TypeError, "plan must be None or a numbaflash.plan"),
    (dict(block_mask="causal"), TypeError, "block_mask must be None or what numbaflash.block_mask"),
    (dict(block_mask=numbaflash.block_mask(lambda b, h, i, j: j <= i, None, None, 64, 64), algorithm="flash1"),
     ValueError, "only FlashAttention-2's schedules skip"),
    (dict(block_mask=numbaflash.block_mask(lambda b, h, i, j: j <= i, 3, None, 64, 64)), ValueError,
     "block_mask was made for"),
])
@pytest.mark.parametrize("function", ["count_io", "predict_io"])
def test_count_and_predict_refuse_the_same_bad_arguments(function, kwargs, error, message):
    args = dict(sram_bytes=4096)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        getattr(sim, function)(64, 16, **args)


def test_compute_must_be_a_boolean():
    with pytest.raises(TypeError, match="compute must be True or False"):
        sim.count_io(64, 16, sram_bytes=4096, compute=1)


@pytest.mark.parametrize("algorithm,backward", [("flash2", False), ("flash2", True), ("flash1", False), ("standard", False)])
def test_predict_refuses_the_blocks_count_refuses(algorithm, backward):
    """predict_io overflows exactly where running the schedule would (`blocks.footprint` is exact)."""
    for br, bc in [(8, 8), (16, 32), (32, 16), (48, 48), (64, 64)]:
        kw = dict(sram_bytes=2 * 3000, algorithm=algorithm, backward=backward, block_sizes=(br, bc), compute=False)
        try:
            sim.count_io(96, 16, **kw)
            counted = True
        except sim.SramOverflow:
            counted = False
        kw.pop("compute")
        try:
            sim.predict_io(96, 16, **kw)
            predicted = True
        except sim.SramOverflow:
            predicted = False
        assert counted == predicted, (br, bc)
