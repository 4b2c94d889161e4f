"""Packed variable-length batches (`numbaflash.attention_varlen`): each sequence of one packed call against
its own per-sequence problem, under flash-attn's tolerance rule, in every kernel family, with masks and
modifications; and every bad cu_seqlens and max_seqlen refused.

The sequences include one with no query rows (its keys get zero gradients), one whose queries outnumber
its keys under a causal mask (rows that see no key), and one with no keys (out 0, LSE -inf).
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import tiling
from cases import Case, check_backward, check_forward, inputs
from test_mods import modifications
from test_scale_and_nan import FAMILIES

NHEADS, NHEADS_KV, HEADDIM = 2, 1, 16
SEQLENS_Q, SEQLENS_K = (19, 0, 9, 5), (23, 4, 3, 0)


def per_sequence(name, mods, b):
    """Sequence ``b``'s share of the varlen call's modifications: rows of the per-sequence tables."""
    mods = dict(mods)
    if "alibi_slopes" in mods:
        mods["alibi_slopes"] = mods["alibi_slopes"][b:b + 1]
    if name == "bias table, documents":
        bias, doc_q, doc_k = mods["mod_args"]
        mods["mod_args"] = (bias, doc_q[b:b + 1], doc_k[b:b + 1])
    elif name == "prefix LM, softcap, temperature":
        prefix, temperature = mods["mod_args"]
        mods["mod_args"] = (prefix[b:b + 1], temperature)
    return mods


def packed_problem(dtype, name, causal, seqlens_q=SEQLENS_Q, seqlens_k=SEQLENS_K, headdim=HEADDIM, seed=21):
    """Per-sequence cases (None for a sequence with no queries or no keys) and the packed inputs built from
    their own inputs: q, k, v, dout, cu_seqlens_q, cu_seqlens_k, and the call's modifications."""
    batch = len(seqlens_q)
    mods = modifications(name, max(seqlens_q), max(seqlens_k), batch=batch, nheads=NHEADS, seed=seed) if name else {}
    cases, parts = [], []
    for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)):
        case = Case(1, max(lq, 1), max(lk, 1), NHEADS, NHEADS_KV, headdim, dtype, causal=causal, logit_scale=2.0,
                    seed=seed + b, modifications=per_sequence(name, mods, b) if name else None)
        q, k, v, dout = (x[0] for x in inputs(case, extra=[(1, case.seqlen_q, NHEADS, headdim)]))
        parts.append((q[:lq], k[:lk], v[:lk], dout[:lq]))
        cases.append(case if lq and lk else None)
    packed = [np.concatenate(xs) for xs in zip(*parts)]
    cu = [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (seqlens_q, seqlens_k)]
    return cases, packed, cu, mods


def run(dtype, name, causal, to_device, to_host, tiles=None, backward=False, backward_tiles=None, **sizes):
    """The cases, the per-sequence results (`results_of`) and the cu_seqlens of a packed problem."""
    cases, packed, cu, mods = packed_problem(dtype, name, causal, **sizes)
    return cases, results_of(dtype, causal, mods, packed, cu, to_device, to_host, tiles, backward, backward_tiles), cu


def results_of(dtype, causal, mods, packed, cu, to_device, to_host, tiles=None, backward=False, backward_tiles=None):
    """The packed call's per-sequence results: for each sequence (out, lse) and, with ``backward``, (dq, dk, dv),
    as batch-1 arrays. ``tiles``, ``backward_tiles``: the forward's and the backward's (default: the plans')."""
    q, k, v, dout = packed
    seqlens_q, seqlens_k = np.diff(cu[0]), np.diff(cu[1])
    lengths = (int(cu[0].shape[0]) - 1, int(seqlens_q.max()), int(seqlens_k.max()))
    options = Case(1, 1, 1, 1, 1, q.shape[-1], dtype, causal=causal, logit_scale=2.0, modifications=mods)
    # a Python float, as callers pass it, so that the calls' layouts are remembered (`call_cache`) as theirs are
    options = dict(softmax_scale=float(options.scale), **options.options(to_device))
    dev = [to_device(x) for x in (q, k, v, dout, *cu)]

    def plan_of(chosen, backward=False):
        return None if chosen is None else tiling.make_plan(lengths[0], NHEADS, NHEADS_KV, *lengths[1:], q.shape[-1],
                                                            dtype, backward=backward, tiles=chosen, packed=True)

    out, lse = numbaflash.attention_varlen(*dev[:3], *dev[4:], *lengths[1:], return_lse=True, plan=plan_of(tiles),
                                           **options)
    grads = (numbaflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:], *lengths[1:],
                                                  plan=plan_of(backward_tiles, True), **options) if backward else None)
    out, lse = to_host(out), to_host(lse)
    assert out.shape == q.shape and lse.shape == (NHEADS, q.shape[0])
    grads = None if grads is None else [to_host(g) for g in grads]
    results = []
    for b in range(lengths[0]):
        rows, keys = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
        forward = (out[None, rows], lse[None, :, rows])
        results.append((forward, None if grads is None else (grads[0][None, rows], grads[1][None, keys],
                                                              grads[2][None, keys])))
    return results


def check_sequences(cases, results, cu, to_device, backward):
    """Each sequence under the tolerance rule; the degenerate ones exactly."""
    for b, (case, (forward, grads)) in enumerate(zip(cases, results)):
        if case is not None:
            check_forward(case, lambda *a, **kw: forward, lambda x: x, lambda x: x)
            if backward:
                check_backward(case, lambda *a, **kw: forward, lambda *a, **kw: grads, lambda x: x, lambda x: x)
            continue
        out, lse = forward
        assert (out == 0).all() and np.isneginf(lse).all(), f"sequence {b} (no keys or no queries): out {out}, lse {lse}"
        if backward:
            for name, grad in zip(("dq", "dk", "dv"), grads):
                assert (grad == 0).all(), f"sequence {b}: {name} {grad}"


# The simulator runs every backward family with a combination: the CUDA cores and mma.sync with their
# forwards, v5 (whose tensor maps span the packed operands) with its forward; and v3's forward plain. v5 also
# runs a score_mod alone under causal, whose dK/dV step calls it at visible pairs without a branch, with a
# sequence of no query rows and one of no keys.
SIMULATED = [("simt", "softcap, ALiBi", True), ("mma", "bias table, documents", False), ("wgmma v3", None, True),
             ("wgmma v5", "bias table, documents", True), ("wgmma v5", "bias table alone", True)]
BACKWARD_TILES = {"wgmma v5": tiling.SIMULATOR_WGMMA_BACKWARD_TILES}


@pytest.mark.parametrize("family, name, causal", SIMULATED)
def test_each_sequence_equals_its_own_problem(family, name, causal, arrays, poisoned):
    dtype, tiles = FAMILIES[family]
    backward = family != "wgmma v3"
    cases, results, cu = run(dtype, name, causal, *arrays, tiles=tiles, backward=backward,
                             backward_tiles=BACKWARD_TILES.get(family))
    check_sequences(cases, results, cu, arrays[0], backward)


# v5's forward whose consumers issue each tile's S a tile ahead (a rung no plan takes: `WgmmaTiles.scores_ahead`), K's
# copies two tiles ahead of V's
AHEAD = "wgmma v5, scores ahead"
PACKED_FAMILIES = dict(FAMILIES, **{AHEAD: ("float16", tiling.WgmmaTiles(64, 16, 1, producer=True, tma=True,
                                                                         scores_ahead=True))})


@pytest.mark.parametrize("family", ["wgmma v3", "wgmma v5", AHEAD])
def test_a_sequence_never_reads_the_next_ones_values(family, arrays, poisoned):
    """Sequence 0's last tiles reach into the next sequences' rows (v5's tensor maps span the packed operands):
    an inf in any of their q, k, v or dout must not reach sequence 0's results, where zero probabilities or
    dS times it would be NaN. v3's forward runs with mma.sync's backward (v3's takes no packed sequences)."""
    dtype, tiles = PACKED_FAMILIES[family]
    cases, (q, k, v, dout), cu, _ = packed_problem(dtype, None, False)
    assert cu[0][1] % 16 and cu[1][1] % 16, "sequence 0 must end inside its query and key tiles"
    for x, at in ((q, 0), (k, 1), (v, 1), (dout, 0)):
        x[cu[at][1]:] = np.inf
    results = results_of(dtype, False, {}, (q, k, v, dout), cu, *arrays, tiles=tiles, backward=True,
                         backward_tiles=BACKWARD_TILES.get(family))
    check_sequences(cases[:1], results[:1], cu, arrays[0], backward=True)


def test_a_longer_sequence_in_a_packed_layout_seen_before_is_computed_whole(arrays, poisoned):
    """Two calls whose packed operands have one layout (the same totals and number of sequences), the second with
    longer sequences, on the plans the calls choose: the second's plan covers its own longest sequences, not the
    first's (the views' layout remembered a plan whose grid left the longer sequence's first rows unwritten)."""
    for seqlens_q, seqlens_k in (((16, 16), (16, 16)), ((4, 28), (4, 28))):
        cases, results, cu = run("float32", None, True, *arrays, backward=True, seqlens_q=seqlens_q,
                                 seqlens_k=seqlens_k)
        check_sequences(cases, results, cu, arrays[0], backward=True)


# At real sizes every family (the production tiles, or v3's), many sequences of odd lengths.
GPU_FAMILIES = {"simt": ("float32", 64, None), "mma": ("float16", 256, None), "wgmma v5": ("float16", 128, None),
                "wgmma v5 (d64)": ("bfloat16", 64, None), "wgmma v3": ("float16", 128, tiling.WGMMA_CP_ASYNC_TILES[128])}


def odd_lengths(seed):
    """Query and key lengths of 11 packed sequences at real sizes: 9 random ones, then one of no query rows and a
    long one."""
    rng = np.random.default_rng(seed)
    seqlens_q = tuple(int(n) for n in rng.integers(1, 700, 9)) + (0, 1500)
    seqlens_k = tuple(int(n) for n in rng.integers(1, 700, 9)) + (300, 1200)
    return seqlens_q, seqlens_k


@pytest.mark.gpu
@pytest.mark.parametrize("family", GPU_FAMILIES)
@pytest.mark.parametrize("name", ["softcap, ALiBi", "prefix LM, softcap, temperature"])
def test_each_sequence_equals_its_own_problem_at_real_sizes(family, name, arrays, poisoned):
    dtype, headdim, tiles = GPU_FAMILIES[family]
    seqlens_q, seqlens_k = odd_lengths(22)
    backward = headdim <= 128 or family == "simt"
    cases, results, cu = run(dtype, name, name == "softcap, ALiBi", *arrays, tiles=tiles, backward=backward,
                             seqlens_q=seqlens_q, seqlens_k=seqlens_k, headdim=headdim)
    check_sequences(cases, results, cu, arrays[0], backward)


@pytest.mark.gpu
def test_softcap_alone_over_packed_sequences_at_real_sizes(arrays, poisoned):
    """softcap alone's own forward plans over many packed sequences of odd lengths, causal: at headdim 128 three
    consumers on 80-key tiles (`tiling.WGMMA_SOFTCAP_TILES`), at 64 part of ex2 on the FMA pipe."""
    seqlens_q, seqlens_k = odd_lengths(23)
    for headdim in (64, 128):
        cases, results, cu = run("float16", "softcap alone", True, *arrays, backward=True, seqlens_q=seqlens_q,
                                 seqlens_k=seqlens_k, headdim=headdim)
        check_sequences(cases, results, cu, arrays[0], backward=True)


def _packed(dtype="float16"):
    cases, (q, k, v, dout), cu, _ = packed_problem(dtype, None, False, (3, 4), (2, 5))
    return q, k, v, cu


@pytest.mark.parametrize("change, error, match", [
    (dict(cu_seqlens_q=np.array([0, 3, 7], np.int64)), ValueError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=np.array([[0, 2, 7]], np.int32)), ValueError, "cu_seqlens_k must be int32 of shape"),
    (dict(cu_seqlens_q=np.array([0], np.int32)), ValueError, "at least 2 entries"),
    (dict(cu_seqlens_q=np.array([0, 5, 3], np.int32)), ValueError, "never decrease"),
    (dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens_k=np.array([0, 2, 6], np.int32)), ValueError, "end at the packed length 7"),
    (dict(cu_seqlens_k=np.array([0, 2, 5, 7], np.int32)), ValueError, "the same number"),
    (dict(cu_seqlens_q=[0, 3, 7]), TypeError, "cu_seqlens_q must be an array"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q \(3\) is shorter than the longest sequence"),
    (dict(max_seqlen_k=0), ValueError, "max_seqlen_k must be an integer >= 1"),
    (dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an integer"),
    (dict(q=np.zeros((1, 7, 2, 16), np.float16)), ValueError, "q must be 3-D"),
    (dict(k=np.zeros((8, 1, 16), np.float16)), ValueError, "end at the packed length 8"),
    (dict(block_mask=object()), TypeError, "block_mask"),
    (dict(causal="yes"), TypeError, "causal must be True or False"),
    (dict(alibi_slopes=np.zeros((3, 2), np.float32)), ValueError, r"\(batch, nheads\) = \(2, 2\)"),
])
def test_bad_varlen_arguments_are_refused(change, error, match):
    q, k, v, cu = _packed()
    args = {**dict(q=q, k=k, v=v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=4, max_seqlen_k=5), **change}
    with pytest.raises(error, match=match):
        numbaflash.attention_varlen(**args)


def test_a_max_seqlen_past_the_packed_total_runs_the_totals_grid():
    """flash-attn takes any max_seqlen at least the longest sequence's; the grid covers the packed totals at most
    (2^40 rows made the simulator's grid, and a GPU's, out of reach)."""
    q, k, v, cu = _packed("float32")
    want = numbaflash.attention_varlen(q, k, v, *cu, 4, 5, return_lse=True)
    got = numbaflash.attention_varlen(q, k, v, *cu, 2**40, 2**40, return_lse=True)
    for name, a, b in zip(("out", "lse"), got, want):
        assert np.array_equal(a, b), f"{name}: max error {np.nanmax(np.abs(a - b))}"


def test_bad_varlen_backward_arguments_are_refused():
    q, k, v, cu = _packed("float32")
    out, lse = numbaflash.attention_varlen(q, k, v, *cu, 4, 5, return_lse=True)
    with pytest.raises(ValueError, match="lse must be attention_varlen's log-sum-exp: shape \\(2, 7\\)"):
        numbaflash.attention_varlen_backward(out, q, k, v, out, lse[None], *cu, 4, 5)
    with pytest.raises(ValueError, match="dout must match q"):
        numbaflash.attention_varlen_backward(out[:-1], q, k, v, out, lse, *cu, 4, 5)
    with pytest.raises(ValueError, match="v4 \\(a producer without tma\\) does not take packed"):
        tiling.make_plan(2, 2, 1, 4, 5, 64, "float16", tiles=tiling.WgmmaTiles(64, 16, 1, producer=True), packed=True)
