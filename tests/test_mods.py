"""Score and mask modifications (`numbaflash.mods`) in every kernel family, forward and backward.

Three combinations cover flash-attn's built-ins and FlexAttention-style user functions, each against the
float64 reference extended with the same modifications, under flash-attn's tolerance rule:

* built-ins: softcap with causal, and ALiBi slopes per (batch, head); each alone, where the tensor-core
  forwards take paths of their own;
* user functions reading ``mod_args``: a relative-position bias table (score_mod, derivative 1) and a
  document mask built from document ids, with query documents that no key belongs to (rows that see no
  key: out 0, LSE -inf);
* a prefix-LM mask, and a per-head temperature (score_mod with a derivative other than 1) after a
  softcap: the backward's chain rule through both.
"""

import dataclasses
import re

import numpy as np
import pytest

import numbaflash
from numbaflash import block_sparsity, interface, masks, reference, tiling
from numbaflash.kernels import key_tiles
from numbaflash.mods import Mods
from cases import (NP_DTYPES, Case, assert_close_as_flash_attn, check_backward, check_forward, check_gradients,
                   inputs, lse_floor, naive_forward, reference_forward)
from test_scale_and_nan import FAMILIES, forward_of

# Small enough for the simulator (a CUDA thread is a Python thread): two batch elements and two heads, so
# the functions' b and h index their tables; lengths that cross a key tile edge and leave partial tiles.
BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEADDIM = 2, 19, 23, 2, 1, 16


def relative_bias(score, b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return score + bias[h, q_idx - kv_idx + bias.shape[1] // 2]


def relative_bias_grad(score, b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return 1.0


def same_document(b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx, prefix, temperature):
    return kv_idx <= q_idx or kv_idx < prefix[b]


def tempered(score, b, h, q_idx, kv_idx, prefix, temperature):
    return score * temperature[h]


def tempered_grad(score, b, h, q_idx, kv_idx, prefix, temperature):
    return temperature[h]


def modifications(name, seqlen_q, seqlen_k, batch=BATCH, nheads=NHEADS, seed=0):
    """The keyword arguments of combination ``name``, as NumPy arrays."""
    rng = np.random.default_rng(seed)
    if name == "softcap, ALiBi":
        return dict(softcap=1.5, alibi_slopes=rng.uniform(0.05, 0.5, (batch, nheads)).astype(np.float32))
    if name == "bias table, documents":
        bias = rng.standard_normal((nheads, 2 * max(seqlen_q, seqlen_k))).astype(np.float32)  # q_idx - kv_idx + width/2
        doc_k = np.sort(rng.integers(0, 4, (batch, seqlen_k)), axis=1).astype(np.int32)
        doc_q = np.sort(rng.integers(0, 5, (batch, seqlen_q)), axis=1).astype(np.int32)  # document 4 has no keys
        return dict(score_mod=relative_bias, score_mod_grad=relative_bias_grad, mask_mod=same_document,
                    mod_args=(bias, doc_q, doc_k))
    if name == "bias table alone":  # a score_mod without a mask_mod (`kernels.gradients`' CLAMPED dK/dV step)
        bias = rng.standard_normal((nheads, 2 * max(seqlen_q, seqlen_k))).astype(np.float32)
        docs = np.zeros((batch, 1), np.int32)
        return dict(score_mod=relative_bias, score_mod_grad=relative_bias_grad, mod_args=(bias, docs, docs))
    if name == "softcap alone":  # its own forward plans (`tiling.WGMMA_SOFTCAP_TILES`)
        return dict(softcap=1.5)
    if name == "prefix LM, softcap, temperature":
        prefix = rng.integers(1, seqlen_k, batch).astype(np.int64)
        temperature = rng.uniform(0.5, 2.0, nheads).astype(np.float32)
        return dict(softcap=3.0, score_mod=tempered, score_mod_grad=tempered_grad, mask_mod=prefix_lm,
                    mod_args=(prefix, temperature))
    raise KeyError(name)


COMBINATIONS = ["softcap, ALiBi", "bias table, documents", "prefix LM, softcap, temperature"]


def case_of(name, dtype, causal=None, seed=3):
    causal = name == "softcap, ALiBi" if causal is None else causal
    return Case(BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEADDIM, dtype, causal=causal, logit_scale=2.0, seed=seed,
                modifications=modifications(name, SEQLEN_Q, SEQLEN_K, seed=seed))


# On the simulator, where a wgmma forward costs 7 s a call, v3 and v5 run one combination each: they apply
# the modifications through the same `kernels.softmax` step as mma.sync, which runs all three. A GPU runs
# every pair.
SIMULATED_WGMMA = {("wgmma v3", "prefix LM, softcap, temperature"), ("wgmma v5", "bias table, documents")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", COMBINATIONS)
def test_forward(family, name, arrays, poisoned, mode):
    if mode == "simulator" and family.startswith("wgmma") and (family, name) not in SIMULATED_WGMMA:
        pytest.skip("on the simulator this wgmma kernel runs one combination (SIMULATED_WGMMA); pytest -m gpu runs all")
    dtype, tiles = FAMILIES[family]
    case = case_of(name, dtype)
    check_forward(case, forward_of(case, tiles), *arrays)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", COMBINATIONS)
def test_backward(dtype, name, arrays, poisoned):
    """CUDA cores for float32, mma.sync for float16: the two backward families."""
    check_backward(case_of(name, dtype), numbaflash.attention, numbaflash.attention_backward, *arrays)


def test_wgmma_backward(arrays, poisoned, mode):
    """The Hopper backward (v5, the simulator's tiles) applies the modifications through the `kernels.gradients`
    steps that mma.sync, which runs all three combinations, shares; on the simulator it runs one, a GPU all."""
    for name in COMBINATIONS if mode == "gpu" else ["prefix LM, softcap, temperature"]:
        case = case_of(name, "bfloat16")
        plan = tiling.make_plan(BATCH, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, HEADDIM, "bfloat16", backward=True,
                                tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
        check_backward(case, numbaflash.attention, lambda *a, **kw: numbaflash.attention_backward(*a, plan=plan, **kw),
                       *arrays)


def test_wgmma_backward_at_headdim_128_forms_ds_with_p(arrays, poisoned):
    """At padded head dim 128 a modified dK/dV step of v5 forms dS^T in the loop that forms P^T, keeping no
    dlogit (`kernels.gradients.transposed_steps`' ``fused``): softcap with ALiBi under a causal mask (every
    score formed, the hidden ones dropped after) and a score_mod with a mask_mod (each score tested first). One batch
    element: at head dim 128 the simulated passes are the suite's slowest."""
    for name in ("softcap, ALiBi", "prefix LM, softcap, temperature"):
        case = Case(1, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, 72, "float16", causal=name == "softcap, ALiBi",
                    logit_scale=2.0, seed=5, modifications=modifications(name, SEQLEN_Q, SEQLEN_K, batch=1, seed=5))
        plan = tiling.make_plan(1, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, 72, "float16", backward=True,
                                tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
        assert plan.headdim_padded == 128
        check_backward(case, numbaflash.attention, lambda *a, **kw: numbaflash.attention_backward(*a, plan=plan, **kw),
                       *arrays)


def windowed_bias(score, b, h, q_idx, kv_idx, bias, seen):
    seen[q_idx, kv_idx] = 1  # the indices that reached the function
    return score + bias[h, q_idx - kv_idx + bias.shape[1] // 2]


def windowed_bias_grad(score, b, h, q_idx, kv_idx, bias, seen):
    seen[q_idx, kv_idx] = 1
    return 1.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("causal, window", [(True, (6, -1)), (False, (3, 2))])
def test_a_score_mod_alone_sees_only_visible_indices(family, causal, window, arrays, poisoned, mode):
    """A score_mod without a mask_mod under a causal or a two-sided window: the tensor-core dK/dV passes call it on
    every score of a tile the mask crosses without a branch, at the indices of a visible pair
    (`masks.visible_pair`), and keep the result where the score is visible. It records the (q_idx, kv_idx) it is
    called with: only visible ones may appear, forward and backward (the first 4, or 2, of 23 query rows see none
    of the 19 keys), and the gradients, computed from the forward's output and LSE, hold flash-attn's rule."""
    if mode == "simulator" and family not in ("mma", "wgmma v5"):
        pytest.skip("on the simulator mma.sync and v5 run it (their backwards share `kernels.gradients`); "
                    "pytest -m gpu runs all")
    to_device, to_host = arrays
    dtype, tiles = FAMILIES[family]
    seqlen_q, seqlen_k = 23, 19
    bias = np.random.default_rng(7).standard_normal((NHEADS, 2 * seqlen_q)).astype(np.float32)
    case = Case(1, seqlen_q, seqlen_k, NHEADS, NHEADS_KV, HEADDIM, dtype, causal=causal, window_size=window,
                logit_scale=2.0, seed=7, modifications=dict(score_mod=windowed_bias, score_mod_grad=windowed_bias_grad,
                                                            mod_args=(bias, np.zeros((seqlen_q, seqlen_k), np.int32))))
    q, k, v, dout = (to_device(x) for x in inputs(case, extra=[(1, seqlen_q, NHEADS, HEADDIM)]))
    seen = to_device(np.zeros((seqlen_q, seqlen_k), np.int32))
    options = dict(causal=causal, window_size=window, score_mod=windowed_bias, score_mod_grad=windowed_bias_grad,
                   mod_args=(to_device(bias), seen))
    out, lse = forward_of(case, tiles)(q, k, v, softmax_scale=case.scale, return_lse=True, **options)
    visible = reference.visible_mask(seqlen_q, seqlen_k, causal, window)
    assert not (to_host(seen).astype(bool) & ~visible).any(), "the forward called score_mod on a hidden pair"
    seen[...] = 0
    backward = numbaflash.attention_backward
    if family == "wgmma v5":
        plan = tiling.make_plan(1, NHEADS, NHEADS_KV, seqlen_q, seqlen_k, HEADDIM, dtype, backward=True,
                                tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
        backward = lambda *a, **kw: numbaflash.attention_backward(*a, plan=plan, **kw)  # noqa: E731
    grads = backward(dout, q, k, v, out, lse, softmax_scale=case.scale, **options)
    got = to_host(seen).astype(bool)
    assert not (got & ~visible).any(), f"the backward called score_mod on hidden pairs {np.argwhere(got & ~visible)}"
    assert got[visible].all()  # and on every visible one
    check_gradients(case, [to_host(g) for g in grads], *(to_host(x) for x in (dout, q, k, v)), to_host(lse))


# A built-in modification alone takes a path of its own in the tensor-core forwards (`kernels.softmax`).
ALONE = {
    # softcap's scores kept as tanh(x / softcap), the cap folded into the softmax's scale
    # (`numbaflash.mods.Mods.softcap_alone`), part or all of the exponentials on the FMA pipe in exp2_fma tiles
    "softcap, causal": (SEQLEN_Q, SEQLEN_K, True, dict(softcap=1.5)),
    # ALiBi on tiles wholly on one side of a warp's diagonal as a row term plus a constant times the slope: at
    # 40 x 70 a warp's 16 rows have 16-key tiles below, across and above theirs
    "ALiBi, 40 x 70": (40, 70, False, dict(alibi_slopes=np.array([0.3, 0.05], np.float32))),
}


# On the simulator mma.sync (forward and backward) and one v5 forward take these paths: the other tensor-core
# forwards share `kernels.softmax`, the v5 backward `kernels.gradients`, with mma.sync. A GPU runs every family.
SIMULATED_ALONE = ("mma", "wgmma v5, ex2 on FMA")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ALONE)
def test_a_built_in_modification_alone(family, name, arrays, poisoned, mode):
    """Forward in every family, then the backward from its LSE in both tensor-core families (the backward's steps
    take ALiBi alone's one-sided path too, `gradients.alibi_side`)."""
    if mode == "simulator" and family not in SIMULATED_ALONE:
        pytest.skip("on the simulator mma.sync and one v5 forward run it (SIMULATED_ALONE); pytest -m gpu runs all")
    dtype, tiles = FAMILIES[family]
    seqlen_q, seqlen_k, causal, modifications = ALONE[name]
    case = Case(BATCH, seqlen_q, seqlen_k, NHEADS, NHEADS_KV, HEADDIM, dtype, causal=causal, logit_scale=2.0, seed=6,
                modifications=modifications)
    check_forward(case, forward_of(case, tiles), *arrays)
    if family == "mma":
        check_backward(case, numbaflash.attention, numbaflash.attention_backward, *arrays)
    if family == "wgmma v5":
        plan = tiling.make_plan(BATCH, NHEADS, NHEADS_KV, seqlen_q, seqlen_k, HEADDIM, dtype, backward=True,
                                tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
        check_backward(case, numbaflash.attention, lambda *a, **kw: numbaflash.attention_backward(*a, plan=plan, **kw),
                       *arrays)


# ALiBi alone's column term from the tensor cores (`wgmma.alibi_columns`): 150 queries over 40 keys in 16-key tiles
# give a 128-row block's two warpgroups tiles right of and across their diagonals and the next block's tiles left
# of and across its own; a slope 2^64 times the scale takes every tile's bias per score in natural units
# (`kernels.mods.alibi_columns_units`), beside a head whose column term is 2^60 per key in units of the scale; a
# negative scale turns the row terms with the scores, and a zero one takes natural units.
ALIBI_COLUMNS_TILES = tiling.WgmmaTiles(128, 16, 2, producer=True, tma=True, pingpong=True, alibi_columns=True)
ALIBI_COLUMNS_CASES = {
    "150 x 40": dict(seqlen_q=150, seqlen_k=40, slopes=[[0.3, 0.05], [1.0, 0.01]]),
    "causal, 90 x 120": dict(seqlen_q=90, seqlen_k=120, slopes=[[0.3, 0.05]], causal=True),
    "slope 2^64 times the scale": dict(seqlen_q=70, seqlen_k=90, slopes=[[1.0, 0.01]], softmax_scale=1e-20),
    "negative scale": dict(seqlen_q=70, seqlen_k=90, slopes=[[0.3, 0.05]], softmax_scale=-0.3),
    "zero scale": dict(seqlen_q=70, seqlen_k=90, slopes=[[0.3, 0.05]], softmax_scale=0.0),
}


@pytest.mark.parametrize("name", ALIBI_COLUMNS_CASES)
def test_alibi_columns_from_the_tensor_cores(name, arrays, poisoned):
    """v5's forward with ALiBi's column term from one more wgmma k-step against the reference, the warpgroups of
    a block on different sides of their diagonals."""
    spec = dict(ALIBI_COLUMNS_CASES[name])
    slopes = np.array(spec.pop("slopes"), np.float32)
    case = Case(slopes.shape[0], spec.pop("seqlen_q"), spec.pop("seqlen_k"), 2, 1, HEADDIM, "float16", logit_scale=2.0,
                seed=11, modifications=dict(alibi_slopes=slopes), **spec)
    plan = tiling.make_plan(case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim,
                            case.dtype, tiles=ALIBI_COLUMNS_TILES)
    check_forward(case, lambda *a, **kw: numbaflash.attention(*a, plan=plan, **kw), *arrays)


# The softmax's row sums from the tensor cores (`wgmma.row_sums`; v5's plans for softcap and ALiBi alone at 64 when the
# LSE is not asked for): softcap over keys that grow along the sequence, so rows' maxima move past
# `kernels.softmax.RESCALE_LOG2` after their first tiles and the sums are rescaled with O, causal with more queries than
# keys, so the first rows see no key (a sum of exactly 0, out 0); ALiBi with its column term, in bfloat16.
ROW_SUMS_CASES = {
    "softcap, causal, growing keys": (Case(1, 90, 70, 2, 1, HEADDIM, "float16", causal=True, logit_scale=8.0, seed=12,
                                           modifications=dict(softcap=30.0)),
                                      tiling.WgmmaTiles(128, 16, 2, producer=True, tma=True, pingpong=True, exp2_fma=1,
                                                        row_sums=True)),
    "ALiBi columns, causal": (Case(1, 90, 120, 2, 1, HEADDIM, "bfloat16", causal=True, logit_scale=2.0, seed=11,
                                   modifications=dict(alibi_slopes=np.array([[0.3, 0.05]], np.float32))),
                              dataclasses.replace(ALIBI_COLUMNS_TILES, row_sums=True)),
}


def growing_keys(case):
    """`cases.inputs` with key j scaled by 1 + 3 j / seqlen_k."""
    q, k, v = inputs(case)
    growth = 1 + 3 * np.arange(case.seqlen_k) / case.seqlen_k
    return q, (k * growth[None, :, None, None]).astype(k.dtype), v


@pytest.mark.parametrize("name", ROW_SUMS_CASES)
def test_row_sums_from_the_tensor_cores(name, arrays, poisoned):
    """v5's forward whose tensor cores sum P beside P V, its out against the reference (the LSE, which they do not
    give exactly, is not returned): the sums scaled with O where a row's maximum moves, rows that see no key."""
    to_device, to_host = arrays
    case, tiles = ROW_SUMS_CASES[name]
    q, k, v = growing_keys(case) if "growing" in name else inputs(case)
    if "growing" in name:
        logits = 30.0 * np.tanh(np.einsum("bqhd,bkd->bhqk", q[:, :, :1].astype(np.float64),
                                          k[:, :, 0].astype(np.float64))[:, 0] * case.scale / 30.0)
        visible = reference.visible_mask(case.seqlen_q, case.seqlen_k, causal=True)
        first_tile = np.where(visible[:, :tiles.block_n], logits[0, :, :tiles.block_n], -np.inf).max(axis=1)
        with np.errstate(invalid="ignore"):  # rows that see no key in the first tile: -inf - -inf
            moved = np.where(visible, logits[0], -np.inf).max(axis=1) - first_tile
        assert (moved[np.isfinite(moved)] > 8 * np.log(2)).any()  # some row's maximum moves past the threshold
    plan = tiling.make_plan(case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim,
                            case.dtype, tiles=tiles, lse=False)
    out = to_host(numbaflash.attention(*(to_device(x) for x in (q, k, v)), softmax_scale=case.scale, plan=plan,
                                       **case.options(to_device)))
    assert_close_as_flash_attn("out", out, naive_forward(q, k, v, case)[0], reference_forward(q, k, v, case)[0],
                               case.dtype, case)


# softcap's bound for every row's maximum (`tiling.fixed_maximum`: v5's plans for bfloat16 softcap alone with
# softcap * log2(e) <= 52): keys that grow along the sequence, where running maxima would move past
# `kernels.softmax.RESCALE_LOG2`, causal with more queries than keys (rows that see no key: LSE -inf); softcap at the
# limit over scores past it; every score at -softcap there (each P near its smallest, 2^-96); with the tensor cores' row
# sums (no LSE); a NaN in q.
BOUNDED_TILES = tiling.WgmmaTiles(128, 16, 2, producer=True, tma=True, pingpong=True, bounded_max=True)
BOUNDED_CASES = {
    "causal, growing keys": Case(1, 90, 70, 2, 1, HEADDIM, "bfloat16", causal=True, logit_scale=8.0, seed=12,
                                 modifications=dict(softcap=30.0)),
    "softcap at the limit": Case(1, 40, 80, 2, 1, HEADDIM, "bfloat16", logit_scale=64.0, seed=13,
                                 modifications=dict(softcap=36.0)),
    "every score at -softcap": Case(1, 40, 80, 2, 1, HEADDIM, "bfloat16", logit_scale=64.0, seed=14,
                                    modifications=dict(softcap=36.0)),
    "row sums, no LSE": Case(1, 90, 70, 2, 1, HEADDIM, "bfloat16", causal=True, logit_scale=8.0, seed=15,
                             modifications=dict(softcap=30.0)),
    "NaN in q": Case(1, 40, 80, 2, 1, HEADDIM, "bfloat16", seed=16, modifications=dict(softcap=30.0)),
}


@pytest.mark.parametrize("name", BOUNDED_CASES)
def test_softcap_bound_as_every_rows_maximum(name, arrays, poisoned):
    """v5's forward with softcap's bound for each row's maximum, out and LSE against the reference under flash-attn's
    rule (out alone with the row sums; NaN in the rows that see a NaN, as the reference)."""
    to_device, to_host = arrays
    case = BOUNDED_CASES[name]
    q, k, v = growing_keys(case) if "growing" in name else inputs(case)
    if "-softcap" in name:
        q, k = np.abs(q), -np.abs(k)
    if "NaN" in name:
        q[0, 5, 1, 3] = np.nan
    tiles = dataclasses.replace(BOUNDED_TILES, row_sums="row sums" in name)
    plan = tiling.make_plan(case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim,
                            case.dtype, tiles=tiles, lse=not tiles.row_sums)
    got = numbaflash.attention(*(to_device(x) for x in (q, k, v)), softmax_scale=case.scale, plan=plan,
                               return_lse=not tiles.row_sums, **case.options(to_device))
    out, lse = (to_host(got), None) if tiles.row_sums else (to_host(x) for x in got)
    want, want_lse = reference_forward(q, k, v, case)
    naive_out, naive_lse = naive_forward(q, k, v, case)
    if "NaN" in name:  # NaN exactly in the rows that see it; the rule on the rest
        rows = np.isnan(want).any(axis=-1)  # (batch, seqlen_q, nheads)
        assert rows.any() and np.array_equal(np.isnan(out).any(axis=-1), rows)
        assert np.array_equal(np.isnan(lse), rows.transpose(0, 2, 1))
        out, want, naive_out = (np.where(rows[..., None], 0, x) for x in (out, want, naive_out))
        lse, want_lse, naive_lse = (np.where(rows.transpose(0, 2, 1), 0, x) for x in (lse, want_lse, naive_lse))
    assert_close_as_flash_attn("out", out, naive_out, want, case.dtype, case)
    if lse is not None:  # the floor over the scores without the NaN
        assert_close_as_flash_attn("lse", lse, naive_lse, want_lse, "float32", case,
                                   floor=lse_floor(np.nan_to_num(q.astype(np.float32)), k, want_lse, "float32", case))


def test_the_softmax_and_the_kernel_find_the_same_side_of_the_diagonal():
    """v5's kernel picks a tile's column term by `kernels.mods.alibi_side` of its warpgroup's rows, each warp's
    softmax by `kernels.mods.alibi_columns_side` of a float offset from its own rows: both agree, at the edges of
    the three sides and past 2^24, where the offset rounds."""
    from numbaflash.kernels import mods as kernel_mods

    rng = np.random.default_rng(5)
    for _ in range(4000):
        block_n = int(rng.choice([16, 96, 128]))
        seqlen_q, seqlen_k = (int(x) for x in rng.integers(1, 2 ** int(rng.choice([8, 26, 31])), 2))
        wg_row = int(rng.integers(0, seqlen_q)) // 64 * 64
        diagonal = wg_row + seqlen_k - seqlen_q
        n_start = max(0, diagonal + int(rng.integers(-2 * block_n, 2 * block_n)) if rng.random() < 0.8
                      else int(rng.integers(0, seqlen_k)))
        warp = 16 * int(rng.integers(0, 4))
        offset = kernel_mods.alibi_columns_offset(wg_row + warp, n_start, seqlen_q, seqlen_k)
        side = kernel_mods.alibi_columns_side(np.float32(offset + np.float32(warp)), block_n)
        assert side == kernel_mods.alibi_side(wg_row, wg_row + 64, n_start, n_start + block_n, seqlen_q - seqlen_k), (
            wg_row, warp, n_start, seqlen_q, seqlen_k, block_n)


@pytest.mark.parametrize("seqlen_q, seqlen_k, block_m, block_n, causal, window", [
    (40, 70, 64, 16, False, (-1, -1)), (16384, 16384, 192, 96, False, (-1, -1)), (1000, 300, 128, 128, True, (-1, -1)),
    (300, 1000, 64, 16, False, (50, 20))])
def test_alibi_blocks_visit_each_key_tile_once_from_their_diagonal(seqlen_q, seqlen_k, block_m, block_n, causal,
                                                                    window):
    """`key_tiles.tile_order` with ALiBi: a forward block visits each of its key tiles once, first those wholly left
    of its first row's diagonal from the nearest leftward, then the rest in ascending order (the diagonal's, then
    those right of it); without ALiBi, with a block mask or packed sequences, in ascending order."""
    left, right = (window[0], 0) if causal else window
    count, _, _ = key_tiles.key_tiles(Mods(), block_m, block_n)
    orders = {name: key_tiles.tile_order(mods, block_m, block_n) for name, mods in
              (("ALiBi", Mods(alibi=True)), ("plain", Mods()), ("packed", Mods(alibi=True, packed=True)))}
    rotated = 0
    for row_start in range(0, seqlen_q, block_m):
        lo, hi = masks.block_key_range(row_start, min(row_start + block_m, seqlen_q), seqlen_q, seqlen_k, left, right)
        n_base, ntiles = (lo // block_n) * block_n, count(None, 0, 0, row_start, lo, hi)
        visits = [orders["ALiBi"](it, row_start, n_base, ntiles, seqlen_q, seqlen_k) for it in range(ntiles)]
        assert sorted(visits) == list(range(ntiles)), (row_start, visits)
        diagonal = row_start + seqlen_k - seqlen_q  # the first row's
        before = [tile for tile in range(ntiles) if n_base + (tile + 1) * block_n <= diagonal]
        assert visits == before[::-1] + list(range(len(before), ntiles)), (row_start, visits)
        rotated += bool(before)
        for name in ("plain", "packed"):
            assert [orders[name](it, row_start, n_base, ntiles, seqlen_q, seqlen_k) for it in range(ntiles)] == list(
                range(ntiles))
    assert rotated


def test_full_tiles_modify_every_score_without_masking(arrays, poisoned):
    """Tiles that the mask leaves whole take the tensor-core forwards' branch-free path (`kernels.softmax.mask`):
    no causal mask, no mask_mod, rows that fill whole warps; the last key tile is partial."""
    rng = np.random.default_rng(4)
    bias = rng.standard_normal((1, 2 * 64)).astype(np.float32)
    modifications = dict(softcap=2.0, alibi_slopes=np.array([0.3], np.float32), score_mod=relative_bias,
                         score_mod_grad=relative_bias_grad, mod_args=(bias, bias, bias))
    case = Case(1, 64, 40, 1, 1, 16, "float16", logit_scale=2.0, seed=4, modifications=modifications)
    dtype, tiles = FAMILIES["mma"]
    check_forward(case, forward_of(case, tiles), *arrays)


# At real sizes every family, with the production tiles: (dtype, head dim, forward tiles).
GPU_FAMILIES = {
    "simt": ("float32", 64, None),
    "mma": ("float16", 64, tiling.MMA_TILES[64]),
    "wgmma v3": ("float16", 128, tiling.WGMMA_CP_ASYNC_TILES[128]),
    "wgmma v5": ("bfloat16", 64, tiling.WGMMA_USER_FUNCTION_TILES[64]),
    "wgmma v5 (d128)": ("float16", 128, tiling.WGMMA_TILES[128]),
    "wgmma v5 (d256)": ("bfloat16", 256, tiling.WGMMA_TILES[256]),
    "wgmma v5 (3 consumers)": ("bfloat16", 64, tiling.WGMMA_TILES[64]),
    "wgmma v5 (d128, scores ahead)": ("float16", 128, tiling.WGMMA_SOFTCAP_TILES[128]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", GPU_FAMILIES)
@pytest.mark.parametrize("name", COMBINATIONS)
def test_forward_and_backward_at_real_sizes(family, name, arrays, poisoned):
    """Odd lengths over many tiles; the backward with its default plan (CUDA cores for float32; 16-bit: wgmma
    v5 on Hopper, mma.sync before) after one forward of each head dim and dtype it plans differently."""
    dtype, headdim, tiles = GPU_FAMILIES[family]
    seqlen_q, seqlen_k = 1000, 1537
    case = Case(2, seqlen_q, seqlen_k, 2, 1, headdim, dtype, causal=name == "softcap, ALiBi", seed=9,
                modifications=modifications(name, seqlen_q, seqlen_k, seed=9))
    check_forward(case, forward_of(case, tiles), *arrays)
    if family in ("simt", "mma", "wgmma v5 (d128)"):
        check_backward(case, numbaflash.attention, numbaflash.attention_backward, *arrays)


def test_alibi_slopes_per_head_match_the_same_slopes_per_batch_element(arrays):
    to_device, to_host = arrays
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 9, 2, 16)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.25, 0.5], np.float32)
    run = lambda s: to_host(numbaflash.attention(*(to_device(x) for x in (q, k, v)), alibi_slopes=to_device(s)))
    assert np.array_equal(run(slopes), run(np.stack([slopes, slopes])))


def visible_before(b, h, q_idx, kv_idx, limit):
    return kv_idx < limit[b]


def test_a_repeated_layout_runs_on_its_own_arrays(arrays):
    """A call of a layout checked before (`call_cache`) passes its own slopes and mod_args to the kernel, not
    those of the call that was remembered, and the remembered call keeps none of them."""
    from numbaflash import call_cache

    to_device, to_host = arrays
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 9, 2, 16)).astype(np.float32) for _ in range(3))
    device = [to_device(x) for x in (q, k, v)]
    for options in (dict(alibi_slopes=np.array([0.25, 0.5], np.float32)), dict(alibi_slopes=np.array([2.0, 0.0], np.float32)),
                    dict(mask_mod=visible_before, mod_args=(np.array([3, 9]),)),
                    dict(mask_mod=visible_before, mod_args=(np.array([7, 1]),))):
        given = {key: (to_device(x) if key == "alibi_slopes" else tuple(map(to_device, x)) if key == "mod_args" else x)
                 for key, x in options.items()}
        got = to_host(numbaflash.attention(*device, **given))
        want, _ = reference.attention_forward(q, k, v, **options)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    from numbaflash import _arrays

    kept = [entry.mod_values for entry in call_cache._CALLS.values() if entry.mods.alibi or entry.mods.mask_mod]
    assert kept and not any(isinstance(value, _arrays.Operand) for values in kept for value in values or ())


def test_a_mask_mod_that_is_causal_gives_causal_attention(arrays):
    to_device, to_host = arrays
    rng = np.random.default_rng(2)
    q, k, v = (to_device(rng.standard_normal((1, 21, 1, 16)).astype(np.float32)) for _ in range(3))
    built_in = to_host(numbaflash.attention(q, k, v, causal=True))
    user = to_host(numbaflash.attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i))
    np.testing.assert_allclose(user, built_in, rtol=0, atol=1e-6)


# -- the boundary

Q = np.zeros((1, 8, 2, 16), np.float32)


def score_plus_one(score, b, h, q_idx, kv_idx):
    return score + 1


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="2"), TypeError, "softcap must be a number"),
    (dict(softcap=1e-39), ValueError, r"softcap must be 0 \(off\) or between 1.175e-38 and 2.359e\+38 for float32"),
    (dict(softcap=2.4e38), ValueError, r"softcap must be 0 \(off\) or between .* got 2.4e\+38"),
    (dict(softcap=1e-30, softmax_scale=1e10), ValueError, r"between 2.939e-29 and .* softmax_scale / softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must be float32 of shape \(nheads,\)"),
    (dict(alibi_slopes=np.ones(2, np.float64)), ValueError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=[0.5, 0.5]), TypeError, "alibi_slopes must be an array of the same kind as q"),
    (dict(score_mod="tanh"), TypeError, "score_mod must be None or a plain Python function"),
    (dict(score_mod=lambda s, b, h: s), ValueError, "score_mod .* must take 5 positional arguments"),
    (dict(mask_mod=lambda b, h, i, j, extra: True), ValueError, "mask_mod .* must take 4 positional arguments"),
    (dict(score_mod_grad=lambda s, b, h, i, j: 1.0), ValueError, "score_mod_grad was given without score_mod"),
    (dict(mod_args=(np.ones(3),)), ValueError, "no score_mod or mask_mod reads them"),
    (dict(mask_mod=lambda b, h, i, j, x: True, mod_args=np.ones(3)), TypeError, "mod_args must be a tuple"),
    (dict(mask_mod=lambda b, h, i, j, x: True, mod_args=(np.ones(3, np.float16),)), TypeError,
     r"mod_args\[0\] must be an array of integers, bools, float32 or float64"),
    (dict(mask_mod=lambda b, h, i, j: i), TypeError, "mask_mod .* must return a bool"),
    (dict(score_mod=lambda s, b, h, i, j: s.upper()), TypeError, "score_mod .* cannot be compiled by Numba"),
])
def test_bad_modifications_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        numbaflash.attention(Q, Q, Q, **kwargs)


def test_the_backward_through_a_score_mod_needs_its_derivative():
    with pytest.raises(ValueError, match="needs score_mod_grad"):
        numbaflash.attention_backward(Q, Q, Q, Q, Q, np.zeros((1, 2, 8), np.float32), score_mod=score_plus_one)


def test_a_compile_error_names_the_function_and_its_line():
    def broken(score, b, h, q_idx, kv_idx):
        return score + score.no_such_method()

    with pytest.raises(TypeError, match=r"broken \(.*test_mods.py:\d+\) cannot be compiled"):
        numbaflash.attention(Q, Q, Q, score_mod=broken)


# -- block masks

# Block masks' tiles at headdim 64: two blocks of one consumer per multiprocessor, their registers shared out as
# such (`wgmma.pipeline.register_moves`); on a GPU the plans' own (`tiling.WGMMA_BLOCK_SPARSE_TILES` and
# `WGMMA_BLOCK_SPARSE_BACKWARD_TILES`), on the simulator its smallest.
SHARED = "wgmma v5, two blocks per multiprocessor"


def shared_tiles(mode, backward=False):
    if mode == "gpu":
        return (tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES if backward else tiling.WGMMA_BLOCK_SPARSE_TILES)[64]
    return tiling.WgmmaTiles(64, 16, 1, producer=True, tma=True, blocks_per_sm=2)


def forward_block_families(mode):
    """The forward families a block mask runs in: `FAMILIES`, the shared blocks, and on a GPU the dense plan's tiles
    (three consumers taking turns), which a block mask whose blocks visit many tiles plans
    (`tiling.WGMMA_BLOCK_SPARSE_DENSE_VISITS`); on the simulator those are v5's one warpgroup."""
    families = dict(FAMILIES, **{SHARED: ("float16", shared_tiles(mode))})
    return dict(families, **{"wgmma v5, the dense plan's tiles": ("float16", tiling.WGMMA_TILES[64])}) \
        if mode == "gpu" else families


def test_a_block_mask_gives_the_dense_mask_mod_result(arrays, mode):
    """Documents of a packed sequence, causal inside each: the forward with the block mask visits only the
    non-empty tiles, skips mask_mod on full ones and reads its verdicts on partial ones from the block mask's
    bits, and gives the dense mask_mod call's result in every forward family, bit for bit: the dense call's
    visits to empty tiles leave its maxima, sums and outputs as they were (the tensor-core kernels' maxima move
    only past `kernels.softmax.RESCALE_LOG2`; before that, such a visit rescaled them by ex2 of a product's
    rounding error on a GPU, 1 - 2^-24)."""
    seqlen = 40 if mode == "simulator" else 2048
    doc = np.repeat(np.arange(4), [6, 20, 3, seqlen - 29]).astype(np.int32)[None]  # (1, seqlen)
    bm = numbaflash.block_mask(same_document_causal, None, None, seqlen, seqlen, mod_args=(doc,))
    assert 0 < bm.density(16, 16) < 1
    assert_forward_as_dense(bm, same_document_causal, doc, 8, arrays, mode)


def assert_forward_as_dense(bm, mask_mod, doc, seed, arrays, mode, **window):
    """Every forward family (`forward_block_families`) gives with block mask ``bm`` the dense ``mask_mod`` call's
    result bit for bit, ``doc`` its mod_args, under the causal/window mask ``window``."""
    to_device, to_host = arrays
    seqlen = doc.shape[1]
    for family, (dtype, tiles) in forward_block_families(mode).items():
        case = Case(1, seqlen, seqlen, 1, 1, 16, dtype, seed=seed)
        q, k, v = (to_device(x) for x in inputs(case))
        forward = forward_of(case, tiles)
        dense = to_host(forward(q, k, v, mask_mod=mask_mod, mod_args=(to_device(doc),), **window))
        sparse = to_host(forward(q, k, v, block_mask=bm, mod_args=(to_device(doc),), **window))
        assert np.array_equal(dense.view(np.uint8), sparse.view(np.uint8)), (
            family, np.abs(dense.astype(np.float64) - sparse).max())


def shown_everywhere(b, h, q_idx, kv_idx, doc):
    return True


def same_document_only(b, h, q_idx, kv_idx, doc):
    return doc[0, q_idx] == doc[0, kv_idx]


def two_documents(mode):
    """``(doc, block mask)`` of two documents without causality (`same_document_only`), the first longer than a 64-row
    block: such blocks have tiles full to the mask_mod on the simulator too."""
    seqlen, first = (80, 66) if mode == "simulator" else (2048, 1027)
    doc = np.repeat(np.arange(2), [first, seqlen - first]).astype(np.int32)[None]
    return doc, numbaflash.block_mask(same_document_only, None, None, seqlen, seqlen, mod_args=(doc,))


@pytest.mark.parametrize("window", [dict(causal=True), dict(window_size=(9, 3))])
def test_a_block_mask_under_a_causal_or_window_mask_gives_the_dense_result(window, arrays, mode):
    """Two documents without causality under the call's causal or window mask: tiles full to the mask_mod that the
    window crosses are masked (their bits hold the window, `BlockMask.key_tiles`), so every forward family gives
    the dense mask_mod call's result bit for bit, as in `test_a_block_mask_gives_the_dense_mask_mod_result`."""
    doc, bm = two_documents(mode)
    assert (bm.classify(64, 16) == block_sparsity.FULL).any()
    assert_forward_as_dense(bm, same_document_only, doc, 9, arrays, mode, **window)


@pytest.mark.parametrize("shown", ["same document, causal", "everywhere"])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (5, 2)])
def test_the_bits_of_partial_tiles_are_the_mask_where_the_window_shows_it(left, right, shown):
    """`BlockMask.key_tiles` and `query_tiles`: every partial tile a block visits has a slot, and its bits are
    mask_mod's verdicts on the scores the causal/window mask shows (0 elsewhere, where mask_mod is never asked); a
    full tile, one whose every score mask_mod and the causal/window mask show inside the sequences, has slot -1 (a
    tile full to mask_mod alone that the window crosses takes a slot: no kernel masks anything on a full tile). 24
    keys per tile: a row's verdicts end inside its word."""
    seqlen_q, seqlen_k, rows, cols = 45, 50, 16, 24
    doc = np.repeat(np.arange(3), [7, 30, 13])[None].astype(np.int32)
    mask_mod = shown_everywhere if shown == "everywhere" else same_document_causal
    bm = numbaflash.block_mask(mask_mod, None, None, seqlen_q, seqlen_k, mod_args=(doc,))
    like = numbaflash._arrays.Operand(doc, "numpy", doc.shape, doc.strides, "int32", -1, 0)
    table, bits = (x.obj for x in bm.key_tiles(rows, cols, left, right, like))
    # The kernels index both as C-contiguous arrays (`kernels.mods.kernel_type`), a dK/dV pass's pair too; the
    # forwards' and dQ pass's partial tiles read only the bits, so the causal/window mask must be in them.
    queries = [x.obj for x in bm.query_tiles(cols, rows, left, right, 1, like)]
    assert all(x.flags.c_contiguous for x in [table, bits] + queries)
    want = reference.visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(left, right)) & \
        numbaflash.mods.visible(mask_mod, (1, 1, seqlen_q, seqlen_k), (doc,))[0, 0]
    partial = bm.classify(rows, cols)[0, 0] == block_sparsity.PARTIAL

    def tile(qt, kt):
        return want[qt * rows:(qt + 1) * rows, kt * cols:(kt + 1) * cols]

    def whole(qt, kt):
        return tile(qt, kt).shape == (rows, cols) and tile(qt, kt).all()

    if shown == "everywhere" and (left, right) != (-1, -1):  # tiles full to mask_mod that the window crosses
        assert any(not partial[qt, kt] and tile(qt, kt).any() and not whole(qt, kt) for qt, kt in np.ndindex(
            partial.shape))
    assert_bits_match(table, bits, lambda qt, kt: (not whole(qt, kt), tile(qt, kt)))
    # The dK/dV pass's: blocks of `cols` keys streaming tiles of `rows` query rows, the same verdicts transposed
    # (a row of bits per key, a bit per query row).
    assert_bits_match(*queries, lambda kt, qt: (not whole(qt, kt), tile(qt, kt).T))


def assert_bits_match(table, bits, expected):
    """Each visit of a block-mask ``table`` (`BlockMask.key_tiles` or `query_tiles`, one head) has a slot exactly
    when ``expected(block, visited tile)`` says its tile is partial, and that slot's ``bits`` are the verdicts
    ``expected`` gives for it (rows x columns); every slot is used."""
    slots = 0
    half = table.shape[3] // 2
    for block in range(table.shape[2]):
        count = table[0, 0, block, 0]
        for entry, slot in zip(table[0, 0, block, 1:1 + count], table[0, 0, block, half + 1:half + 1 + count]):
            partial, verdicts = expected(block, entry >> 1)
            assert (slot >= 0) == partial, (block, entry >> 1)
            if slot >= 0:
                slots += 1
                got = (bits[slot].view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1  # (rows, words, 32)
                got = got.reshape(bits.shape[1], -1)[:verdicts.shape[0], :verdicts.shape[1]].astype(bool)
                assert np.array_equal(got, verdicts), (block, entry >> 1)
    assert slots == len(bits) > 0


def test_a_single_partial_tile_of_whole_words_transposes_its_bits():
    """The dK/dV pass's bits of one partial 32 x 32 tile (no padding word: the packing must not see the
    transposed view's strides, which NumPy keeps through np.pad for a leading axis of 1)."""
    bm = numbaflash.block_mask(lambda b, h, i, j: not (i == 3 and j == 5), None, None, 32, 32)
    like = numbaflash._arrays.Operand(np.zeros(1, np.int32), "numpy", (1,), (4,), "int32", -1, 0)
    table, bits = (x.obj for x in bm.query_tiles(32, 32, -1, -1, 1, like))
    assert bits.shape == (1, 32, 1) and bits.flags.c_contiguous and table[0, 0, 0, 3] == 0  # one visit: its slot
    want = np.full(32, 0xFFFFFFFF, np.uint32)
    want[5] &= ~np.uint32(1 << 3)  # key 5 hides query row 3
    assert np.array_equal(bits[0, :, 0].view(np.uint32), want)


def same_document_per_head(b, h, q_idx, kv_idx, doc):
    return doc[h, q_idx] == doc[h, kv_idx]


# The backward of each family on the simulator's tiles (keys per dK/dV block x rows streamed), and
# deterministic=False's atomic dQ on v5's smallest tiles that stream 64 rows.
BACKWARD_FAMILIES = {
    "simt": ("float32", None, True),
    "mma": ("float16", tiling.SIMULATOR_MMA_BACKWARD_TILES, True),
    "wgmma v3": ("float16", tiling.WGMMA_CP_ASYNC_BACKWARD_TILES[64], True),
    "wgmma v5": ("float16", tiling.SIMULATOR_WGMMA_BACKWARD_TILES, True),
    "wgmma v5 atomic dQ": ("bfloat16", tiling.WgmmaTiles(64, 64, 1, producer=True, tma=True), False),
    SHARED: ("float16", None, True),  # `shared_tiles`
}


@pytest.mark.parametrize("family", BACKWARD_FAMILIES)
def test_a_block_masked_backward_skips_empty_tiles_in_both_passes(family, arrays, mode, poisoned):
    """Documents without causality, other ones per head, GQA: both passes of the backward visit only the block
    mask's non-empty tiles, in each head's own order, and skip mask_mod on full ones (64-key blocks inside one
    document; the dQ pass reads its verdicts on partial ones from the block mask's bits), held to the
    reference rule. On a GPU also: empty tiles add exact zeros, so the gradients equal
    the dense mask_mod call's bit for bit (the atomic dQ, which sums in a varying order, to an ulp)."""
    dtype, tiles, deterministic = BACKWARD_FAMILIES[family]
    tiles = shared_tiles(mode, backward=True) if family == SHARED else tiles
    seqlen = 80 if mode == "simulator" else 2048
    doc = np.stack([np.repeat(np.arange(2), [64, seqlen - 64]),
                    np.repeat(np.arange(3), [16, 48, seqlen - 64])]).astype(np.int32)  # (nheads, seqlen)
    bm = numbaflash.block_mask(same_document_per_head, None, 2, seqlen, seqlen, mod_args=(doc,))
    case = Case(1, seqlen, seqlen, 2, 1, 16, dtype, seed=9,
                modifications=dict(mask_mod=same_document_per_head, mod_args=(doc,)))
    plan = tiling.make_plan(1, 2, 1, seqlen, seqlen, 16, dtype, backward=True, tiles=tiles, deterministic=deterministic)
    assert {block_sparsity.EMPTY, block_sparsity.FULL} <= set(np.unique(bm.classify(plan.block_n, plan.block_m)))
    assert_backward_as_dense(family, case, bm, plan, deterministic, arrays, mode)


def assert_backward_as_dense(family, case, bm, plan, deterministic, arrays, mode):
    """The block-masked backward of ``case`` (its mask_mod and mod_args, ``doc``, and its causal/window mask) held to
    the reference rule, and on a GPU equal to the dense mask_mod call's gradients: empty tiles add exact zeros (the
    atomic dQ, which sums in a varying order, to an ulp)."""
    to_device, to_host = arrays
    mask_mod, (doc,) = case.modifications["mask_mod"], case.modifications["mod_args"]
    q, k, v, dout = inputs(case, extra=[(case.batch, case.seqlen_q, case.nheads, case.headdim)])
    out, lse = reference.attention_forward(q, k, v, mask_mod=mask_mod, mod_args=(doc,), **case.mask)
    lse = lse.astype(np.float32)
    args = [to_device(x) for x in (dout, q, k, v, out.astype(q.dtype), lse)]
    options = [dict(block_mask=bm)] + ([dict(mask_mod=mask_mod)] if mode == "gpu" else [])
    sparse, *dense = ([to_host(g) for g in numbaflash.attention_backward(
        *args, plan=plan, deterministic=deterministic, mod_args=(to_device(doc),), **case.mask, **kwargs)]
        for kwargs in options)
    check_gradients(case, sparse, dout, q, k, v, lse)
    for grads in dense:
        for name, s, d in zip(("dq", "dk", "dv"), sparse, grads):
            if deterministic or name != "dq":
                assert np.array_equal(d.view(np.uint8), s.view(np.uint8)), (family, name)
            else:
                np.testing.assert_allclose(s.astype(np.float32), d.astype(np.float32), rtol=2 ** -7, atol=2 ** -12)


@pytest.mark.parametrize("window", [dict(causal=True), dict(window_size=(9, 3))])
@pytest.mark.parametrize("family", BACKWARD_FAMILIES)
def test_a_block_masked_backward_under_a_causal_or_window_mask_gives_the_dense_result(family, window, arrays, mode):
    """Both passes of the backward under the call's causal or window mask, with tiles full to the mask_mod (two
    documents without causality) that the window crosses: their schedules mark them partial (`BlockMask.unmasked`),
    so the passes, which test nothing on a full tile, mask them; held to the reference rule, and on a GPU equal to
    the dense mask_mod call's gradients (`test_a_block_masked_backward_skips_empty_tiles_in_both_passes`)."""
    dtype, tiles, deterministic = BACKWARD_FAMILIES[family]
    tiles = shared_tiles(mode, backward=True) if family == SHARED else tiles
    doc, bm = two_documents(mode)
    seqlen = doc.shape[1]
    case = Case(1, seqlen, seqlen, 1, 1, 16, dtype, seed=9, **window,
                modifications=dict(mask_mod=same_document_only, mod_args=(doc,)))
    plan = tiling.make_plan(1, 1, 1, seqlen, seqlen, 16, dtype, backward=True, tiles=tiles, deterministic=deterministic)
    left, right = masks.normalize_window(window.get("causal", False), window.get("window_size", (-1, -1)))
    for rows, cols in [(plan.block_m, plan.block_n), (plan.block_n, plan.block_m)]:  # the dQ pass's, the dK/dV's
        assert ((bm.classify(rows, cols) == block_sparsity.FULL) & ~bm.unmasked(rows, cols, left, right)).any()
    assert_backward_as_dense(family, case, bm, plan, deterministic, arrays, mode)


def documents_with_other_ids(seqlen):
    """(doc, one, block mask): three documents, ids of one, and the block mask of the three, causal inside each."""
    doc = np.repeat(np.arange(3), [6, 20, seqlen - 26]).astype(np.int32)[None]  # (1, seqlen)
    return doc, np.zeros_like(doc), numbaflash.block_mask(same_document_causal, None, None, seqlen, seqlen,
                                                           mod_args=(doc,))


@pytest.mark.parametrize("family", dict(FAMILIES, **{SHARED: None}))
def test_a_block_masked_forward_asks_the_mask_mod_nothing(family, arrays, mode):
    """Every forward family takes a partial tile's verdicts from the block mask's bits (what `sim.hardware`
    counts): called with mod_args under which the mask_mod would show every causal key (one document), a
    block-masked call still computes the block mask's documents, bit for bit, where the dense mask_mod call
    does not."""
    to_device, to_host = arrays
    seqlen = 40 if mode == "simulator" else 1024
    doc, one, bm = documents_with_other_ids(seqlen)
    dtype, tiles = ("float16", shared_tiles(mode)) if family == SHARED else FAMILIES[family]
    case = Case(1, seqlen, seqlen, 1, 1, 16, dtype, seed=8)
    q, k, v = (to_device(x) for x in inputs(case))
    forward = forward_of(case, tiles)
    right, wrong, dense_wrong = (to_host(forward(q, k, v, mod_args=(to_device(ids),), **options)) for ids, options
                                 in [(doc, dict(block_mask=bm)), (one, dict(block_mask=bm)),
                                     (one, dict(mask_mod=same_document_causal))])
    assert np.array_equal(right.view(np.uint8), wrong.view(np.uint8))
    assert not np.array_equal(right.view(np.uint8), dense_wrong.view(np.uint8))


@pytest.mark.parametrize("family", BACKWARD_FAMILIES)
def test_a_block_masked_backward_asks_the_mask_mod_nothing(family, arrays, mode):
    """The backward's passes too (`test_a_block_masked_forward_asks_the_mask_mod_nothing`)."""
    to_device, to_host = arrays
    seqlen = 40 if mode == "simulator" else 1024
    doc, one, bm = documents_with_other_ids(seqlen)
    dtype, tiles, deterministic = BACKWARD_FAMILIES[family]
    tiles = shared_tiles(mode, backward=True) if family == SHARED else tiles
    plan = tiling.make_plan(1, 1, 1, seqlen, seqlen, 16, dtype, backward=True, tiles=tiles,
                            deterministic=deterministic)
    case = Case(1, seqlen, seqlen, 1, 1, 16, dtype, seed=9)
    q, k, v, dout = inputs(case, extra=[(1, seqlen, 1, 16)])
    out, lse = reference.attention_forward(q, k, v, mask_mod=same_document_causal, mod_args=(doc,))
    args = [to_device(x) for x in (dout, q, k, v, out.astype(q.dtype), lse.astype(np.float32))]
    right, wrong = ([to_host(g) for g in numbaflash.attention_backward(
        *args, plan=plan, deterministic=deterministic, block_mask=bm, mod_args=(to_device(ids),))]
        for ids in (doc, one))
    for name, r, w in zip(("dq", "dk", "dv"), right, wrong):
        if deterministic or name != "dq":  # the atomic dQ sums in a varying order on a GPU
            assert np.array_equal(r.view(np.uint8), w.view(np.uint8)), name


@pytest.mark.parametrize("parallel", [False, True])
def test_block_classes_summed_from_the_fine_tiles_match_the_mask_evaluated_for_each_shape(parallel, monkeypatch,
                                                                                          cache_dir):
    """`BlockMask.classify` evaluates the mask once and sums 16 x 16 tiles; a shape it cannot sum (24 rows)
    evaluates the mask again: both agree with counting the visible scores of each tile directly, counted on one
    core or (as masks of 2^24 scores and more are) on every core (in an empty disk cache, which would otherwise hand
    the second count the first's result)."""
    monkeypatch.setattr(block_sparsity, "PARALLEL_SCORES", 0 if parallel else 2 ** 62)
    doc = np.repeat(np.arange(3), [20, 33, 47]).astype(np.int32)[None]
    bm = numbaflash.block_mask(same_document_causal, None, None, 100, 100, mod_args=(doc,))
    visible = reference.visible_mask(100, 100) & (doc[0][:, None] == doc[0][None, :]) & np.tri(100, dtype=bool)
    for rows, cols in ((16, 16), (32, 16), (64, 128), (24, 16)):
        counts = block_sparsity._tile_counts(visible[None, None], rows, cols)
        want = np.where(counts == 0, block_sparsity.EMPTY,
                        np.where(counts == rows * cols, block_sparsity.FULL, block_sparsity.PARTIAL))
        assert np.array_equal(bm.classify(rows, cols), want), (rows, cols)
    assert {block_sparsity.EMPTY, block_sparsity.PARTIAL, block_sparsity.FULL} <= set(np.unique(bm.classify(16, 16)))
    assert bm.visible_scores(-1, -1, 1, 1) == int(visible.sum())


def same_document_causal(b, h, q_idx, kv_idx, doc):
    return doc[0, q_idx] == doc[0, kv_idx] and kv_idx <= q_idx


def causal_only(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@pytest.mark.parametrize("mask_mod,lengths", [(same_document_causal, [40, 130, 10, 76]), (causal_only, [256])])
def test_a_block_masked_grid_runs_its_longest_query_tiles_first(mask_mod, lengths):
    """`BlockMask.grid_order`, the last entry of each row of the forward's and dQ pass's table (`key_tiles.grid_tile`):
    every query tile once, the ones that visit the most key tiles first, of equal ones the later rows first, so a
    causal block mask runs its rows in the built-in causal's order (`blocks.query_blocks`)."""
    seqlen, rows, cols = sum(lengths), 16, 32
    doc = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
    args = (doc,) if mask_mod is same_document_causal else ()
    bm = numbaflash.block_mask(mask_mod, None, None, seqlen, seqlen, mod_args=args)
    like = numbaflash._arrays.Operand(doc, "numpy", doc.shape, doc.strides, "int32", -1, 0)
    table, _ = (x.obj for x in bm.key_tiles(rows, cols, -1, 0, like))
    order = table[0, 0, :, -1]
    assert np.array_equal(order, bm.grid_order(rows, cols, -1, 0)[0, 0])
    assert sorted(order) == list(range(table.shape[2]))
    visits = table[0, 0, order, 0]
    assert (np.diff(visits) <= 0).all() and all(order[i] > order[i + 1] for i in range(len(order) - 1)
                                               if visits[i] == visits[i + 1])
    if mask_mod is causal_only:
        assert np.array_equal(order, np.arange(table.shape[2])[::-1])
    else:  # the documents' blocks interleave: the longest document's last rows first, not the last document's
        assert order[0] == (40 + 130 - 1) // rows and len(set(visits)) > 2


def test_a_block_mask_counts_its_tiles_in_memory_for_the_counts_alone():
    """Classifying a mask over 2048 x 2048 scores keeps only the 16 x 16 tiles' counts (65 KB) beside the mask's
    rows' ranges; the boolean array of every score it built before, and its int64 copy, took 36 MB. The FLOPs
    `sim.hardware` counts come from the same loop: every visible score of each document, causal inside it."""
    import tracemalloc

    seqlen = 2048
    doc = (np.arange(seqlen) // 256).astype(np.int32)[None]
    numbaflash.block_mask(same_document_causal, None, None, 64, 64, mod_args=(doc[:, :64],)).classify(16, 16)  # compiles
    bm = numbaflash.block_mask(same_document_causal, None, None, seqlen, seqlen, mod_args=(doc,))
    tracemalloc.start()
    try:
        bm.classify(128, 128)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2 ** 20, peak
    assert bm.visible_scores(-1, -1, 3, 2) == 3 * 2 * 8 * (256 * 257 // 2)
    assert bm.visible_scores(-1, 0, 1, 1) == 8 * (256 * 257 // 2)  # causal on top changes nothing here
    assert bm.visible_scores(3, 0, 1, 1) == 8 * (4 * 256 - 6)  # a window of 4 keys: 1 + 2 + 3 + 4 x 253 per document


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(block_mask="dense"), TypeError, "block_mask must be None or what numbaflash.block_mask"),
    (dict(block_mask=("wrong sizes",)), TypeError, "block_mask must be None"),
])
def test_bad_block_masks_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        numbaflash.attention(Q, Q, Q, **kwargs)


def test_a_block_mask_for_other_sizes_or_another_mask_mod_is_refused():
    bm = numbaflash.block_mask(lambda b, h, i, j: j <= i, None, None, 9, 8)
    with pytest.raises(ValueError, match="block_mask was made for"):
        numbaflash.attention(Q, Q, Q, block_mask=bm)
    bm = numbaflash.block_mask(lambda b, h, i, j: j <= i, None, None, 8, 8)
    with pytest.raises(ValueError, match="mask_mod differs from the block_mask's own"):
        numbaflash.attention(Q, Q, Q, block_mask=bm, mask_mod=lambda b, h, i, j: True)
    with pytest.raises(ValueError, match="batch must be an integer >= 1 or None"):
        numbaflash.block_mask(lambda b, h, i, j: True, 0, None, 8, 8)


def test_explain_names_the_modifications_and_what_the_block_mask_skips():
    causal = numbaflash.block_mask(lambda b, h, i, j: j <= i, None, None, 8, 8)
    forward = numbaflash.explain(Q, Q, Q, softcap=2.0, block_mask=causal)
    assert "softcap, mask_mod" in forward and "scores modified in natural-log units" in forward
    # a block mask's verdicts come from its bits: the kernels call no user function, so read no mod_args
    assert "mask_mod's verdicts, read from the block mask's bits" in forward and "leaves out" not in forward
    assert "leaves out the mod_args the kernels read" in numbaflash.explain(Q, Q, Q, mask_mod=causal.mask_mod)
    assert "leaves out the slopes the kernels read" in numbaflash.explain(
        Q, Q, Q, alibi_slopes=np.ones(Q.shape[2], np.float32))
    assert "of the 16 x 16 tiles are not empty: the forward visits only those" in forward
    # sim counts the block mask's tiles only: over 64 rows a causal block mask empties the upper tiles.
    q64 = np.zeros((1, 64, 1, 16), np.float32)
    causal64 = numbaflash.block_mask(causal.mask_mod, None, None, 64, 64)
    sparse, dense = (int(re.search(r"HBM traffic.*\(reads ([\d,]+)", numbaflash.explain(q64, q64, q64, **options))
                               .group(1).replace(",", ""))
                     for options in (dict(block_mask=causal64), dict(mask_mod=causal.mask_mod)))
    assert sparse < dense, (sparse, dense)
    backward = numbaflash.explain(Q, Q, Q, block_mask=causal, backward=True)
    assert "tiles of the dK/dV pass and" in backward and "the backward visits only those" in backward
    assert "modified    none" in numbaflash.explain(Q, Q, Q)


def test_only_the_users_per_score_functions_keep_headdim_64_at_two_consumers():
    """softcap and ALiBi plan three consumer warpgroups at headdim 64; a score_mod or a mask_mod without a block
    mask, called per score, plans two; a block mask (whose verdicts the kernels read as bits) plans one, two
    blocks per multiprocessor, forward and backward, and says why (at headdim 128 the usual tiles)."""
    three = [Mods(softcap=True), Mods(alibi=True)]
    two = [Mods(score_mod=relative_bias), Mods(mask_mod=same_document_causal),
           Mods(softcap=True, score_mod=relative_bias, mask_mod=same_document_causal, block_sparse=True)]
    one = [Mods(mask_mod=same_document_causal, block_sparse=True),
           Mods(softcap=True, mask_mod=same_document_causal, block_sparse=True)]
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(mods, headdim=64, backward=False):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, "float16", device=hopper, backward=backward,
                                user_functions=mods.per_score_functions, block_sparse=mods.block_sparse)

    for mods, warpgroups in [(m, 3) for m in three] + [(m, 2) for m in two] + [(m, 1) for m in one]:
        assert plan(mods).tiles.warpgroups == warpgroups, mods.describe()
    for mods in one:
        forward, backward = plan(mods), plan(mods, backward=True)
        assert forward.tiles == tiling.WGMMA_BLOCK_SPARSE_TILES[64]
        assert backward.tiles == tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64]
        assert all(tiling.SHARED_BLOCKS_REASON in p.reason and "2 blocks per multiprocessor (launch bounds: 128 "
                   "registers a thread at entry)" in p.describe() for p in (forward, backward))
        assert plan(mods, headdim=128).tiles == tiling.WGMMA_TILES[128]
        assert plan(mods, headdim=128, backward=True).tiles == tiling.WGMMA_BACKWARD_TILES[128]
    assert tiling.SHARED_BLOCKS_REASON not in plan(Mods()).reason


def test_a_block_mask_whose_blocks_visit_many_tiles_plans_the_dense_forward_tiles(arrays):
    """At headdim 64 a block mask's forward runs the dense plan's tiles where a block of them visits at least
    `tiling.WGMMA_BLOCK_SPARSE_DENSE_VISITS` key tiles on average, and says so; fewer, or an unknown count, plan the
    shared blocks, as does every backward; headdim 128 plans its usual tiles and counts nothing. The call's plan
    counts its block mask's visits (`BlockMask.mean_visits`): one document of 12288 tokens, causal inside, visits
    65 tiles of 96 keys per 192-row block on average (block i visits 2 (i + 1)), 8 documents 9."""
    to_device, _ = arrays
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)
    many = tiling.WGMMA_BLOCK_SPARSE_DENSE_VISITS

    def plan(visits, headdim=64, backward=False):
        return tiling.make_plan(1, 8, 8, 16384, 16384, headdim, "float16", device=hopper, backward=backward,
                                block_sparse=True, block_visits=visits)

    assert tiling.block_visits_tiles(64) == (tiling.WGMMA_TILES[64].block_m, tiling.WGMMA_TILES[64].block_n)
    assert tiling.block_visits_tiles(128) is None
    dense = plan(many)
    assert dense.tiles == tiling.WGMMA_TILES[64] and f"visit {many} key tiles each on average" in dense.reason
    for shared in (plan(many - 1), plan(None)):
        assert shared.tiles == tiling.WGMMA_BLOCK_SPARSE_TILES[64] and tiling.SHARED_BLOCKS_REASON in shared.reason
    assert plan(many, backward=True).tiles == tiling.WGMMA_BLOCK_SPARSE_BACKWARD_TILES[64]
    assert plan(many, headdim=128).tiles == tiling.WGMMA_TILES[128]
    for bad, error in ((-1, ValueError), (2.5, TypeError), ("64", TypeError), (True, TypeError)):
        with pytest.raises(error, match="block_visits must be an integer >= 0"):
            plan(bad)
    with pytest.raises(ValueError, match="block_visits counts a block mask's visits: it is None without block_sparse"):
        tiling.make_plan(1, 8, 8, 64, 64, 64, "float16", device=hopper, block_visits=3)
    seqlen = 12288
    q = to_device(np.zeros((1, seqlen, 1, 64), np.float16))
    for documents, visits, tiles in ((1, 65, tiling.WGMMA_TILES[64]), (8, 9, tiling.WGMMA_BLOCK_SPARSE_TILES[64])):
        doc = (np.arange(seqlen, dtype=np.int32) // (seqlen // documents))[None]
        bm = numbaflash.block_mask(same_document_causal, None, None, seqlen, seqlen, mod_args=(doc,))
        assert bm.mean_visits(*tiling.block_visits_tiles(64), -1, -1) == visits
        call = interface.inspect(q, q, q, False, None, (-1, -1), modifications=dict(
            block_mask=bm, mod_args=(to_device(doc),)))
        assert interface._plan_for(call, False, device=hopper).tiles == tiles, documents


def test_alibi_alone_at_headdim_64_takes_its_column_term_from_the_tensor_cores():
    """ALiBi alone plans `tiling.WGMMA_ALIBI_TILES` at headdim 64 and says why; with softcap or a score_mod, packed
    sequences, a block mask, at headdim 128 and in the backward it does not. The column operands take shared
    memory beside the tiles, and only v5 (bulk tensor copies) has them."""
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(mods, headdim=64, backward=False):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, "float16", device=hopper, backward=backward,
                                packed=mods.packed, user_functions=mods.per_score_functions,
                                softcap_alone=mods.softcap_alone, block_sparse=mods.block_sparse,
                                alibi_alone=mods.alibi_alone)

    alibi = plan(Mods(alibi=True))
    assert alibi.tiles == tiling.WGMMA_ALIBI_TILES[64] and alibi.tiles.alibi_columns
    assert "ALiBi alone: one more wgmma k-step adds the bias's column term" in alibi.reason
    columns = 2 * (64 + alibi.tiles.block_n) * 64  # bytes of A's and B's swizzle atoms
    assert alibi.launches[0].smem_bytes == plan(Mods()).launches[0].smem_bytes + columns
    for other in (plan(Mods(alibi=True, softcap=True)), plan(Mods(alibi=True, score_mod=relative_bias)),
                  plan(Mods(alibi=True, packed=True)), plan(Mods(alibi=True, mask_mod=same_document_causal,
                                                                 block_sparse=True)),
                  plan(Mods(alibi=True), headdim=128), plan(Mods(alibi=True), backward=True), plan(Mods())):
        assert not getattr(other.tiles, "alibi_columns", False) and "column term" not in other.reason
    with pytest.raises(ValueError, match="alibi_columns.*is v5's"):
        tiling.WgmmaTiles(64, 16, 1, producer=True, alibi_columns=True)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [64, 128])
def test_built_in_modifications_keep_their_forwards_in_registers(headdim):
    """No local memory in the planned forwards of softcap alone, ALiBi alone (at 64 with its column operands) and
    both together."""

    for mods in (Mods(softcap=True), Mods(alibi=True), Mods(softcap=True, alibi=True)):
        plan = tiling.make_plan(1, 8, 8, 2048, 2048, headdim, "float16", softcap_alone=mods.softcap_alone,
                                alibi_alone=mods.alibi_alone)
        for launch in plan.launches:
            attrs = interface.kernel_for(plan, launch, mods).cufunc().attrs
            assert attrs.local == 0, f"{launch.kernel} {mods.describe()} d={headdim}: {attrs.local} bytes of local memory"


def test_two_blocks_per_multiprocessor_take_one_consumer_and_half_the_shared_memory():
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)
    for bad in (dict(blocks_per_sm=3), dict(blocks_per_sm=0), dict(blocks_per_sm=2, producer=False, tma=False)):
        with pytest.raises(ValueError, match="two blocks share a multiprocessor with one consumer"):
            tiling.WgmmaTiles(64, 64, 1, **dict(dict(producer=True, tma=True), **bad))
    with pytest.raises(ValueError, match="two blocks share a multiprocessor with one consumer"):
        tiling.WgmmaTiles(128, 64, 2, producer=True, tma=True, blocks_per_sm=2)
    # 64 x 128 at headdim 128, 3 stages: 16 KiB of Q and 192 KiB of K and V fit a block alone, not two
    big = dict(block_m=64, block_n=128, warpgroups=1, stages=3, producer=True, tma=True)
    tiling.make_plan(1, 8, 8, 2048, 2048, 128, "float16", device=hopper, tiles=tiling.WgmmaTiles(**big))
    with pytest.raises(ValueError, match=r"offers 115712 to each of 2 block\(s\) per multiprocessor"):
        tiling.make_plan(1, 8, 8, 2048, 2048, 128, "float16", device=hopper,
                         tiles=tiling.WgmmaTiles(**big, blocks_per_sm=2))


def test_row_sums_are_planned_where_the_lse_is_not_asked_for(arrays):
    """softcap alone and ALiBi alone take their row sums from the tensor cores at headdim 64 when the caller takes no
    LSE (`tiling.ROW_SUMS_HEADDIMS`), and say so; with the LSE, the plain forward, headdim 128 and the backward keep
    the softmax's adds. A plan with them refuses a call that asks for the LSE; only v5 has them."""
    to_device, _ = arrays
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(headdim=64, backward=False, lse=False, **flags):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, "float16", device=hopper, backward=backward, lse=lse,
                                **flags)

    for summed in (plan(softcap_alone=True), plan(alibi_alone=True)):
        assert summed.tiles.row_sums and "the LSE is not asked for: the tensor cores sum each row's P" in summed.reason
        ones = 2 * 16 * 64  # bytes of B's 16 rows of ones
        assert summed.launches[0].smem_bytes == plan(
            lse=True, softcap_alone=summed.tiles.exp2_fma > 0,
            alibi_alone=summed.tiles.alibi_columns).launches[0].smem_bytes + ones
    # float16 softcap's FMA-pipe exponentials then come as float16 pairs, more of them
    paired = plan(softcap_alone=True)
    assert paired.tiles.exp2_fma == tiling.WGMMA_SOFTCAP_PAIR_CHUNKS[64]
    assert "FMA pipe as float16 pairs" in paired.reason
    assert plan(softcap_alone=True, lse=True).tiles.exp2_fma == tiling.WGMMA_SOFTCAP_TILES[64].exp2_fma
    assert "float16 pairs" not in plan(softcap_alone=True, lse=True).reason
    for other in (plan(), plan(softcap_alone=True, lse=True), plan(alibi_alone=True, lse=True),
                  plan(headdim=128, softcap_alone=True), plan(headdim=128, alibi_alone=True),
                  plan(backward=True, softcap_alone=True)):
        assert not getattr(other.tiles, "row_sums", False) and "sum each row" not in other.reason
    with pytest.raises(ValueError, match="row_sums.*are v5's"):
        tiling.WgmmaTiles(64, 16, 1, producer=True, row_sums=True)
    case, tiles = ROW_SUMS_CASES["softcap, causal, growing keys"]
    summed = tiling.make_plan(1, 1, 1, 8, 8, 16, "float16", tiles=tiles, softcap_alone=True, lse=False)
    q = to_device(np.zeros((1, 8, 1, 16), np.float16))
    with pytest.raises(ValueError, match="plan sums P's rows on the tensor cores"):
        numbaflash.attention(q, q, q, softcap=30.0, plan=summed, return_lse=True)


def test_softcap_bound_is_planned_for_bfloat16_within_its_limit(arrays):
    """bfloat16 softcap alone with softcap * log2(e) <= `tiling.BOUNDED_MAX_LOG2` takes its bound for each row's
    maximum in v5's forward at every head dim, with or without the LSE (a call's softcap reaches the plan), and says
    so; float16, a larger softcap, softcap with ALiBi and the backward keep running maxima. A plan with it refuses a
    call it does not hold for; only v5 has it."""

    to_device, _ = arrays
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(headdim=64, dtype="bfloat16", softcap=30.0, backward=False, lse=True, softcap_alone=True):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, dtype, device=hopper, backward=backward, lse=lse,
                                softcap_alone=softcap_alone, softcap=softcap)

    limit = tiling.BOUNDED_MAX_LOG2 / np.log2(np.e)
    for bounded in (plan(), plan(lse=False), plan(headdim=128), plan(headdim=256),
                    plan(softcap=float(np.nextafter(limit, 0)))):
        assert bounded.tiles.bounded_max and tiling.BOUNDED_MAX_REASON in bounded.reason
    for other in (plan(dtype="float16"), plan(softcap=float(np.nextafter(limit, np.inf))), plan(backward=True),
                  plan(softcap_alone=False)):  # the last: softcap with ALiBi or a score_mod
        assert not getattr(other.tiles, "bounded_max", False) and tiling.BOUNDED_MAX_REASON not in other.reason
    q = to_device(np.zeros((1, 8, 1, 64), NP_DTYPES["bfloat16"]))
    for cap, bounded in ((30.0, True), (40.0, False)):
        call = interface.inspect(q, q, q, False, None, (-1, -1), modifications=dict(softcap=cap))
        assert interface._plan_for(call, False, device=hopper).tiles.bounded_max == bounded
    with pytest.raises(ValueError, match="bounded_max.*is v5's"):
        tiling.WgmmaTiles(64, 16, 1, producer=True, bounded_max=True)
    fixed = tiling.make_plan(1, 1, 1, 8, 8, 16, "bfloat16", tiles=BOUNDED_TILES, softcap_alone=True)
    for dtype, cap in (("bfloat16", 40.0), ("float16", 30.0)):
        x = to_device(np.zeros((1, 8, 1, 16), NP_DTYPES[dtype]))
        with pytest.raises(ValueError, match="softcap's bound for each row's maximum"):
            numbaflash.attention(x, x, x, softcap=cap, plan=fixed if dtype == "bfloat16" else tiling.make_plan(
                1, 1, 1, 8, 8, 16, dtype, tiles=BOUNDED_TILES, softcap_alone=True))


def test_softcap_alone_at_headdim_64_takes_part_of_its_exponentials_from_the_fma_pipe():
    """softcap alone pays tanh and ex2 per score on the special-function unit: at headdim 64 its forward plans
    `tiling.WGMMA_SOFTCAP_TILES` and says why; with ALiBi, at headdim 128 or in the backward it does not."""
    from numbaflash.mods import Mods

    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(mods, headdim=64, backward=False):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, "float16", device=hopper, backward=backward,
                                user_functions=mods.per_score_functions, softcap_alone=mods.softcap_alone)

    capped = plan(Mods(softcap=True))
    assert capped.tiles == tiling.WGMMA_SOFTCAP_TILES[64] and capped.tiles.exp2_fma > 0
    assert f"{capped.tiles.exp2_fma} of 12 8-key chunks take ex2 from a polynomial on the FMA pipe" in capped.reason
    assert Mods(softcap=True, mask_mod=same_document_causal, block_sparse=True).softcap_alone
    for other in (plan(Mods(softcap=True, alibi=True)), plan(Mods(softcap=True), headdim=128),
                  plan(Mods(softcap=True, score_mod=relative_bias)), plan(Mods())):
        assert other.tiles.exp2_fma == 0 and "FMA pipe" not in other.reason
    assert plan(Mods(softcap=True), backward=True).tiles.exp2_fma == 0
    with pytest.raises(ValueError, match="exp2_fma counts 8-key chunks"):
        tiling.WgmmaTiles(64, 16, 1, exp2_fma=3)


def test_softcap_alone_at_headdim_128_runs_three_consumers():
    """At headdim 128 softcap alone's forward plans `tiling.WGMMA_SOFTCAP_TILES` (three consumer warpgroups on 80-key
    tiles) and says why, with or without the LSE and in bfloat16 with its bound; the plain forward,
    headdim 64, softcap with ALiBi and the backward do not. Issuing each tile's scores ahead, which the plan took
    before, is v5's alone."""
    from numbaflash.mods import Mods

    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)

    def plan(mods, headdim=128, backward=False, dtype="float16", lse=True):
        return tiling.make_plan(1, 8, 8, 2048, 2048, headdim, dtype, device=hopper, backward=backward, lse=lse,
                                user_functions=mods.per_score_functions, softcap_alone=mods.softcap_alone, softcap=30.0)

    for three in (plan(Mods(softcap=True)), plan(Mods(softcap=True), lse=False),
                  plan(Mods(softcap=True), dtype="bfloat16")):
        assert tiling.SOFTCAP_CONSUMERS_REASON in three.reason, three.reason
        assert (three.tiles.block_m, three.tiles.block_n, three.tiles.warpgroups, three.tiles.pingpong) == (
            192, 80, 3, False)
        assert three.kernel == "wgmma_tma_forward"
    assert plan(Mods(softcap=True), dtype="bfloat16").tiles.bounded_max
    assert not plan(Mods(softcap=True)).tiles.bounded_max
    for other in (plan(Mods()), plan(Mods(softcap=True), headdim=64), plan(Mods(softcap=True, alibi=True)),
                  plan(Mods(softcap=True), backward=True)):
        assert other.tiles.block_n != 80 and tiling.SOFTCAP_CONSUMERS_REASON not in other.reason
    with pytest.raises(ValueError, match="scores_ahead.*are v5's"):
        tiling.WgmmaTiles(64, 16, 1, producer=True, scores_ahead=True)


def test_plan_is_the_plan_of_the_call_with_its_modifications():
    """`numbaflash.plan` takes `attention`'s modifications and plans what the call runs: on a Hopper device softcap
    alone's own tiles (at headdim 64 the tensor cores' row sums where the LSE is not taken), ALiBi alone's column
    operands, a block mask's shared blocks, the backward's tiles; ``tiles=`` replaces the blocks and keeps the call's
    plan otherwise; bad modifications are refused as the call refuses them; a plan runs the call bit for bit."""
    hopper = tiling.Device("H100 (planned)", (9, 0), 132, 227 * 1024)
    rng = np.random.default_rng(0)
    qkv64, qkv128 = ([rng.standard_normal((1, 256, 2, d)).astype(np.float16) for _ in range(3)] for d in (64, 128))

    def plan(qkv, **options):
        return numbaflash.plan(*qkv, device=hopper, **options)

    assert plan(qkv128, softcap=30.0).tiles == tiling.WGMMA_SOFTCAP_TILES[128]
    assert plan(qkv128).tiles == tiling.WGMMA_TILES[128]
    assert plan(qkv64, softcap=30.0).tiles.row_sums and not plan(qkv64, softcap=30.0, return_lse=True).tiles.row_sums
    assert plan(qkv64, softcap=30.0, return_lse=True).tiles == tiling.WGMMA_SOFTCAP_TILES[64]
    slopes = np.full(2, 0.5, np.float32)
    assert plan(qkv64, alibi_slopes=slopes, return_lse=True).tiles == tiling.WGMMA_ALIBI_TILES[64]
    causal = numbaflash.block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, 256, 256)
    assert plan(qkv64, block_mask=causal).tiles == tiling.WGMMA_BLOCK_SPARSE_TILES[64]
    assert plan(qkv64, softcap=30.0, backward=True).tiles == tiling.WGMMA_BACKWARD_TILES[64]
    ahead = tiling.WgmmaTiles(128, 96, 2, producer=True, tma=True, scores_ahead=True)
    asked = plan(qkv128, softcap=30.0, tiles=ahead)
    assert asked.tiles == ahead and asked.kernel == plan(qkv128, softcap=30.0).kernel

    for options, error in ((dict(softcap=-1.0), ValueError), (dict(alibi_slopes=slopes[:1]), ValueError),
                           (dict(score_mod=tempered, mod_args=(np.zeros(2, np.int32), np.ones(2, np.float32)),
                                 backward=True), ValueError)):
        backward = options.pop("backward", False)
        with pytest.raises(error) as refused:
            plan(qkv64, backward=backward, **options)
        call = numbaflash.attention_backward if backward else numbaflash.attention
        with pytest.raises(error) as by_the_call:
            call(*([qkv64[0]] if backward else []), *qkv64, *([qkv64[0], np.zeros((1, 2, 256), np.float32)]
                                                              if backward else []), **options)
        assert str(refused.value) == str(by_the_call.value)
    with pytest.raises(TypeError, match="tiles must be None"):
        plan(qkv64, tiles="fast")
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        plan(qkv64, return_lse=1)

    q, k, v = (rng.standard_normal((1, 20, 2, 16)).astype(np.float32) for _ in range(3))
    planned = numbaflash.attention(q, k, v, softcap=5.0, plan=numbaflash.plan(q, k, v, softcap=5.0))
    np.testing.assert_array_equal(planned, numbaflash.attention(q, k, v, softcap=5.0))
