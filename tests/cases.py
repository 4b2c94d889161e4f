"""What the kernel tests share: problem strategies, inputs, the same-precision naive attention, and
flash-attn's accuracy rule.

The rule: against the float64 reference, the kernel's max error may be at most twice the max error of
a naive implementation in the same precision, plus a floor. For float32 and float64 inputs, whose naive
scores stay in that precision, the naive implementation is whichever of two errs more: scores summed by
BLAS, or one head dimension after another (`CHAINED_DTYPES` says why). For float64 inputs the truth is the same
reference evaluated in extended precision (np.longdouble): a float64 truth would make the naive
float64 implementation exact and the rule meaningless. The floor:

* outputs: one unit in the last place of the output dtype at the output's scale, for the trivial
  cases where the naive result is exact (one key, say);
* LSE: two float32 (float64) ulps of the largest LSE plus the largest sum of |scale * q_i * k_j| terms,
  the rounding bound of one score's dot product. With one key per row the LSE *is* that dot product,
  which NumPy's naive einsum sums more accurately than a GPU's sequential FMA chain, and the kernels'
  base-2 exponentials add an ulp of the LSE where the float64 naive code repeats the reference's ops.
"""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import numbaflash.mods
from numbaflash import reference

DTYPES = ("float16", "bfloat16", "float32", "float64")
NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
WINDOWS = [(-1, -1), (-1, -1), (0, 0), (3, 2), (16, -1), (-1, 5), (7, 0)]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    causal: bool = False
    window_size: tuple = (-1, -1)
    softmax_scale: float = None
    logit_scale: float = 1.0  # multiplies the default softmax scale: large values give extreme logits
    seed: int = 0
    modifications: dict = None  # softcap, alibi_slopes, score_mod, ... as `numbaflash.attention` takes them (NumPy)

    @property
    def scale(self):
        return self.logit_scale / np.sqrt(self.headdim) if self.softmax_scale is None else self.softmax_scale

    @property
    def mask(self):
        return dict(causal=self.causal, window_size=self.window_size)

    def options(self, to_device=None):
        """The mask and modification keyword arguments of a call; arrays through ``to_device`` when given."""
        mods = dict(self.modifications or {})
        if to_device is not None:
            if mods.get("alibi_slopes") is not None:
                mods["alibi_slopes"] = to_device(mods["alibi_slopes"])
            mods["mod_args"] = tuple(to_device(a) for a in mods.get("mod_args", ()))
        return {**self.mask, **mods}


@st.composite
def cases(draw, max_seqlen=70, headdims=st.integers(1, 40), big_headdims=(64, 128, 256), dtypes=DTYPES,
          max_batch=2, max_kv_heads=2, max_group=2, extreme_logits=True):
    """batch 1-2, heads 1-4 with GQA, seqlens 1-70; head dims 1-40 plus 64, 128, 256 at tiny seqlens.

    ``extreme_logits=False`` for the backward: it rebuilds P = exp(S - LSE) from a float32 LSE, whose ulp
    at |logits| ~ 1e4 is 1e-3, so P carries that much error where standard attention, which keeps P,
    carries none (on the H200: dv 7.7e-5 against naive's 3e-8 with one key). flash-attn's backward has
    the same property; it is the price of not storing P.
    """
    big = draw(st.booleans()) if big_headdims else False
    headdim = draw(st.sampled_from(big_headdims)) if big else draw(headdims)
    top = 16 if big else max_seqlen
    nheads_kv = draw(st.integers(1, max_kv_heads))
    dtype = draw(st.sampled_from(dtypes))
    # Logits near +-1e4 stress the online softmax; fp16/bf16 naive scores would overflow there.
    extreme = extreme_logits and dtype in ("float32", "float64") and draw(st.integers(0, 4)) == 0
    return Case(
        batch=draw(st.integers(1, max_batch)), seqlen_q=draw(st.integers(1, top)), seqlen_k=draw(st.integers(1, top)),
        nheads=nheads_kv * draw(st.integers(1, max_group)), nheads_kv=nheads_kv, headdim=headdim, dtype=dtype,
        causal=draw(st.booleans()), window_size=draw(st.sampled_from(WINDOWS)),
        logit_scale=1e4 / np.sqrt(headdim) if extreme else 1.0, seed=draw(st.integers(0, 2**16)),
    )


def inputs(case, extra=()):
    """q, k, v (and arrays of the shapes in ``extra``) as NumPy arrays of the case's dtype."""
    rng = np.random.default_rng(case.seed)
    dt = NP_DTYPES[case.dtype]
    q = rng.standard_normal((case.batch, case.seqlen_q, case.nheads, case.headdim)).astype(dt)
    k = rng.standard_normal((case.batch, case.seqlen_k, case.nheads_kv, case.headdim)).astype(dt)
    v = rng.standard_normal((case.batch, case.seqlen_k, case.nheads_kv, case.headdim)).astype(dt)
    return (q, k, v) + tuple(rng.standard_normal(shape).astype(dt) for shape in extra)


def _round(x, dtype):
    """Round float32/float64 results to the storage dtype, as a GPU GEMM writing ``dtype`` would."""
    return np.asarray(x).astype(NP_DTYPES[dtype])


def _compute_type(dtype):
    return np.float64 if dtype == "float64" else np.float32


def _t(x):
    return x.transpose(0, 2, 1, 3)  # (batch, seqlen, heads, d) <-> (batch, heads, seqlen, d)


def _bmm(a, b, form):
    """Batched products through BLAS (np.einsum would not use it): the einsum named by ``form``.

    "ij": (b,i,h,d),(b,j,h,d) -> (b,h,i,j); "pv": (b,h,i,j),(b,j,h,d) -> (b,i,h,d);
    "tv": (b,h,i,j),(b,i,h,d) -> (b,j,h,d).
    """
    if form == "ij":
        return _t(a) @ _t(b).swapaxes(-1, -2)
    if form == "pv":
        return _t(a @ _t(b))
    return _t(a.swapaxes(-1, -2) @ _t(b))


def _chained_scores(a, b):
    """S = A B^T as "ij" of `_bmm` in a's precision, summed one head dimension after another: the order of a
    loop of multiply-adds, where BLAS sums in blocks."""
    a, b = _t(a), _t(b)  # (batch, heads, seqlen, d)
    s = np.zeros(a.shape[:3] + (b.shape[2],), dtype=a.dtype)
    for d in range(a.shape[-1]):
        s += a[..., d, None] * b[..., None, :, d]
    return s


def _naive_probabilities(q, k, v, case, chained=False):
    """The naive implementation's P: q scaled in its dtype, S and P rounded to the dtype, softmax in float32;
    ``chained``: S summed one head dimension after another (`_chained_scores`), not by BLAS.

    Returns the compute type, the per-query-head K and V, the scaled Q, P, the row max and row sum.
    """
    ct = _compute_type(case.dtype)
    group = case.nheads // case.nheads_kv
    kh = np.repeat(k, group, axis=2).astype(ct)
    vh = np.repeat(v, group, axis=2).astype(ct)
    qs = _round(q.astype(ct) * ct(case.scale), case.dtype).astype(ct)
    s = _round(_chained_scores(qs, kh) if chained else _bmm(qs, kh, "ij"), case.dtype).astype(ct)
    s, dmod, mask = _naive_modified(s, case)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = _round(e / np.where(total > 0, total, 1), case.dtype).astype(ct)
    return ct, kh, vh, qs, p, m, total, dmod


def _naive_modified(s, case):
    """The case's modifications on the naive scores ``s`` in their precision: (modified, derivative, mask)."""
    mods = dict(case.modifications or {})
    block = mods.pop("block_mask", None)
    mask_mod = mods.pop("mask_mod", None) or (block.mask_mod if block is not None else None)
    mask = reference.visible_mask(case.seqlen_q, case.seqlen_k, **case.mask)
    if not case.modifications:
        return s, np.ones_like(s), mask
    modified, dmod = numbaflash.mods.modify(s, **mods)
    visible = mask & numbaflash.mods.visible(mask_mod, s.shape, mods.get("mod_args", ()))
    dmod = np.ones_like(s) if dmod is None else np.where(visible, dmod, 0)
    return modified.astype(s.dtype), dmod.astype(s.dtype), visible


def naive_forward(q, k, v, case, chained=False):
    """Standard attention in the inputs' precision: S and P materialized in ``case.dtype``.

    Like flash-attn's ``attention_ref(upcast=False)``: q is scaled in its dtype, matrix products
    accumulate in float32 and round to the dtype, the softmax runs in float32 on the rounded scores.
    ``chained``: the scores summed one head dimension after another (`_naive_probabilities`).
    """
    ct, _, vh, _, p, m, total, _ = _naive_probabilities(q, k, v, case, chained)
    out = _round(_bmm(p, vh, "pv"), case.dtype)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0].astype(ct)
    return out, lse


def truth(case):
    """The precision the float64 reference runs in for this case (see the module docstring)."""
    return np.longdouble if case.dtype == "float64" else np.float64


def reference_forward(q, k, v, case):
    return reference.attention_forward(q, k, v, softmax_scale=case.scale, precision=truth(case), **case.options())


def errors(got, want):
    """(max, mean) absolute error over the entries where the reference is finite."""
    got, want = np.asarray(got, dtype=np.longdouble), np.asarray(want, dtype=np.longdouble)
    finite = np.isfinite(want)
    diff = np.abs(got[finite] - want[finite])
    return (float(diff.max(initial=0.0)), float(diff.mean()) if diff.size else 0.0)


def eps(dtype):
    return float(ml_dtypes.finfo(NP_DTYPES[dtype]).eps)


def dot_product_scale(q, k, case):
    """max over (i, j) of sum_d |scale * q_i * k_j|: what rounding in one score's dot product scales with."""
    group = case.nheads // case.nheads_kv
    qa = np.abs(q.astype(np.float64)) * case.scale
    ka = np.abs(np.repeat(k, group, axis=2).astype(np.float64))
    return float(_bmm(qa, ka, "ij").max(initial=0.0))


def assert_close_as_flash_attn(name, got, naive, want, dtype, case, floor=None):
    """flash-attn's rule; -inf entries (rows that see no key) must match exactly; NaN never passes. ``naive``: the
    naive implementation's result, or a tuple of several naive implementations' (the one that errs most counts)."""
    got, want = np.asarray(got, dtype=np.longdouble), np.asarray(want, dtype=np.longdouble)
    assert not np.isnan(got).any(), f"{name}: NaN in the kernel's result for {case}"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{name}: -inf entries differ for {case}"
    kernel_max, kernel_mean = errors(got, want)
    naive_max, naive_mean = max(errors(n, want) for n in (naive if isinstance(naive, tuple) else (naive,)))
    if floor is None:
        floor = eps(dtype) * float(np.abs(want[np.isfinite(want)]).max(initial=0.0))
    assert kernel_max <= 2 * naive_max + floor, (
        f"{name}: kernel max error {kernel_max:.3e} (mean {kernel_mean:.3e}) exceeds 2 x naive {dtype} "
        f"max error {naive_max:.3e} (mean {naive_mean:.3e}) + {floor:.1e} for {case}"
    )


# Dtypes whose naive scores stay in the accumulator's precision, where the order of a dot product's sum shows: the
# forward is held to the naive implementation whose scores err more, BLAS's blocks or a loop's chain. At headdim 256
# and logits near 1e3 BLAS's float32 scores came out closer than the kernels' chains of 32 head dims (the H100's
# float32 forward erred 1.75e-4 and 1.55e-5 in out against 7.6e-5 and 7.4e-6, twice failing the rule alone), and a
# chain of 16 or 8 came out closer on one case and not the other (.bench/simt_sum_emu.py): luck of rounding, which
# a second naive order takes out.
CHAINED_DTYPES = ("float32", "float64")


def check_forward(case, attention, to_device, to_host):
    """Run ``attention`` on ``case`` and hold its output and LSE to flash-attn's rule."""
    q, k, v = inputs(case)
    out, lse = attention(to_device(q), to_device(k), to_device(v), softmax_scale=case.scale, return_lse=True,
                         **case.options(to_device))
    out, lse = to_host(out), to_host(lse)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.batch, case.nheads, case.seqlen_q)
    assert lse.dtype == (np.float64 if case.dtype == "float64" else np.float32)
    want_out, want_lse = reference_forward(q, k, v, case)
    naive_out, naive_lse = naive_forward(q, k, v, case)
    if case.dtype in CHAINED_DTYPES:  # both naive orders: the rule takes the one that errs more
        chained_out, chained_lse = naive_forward(q, k, v, case, chained=True)
        naive_out, naive_lse = (naive_out, chained_out), (naive_lse, chained_lse)
    assert_close_as_flash_attn("out", out, naive_out, want_out, case.dtype, case)
    lse_dtype = "float64" if case.dtype == "float64" else "float32"
    assert_close_as_flash_attn("lse", lse, naive_lse, want_lse, lse_dtype, case,
                               floor=lse_floor(q, k, want_lse, lse_dtype, case))


def lse_floor(q, k, want_lse, lse_dtype, case):
    """The LSE's floor in flash-attn's rule (the module docstring): two ulps of the largest LSE plus the rounding
    bound of one score's dot product."""
    return 2 * eps(lse_dtype) * (dot_product_scale(q, k, case) + float(np.abs(want_lse[np.isfinite(want_lse)]).max(
        initial=0.0)))


def naive_backward(dout, q, k, v, case):
    """The gradients of `naive_forward` in the same precision, as autograd through it would give them.

    Each product accumulates in float32 and rounds to the dtype; the softmax backward
    dS = P * (dP - rowsum(P * dP)) runs in float32 on rounded P and dP; GQA sums in float32.
    """
    ct, kh, vh, qs, p, _, _, dmod = _naive_probabilities(q, k, v, case)
    group = case.nheads // case.nheads_kv
    do = dout.astype(ct)
    dv_h = _round(_bmm(p, do, "tv"), case.dtype).astype(ct)
    dp = _round(_bmm(do, vh, "ij"), case.dtype).astype(ct)
    ds = _round(p * (dp - (p * dp).sum(axis=-1, keepdims=True)) * dmod, case.dtype).astype(ct)
    dqs = _round(_bmm(ds, kh, "pv"), case.dtype).astype(ct)
    dq = _round(dqs * ct(case.scale), case.dtype)
    dk_h = _round(_bmm(ds, qs, "tv"), case.dtype).astype(ct)
    fold = lambda x: _round(x.reshape(case.batch, case.seqlen_k, case.nheads_kv, group, case.headdim).sum(axis=3),
                            case.dtype)
    return dq, fold(dk_h), fold(dv_h)


def check_backward(case, attention, attention_backward, to_device, to_host):
    """Run forward and backward on ``case`` and hold dq, dk, dv to flash-attn's rule."""
    q, k, v, dout = inputs(case, extra=[(case.batch, case.seqlen_q, case.nheads, case.headdim)])
    dev = [to_device(x) for x in (q, k, v, dout)]
    options = case.options(to_device)
    out, lse = attention(*dev[:3], softmax_scale=case.scale, return_lse=True, **options)
    grads = attention_backward(dev[3], *dev[:3], out, lse, softmax_scale=case.scale, **options)
    check_gradients(case, [to_host(g) for g in grads], dout, q, k, v, to_host(lse))


def check_gradients(case, grads, dout, q, k, v, lse):
    """Hold ``grads`` (dq, dk, dv on the host), computed from the LSE ``lse``, to flash-attn's rule."""
    want = reference.attention_backward(dout, q, k, v, softmax_scale=case.scale, precision=truth(case),
                                        **case.options())
    naive = naive_backward(dout, q, k, v, case)
    # One ulp at the gradients' common scale: with a single key dq and dk are exactly zero, naive
    # attention gets exact zeros, and the kernel's D = rowsum(dO * O) and dP = dO V^T, summed in
    # different orders, leave a residue far below the gradients' resolution. Plus P's recomputation:
    # exp2(s scale log2(e) - LSE log2(e)) from the saved LSE carries a relative error of a few ulps of
    # the LSE's dtype times |LSE| (naive attention normalizes exactly: one key gives P = 1, dv = dout).
    lse_dtype = "float64" if case.dtype == "float64" else "float32"
    lse_host = np.asarray(lse, dtype=np.float64)
    lse_max = float(np.abs(lse_host[np.isfinite(lse_host)]).max(initial=0.0))
    relative = eps(case.dtype) + eps(lse_dtype) * (2 + 2 * math.log2(math.e) * lse_max)
    floor = relative * max(float(np.abs(w).max(initial=0.0)) for w in want)
    for name, got, x, n, w in zip(("dq", "dk", "dv"), grads, (q, k, v), naive, want):
        assert got.shape == x.shape and got.dtype == x.dtype, f"{name}: {got.shape} {got.dtype}"
        assert_close_as_flash_attn(name, got, n, w, case.dtype, case, floor=floor)


@st.composite
def gpu_cases(draw, max_rows=8192, dtypes=DTYPES):
    """Real sizes for ``pytest -m gpu``: odd lengths up to ``max_rows``, head dims up to 256.

    Past 2048 rows the batch and heads shrink to one, to keep the host-side float64 reference fast.
    """
    dtype = draw(st.sampled_from(dtypes))
    # float64's truth is extended precision, which NumPy multiplies without BLAS: keep it to 1025 rows.
    lengths = [n for n in (1, 17, 97, 257, 1025, 2048, 4096, 8192) if n <= (max_rows if dtype != "float64" else 1025)]
    seqlen_q = draw(st.sampled_from(lengths))
    seqlen_k = draw(st.one_of(st.just(seqlen_q), st.sampled_from(lengths)))
    small = max(seqlen_q, seqlen_k) <= 2048
    nheads_kv = draw(st.integers(1, 2)) if small else 1
    headdim = draw(st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 256)))
    return Case(
        batch=draw(st.integers(1, 2)) if small else 1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        nheads=nheads_kv * (draw(st.integers(1, 2)) if small else 1), nheads_kv=nheads_kv, headdim=headdim,
        dtype=dtype, causal=draw(st.booleans()), window_size=draw(st.sampled_from(WINDOWS + [(256, 0), (1000, 100)])),
        seed=draw(st.integers(0, 2**16)),
    )
