"""The float64 reference against independent computations: a per-row loop, finite differences,
the masks drawn in its docstring, and GQA as repeated heads."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from numbaflash import reference


def rand(rng, *shape):
    return rng.standard_normal(shape)


def loop_attention(q, k, v, mask, scale):
    """One query row at a time, with Python's math on the visible keys only."""
    batch, nq, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((batch, heads, nq), -np.inf)
    for b in range(batch):
        for h in range(heads):
            for i in range(nq):
                keys = np.flatnonzero(mask[i])
                if keys.size == 0:
                    continue
                s = np.array([scale * q[b, i, h] @ k[b, j, h // group] for j in keys])
                w = np.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ v[b, keys, h // group]
                lse[b, h, i] = s.max() + np.log(w.sum())
    return out, lse


@given(nq=st.integers(1, 9), nk=st.integers(1, 9), d=st.integers(1, 5), causal=st.booleans(),
       left=st.integers(-1, 4), right=st.integers(-1, 4), group=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_forward_matches_row_loop(nq, nk, d, causal, left, right, group, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, 2, nq, 2 * group, d), rand(rng, 2, nk, 2, d), rand(rng, 2, nk, 2, d)
    out, lse = reference.attention_forward(q, k, v, causal=causal, window_size=(left, right))
    mask = reference.visible_mask(nq, nk, causal, (left, right))
    want_out, want_lse = loop_attention(q, k, v, mask, 1 / np.sqrt(d))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_masks_drawn_in_the_docstring():
    draw = lambda m: ["".join("x" if c else "." for c in row) for row in m]
    assert draw(reference.visible_mask(2, 5, causal=True)) == ["xxxx.", "xxxxx"]
    assert draw(reference.visible_mask(5, 2, causal=True)) == ["..", "..", "..", "x.", "xx"]
    assert draw(reference.visible_mask(4, 4, window_size=(1, 0))) == ["x...", "xx..", ".xx.", "..xx"]


def test_row_that_sees_no_key_gives_zero_and_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 1, 5, 1, 3), rand(rng, 1, 2, 1, 3), rand(rng, 1, 2, 1, 3)
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert np.all(out[0, :3] == 0) and np.all(np.isneginf(lse[0, 0, :3]))
    assert np.all(np.isfinite(lse[0, 0, 3:]))


def test_gqa_equals_repeated_kv_heads():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 2, 6, 4, 3), rand(rng, 2, 7, 2, 3), rand(rng, 2, 7, 2, 3)
    out, _ = reference.attention_forward(q, k, v, causal=True)
    rep = lambda x: np.repeat(x, 2, axis=2)
    want, _ = reference.attention_forward(q, rep(k), rep(v), causal=True)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(1, 2))])
def test_backward_matches_central_differences(mask):
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, 1, 4, 2, 3), rand(rng, 1, 5, 1, 3), rand(rng, 1, 5, 1, 3)
    dout = rand(rng, *q.shape)
    grads = reference.attention_backward(dout, q, k, v, **mask)
    loss = lambda q_, k_, v_: np.sum(dout * reference.attention_forward(q_, k_, v_, **mask)[0])
    eps = 1e-6
    for which, grad in enumerate(grads):
        args = [q, k, v]
        numeric = np.zeros_like(args[which])
        for idx in np.ndindex(args[which].shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
