"""Any finite softmax_scale (negative and zero, as flash-attn takes; at most float32's largest over log2(e) in
magnitude for inputs the kernels compute in float32), softcap at the ends of its range, and NaN inputs, in every
kernel family.

A negative scale makes the largest scaled score the smallest raw one: the tensor-core forwards, which
take the row maximum of raw scores, negate them first (`kernels.softmax`); the CUDA-core kernels scale Q
before the product. A NaN in q, k or v must reach out and LSE as NaN, as in the reference, never turn
into a row that "saw no key" (out = 0, LSE = -inf).
"""

import math

import numpy as np
import pytest

import numbaflash
from cases import (NP_DTYPES, Case, assert_close_as_flash_attn, check_backward, check_forward, inputs, naive_forward,
                   reference_forward)
from numbaflash import reference, tiling
from numbaflash.tiling import SIMULATOR_MMA_TILES, SIMULATOR_WGMMA_TILES, WgmmaTiles

# Each family's kernel, the same on the simulator and a GPU: the plans' own choice for float32 (CUDA
# cores), and the tensor-core forwards through their tiles.
FAMILIES = {
    "simt": ("float32", None),
    "mma": ("float16", SIMULATOR_MMA_TILES),
    "wgmma v3": ("float16", SIMULATOR_WGMMA_TILES),
    "wgmma v5": ("float16", WgmmaTiles(64, 16, 1, producer=True, tma=True)),
    # every exponential of a score on the FMA pipe (`ex2_fma`), as part of them run with softcap at headdim 64
    "wgmma v5, ex2 on FMA": ("float16", WgmmaTiles(64, 16, 1, producer=True, tma=True, exp2_fma=2)),
}


def forward_of(case, tiles):
    if tiles is None:
        return numbaflash.attention
    plan = tiling.make_plan(case.batch, case.nheads, case.nheads_kv, case.seqlen_q, case.seqlen_k, case.headdim,
                            case.dtype, tiles=tiles)
    return lambda *a, **kw: numbaflash.attention(*a, plan=plan, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_forward_with_a_negative_or_zero_scale(family, scale, arrays, poisoned):
    dtype, tiles = FAMILIES[family]
    case = Case(1, 37, 29, 2, 1, 40, dtype, causal=scale < 0, softmax_scale=scale, seed=5)
    check_forward(case, forward_of(case, tiles), *arrays)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backward_with_a_negative_scale(dtype, arrays, poisoned):
    """The backward rebuilds P = exp(s scale - LSE) from the saved LSE: any sign works (CUDA cores for
    float32, mma.sync for float16)."""
    case = Case(1, 30, 41, 2, 2, 24, dtype, window_size=(9, 4), softmax_scale=-0.25, seed=6)
    check_backward(case, numbaflash.attention, numbaflash.attention_backward, *arrays)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_nan_reaches_out_and_lse(family, arrays):
    """NaN in one query row and in one key: exactly the rows the reference makes NaN are NaN (out and LSE);
    the others are finite."""
    dtype, tiles = FAMILIES[family]
    to_device, to_host = arrays
    case = Case(1, 24, 24, 1, 1, 32, dtype, causal=True, seed=7)
    q, k, v = inputs(case)
    q[0, 3, 0, 5] = np.nan  # row 3
    k[0, 20, 0, 1] = np.nan  # key 20: rows 20-23 see it under the causal mask
    out, lse = forward_of(case, tiles)(*(to_device(x) for x in (q, k, v)), causal=True, return_lse=True)
    out, lse = to_host(out), to_host(lse)
    want_out, want_lse = reference.attention_forward(q, k, v, causal=True)
    nan_rows = np.isnan(want_lse[0, 0])
    assert sorted(np.flatnonzero(nan_rows)) == [3, 20, 21, 22, 23]
    assert np.array_equal(np.isnan(lse[0, 0]), nan_rows), f"NaN LSE rows {np.flatnonzero(np.isnan(lse[0, 0]))}"
    assert np.isnan(out[0, nan_rows, 0].astype(np.float32)).all()
    assert np.isfinite(out[0, ~nan_rows, 0].astype(np.float32)).all()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_scale_that_is_not_finite_is_refused(scale):
    q = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        numbaflash.attention(q, q, q, softmax_scale=scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_scale_beyond_the_accumulators_range_is_refused(dtype):
    """The kernels scale scores by softmax_scale * log2(e) in float32 for these inputs: a larger scale would be inf
    there, and every score with it. float64 inputs, computed in float64, take it."""
    q = np.zeros((4, 8), NP_DTYPES[dtype])
    with pytest.raises(ValueError, match=rf"softmax_scale must be at most 2.359e\+38 in magnitude for {dtype}"):
        numbaflash.attention(q, q, q, softmax_scale=-2.4e38)
    q64 = np.zeros((4, 8), np.float64)
    assert numbaflash.plan(q64, q64, q64, softmax_scale=-2.4e38) is not None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("end", ["least", "most"])
def test_softcap_at_the_ends_of_its_range(family, end, arrays):
    """The least softcap the boundary takes (float32's smallest normal) keeps softmax_scale / softcap finite in
    float32, the most (float32's largest over log2(e)) softcap * log2(e): a score of exactly 0 (a query row of
    zeros) and every other stays finite, under flash-attn's rule. A subnormal softcap made that row NaN
    (tanh(0 * inf)), and a softcap of 3e38 every row of the tensor-core kernels."""
    dtype, tiles = FAMILIES[family]
    to_device, to_host = arrays
    limits = np.finfo(np.float32)
    softcap = float(limits.tiny) if end == "least" else float(limits.max) / math.log2(math.e) * (1 - 1e-7)
    case = Case(1, 24, 24, 1, 1, 32, dtype, softmax_scale=0.5, seed=8, modifications=dict(softcap=softcap))
    q, k, v = inputs(case)
    q[0, 5] = 0
    out, lse = forward_of(case, tiles)(*(to_device(x) for x in (q, k, v)), softmax_scale=case.scale, softcap=softcap,
                                       return_lse=True)
    out, lse = to_host(out), to_host(lse)
    want_out, want_lse = reference_forward(q, k, v, case)
    naive_out, _ = naive_forward(q, k, v, case)
    assert np.isfinite(lse).all() and np.isfinite(out.astype(np.float32)).all()
    assert_close_as_flash_attn("out", out, naive_out, want_out, dtype, case)
