"""numbaflash.torch: an autograd Function whose gradients gradcheck and the reference agree with."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cases import Case, inputs  # noqa: E402
from numbaflash import reference  # noqa: E402
from numbaflash import torch as nf_torch  # noqa: E402


@pytest.fixture
def device(mode):
    """CPU tensors on the simulator, CUDA tensors under ``pytest -m gpu``."""
    return "cuda" if mode == "gpu" else "cpu"


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1))])
def test_gradcheck_float64(mask, device):
    case = Case(1, 5, 6, 2, 1, 4, "float64", seed=11, **mask)
    q, k, v = (torch.tensor(x, device=device, requires_grad=True) for x in inputs(case))
    # Element by element on a GPU; by random projections on the simulator (its kernels run in Python).
    assert torch.autograd.gradcheck(lambda *a: nf_torch.attention(*a, **mask), (q, k, v), eps=1e-6, atol=1e-8,
                                    fast_mode=device == "cpu")


def test_forward_and_backward_match_the_reference(device):
    case = Case(2, 9, 13, 4, 2, 16, "float32", causal=True, seed=12)
    arrays = inputs(case, extra=[(2, 9, 4, 16)])
    q, k, v = (torch.tensor(x, device=device, requires_grad=True) for x in arrays[:3])
    out = nf_torch.attention(q, k, v, causal=True)
    out.backward(torch.tensor(arrays[3], device=device))
    want_out, _ = reference.attention_forward(*arrays[:3], causal=True)
    want_grads = reference.attention_backward(arrays[3], *arrays[:3], causal=True)
    np.testing.assert_allclose(out.detach().cpu().numpy(), want_out, rtol=1e-4, atol=1e-5)
    for got, want in zip((q.grad, k.grad, v.grad), want_grads):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4, atol=1e-5)


def test_deterministic_false_reaches_the_backward(device, monkeypatch):
    """deterministic goes to attention_backward (where the plan decides what it changes), checked as a bool."""
    from numbaflash import interface

    seen = []
    backward = interface.attention_backward
    monkeypatch.setattr(interface, "attention_backward", lambda *a, **kw: seen.append(kw["deterministic"]) or backward(
        *a, **kw))
    case = Case(1, 6, 6, 1, 1, 8, "float32", seed=14)
    q, k, v = (torch.tensor(x, device=device, requires_grad=True) for x in inputs(case))
    nf_torch.attention(q, k, v, deterministic=False).sum().backward()
    assert seen == [False] and q.grad.shape == q.shape
    with pytest.raises(TypeError, match="deterministic"):
        nf_torch.attention(q, k, v, deterministic="no")


def test_bfloat16_tensors_round_trip(device):
    case = Case(1, 7, 7, 1, 1, 8, "float32", seed=13)
    q, k, v = (torch.tensor(x, device=device).to(torch.bfloat16) for x in inputs(case))
    out = nf_torch.attention(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    want, _ = reference.attention_forward(*(x.float().cpu().numpy() for x in (q, k, v)))
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=2e-2)


def test_gradcheck_float64_through_the_modifications(device):
    """softcap, ALiBi, a score_mod with its derivative and a mask_mod, all at once: autograd's numerical
    gradients agree with the backward's chain rule (`numbaflash.mods`)."""
    from test_mods import prefix_lm, tempered, tempered_grad

    case = Case(1, 6, 5, 2, 1, 4, "float64", seed=14)
    q, k, v = (torch.tensor(x, device=device, requires_grad=True) for x in inputs(case))
    modifications = dict(softcap=2.0, alibi_slopes=torch.tensor([0.3, 0.7], dtype=torch.float32, device=device),
                         score_mod=tempered, score_mod_grad=tempered_grad, mask_mod=prefix_lm,
                         mod_args=(torch.tensor([2], device=device), torch.tensor([0.5, 1.5], device=device)))
    assert torch.autograd.gradcheck(lambda *a: nf_torch.attention(*a, **modifications), (q, k, v), eps=1e-6,
                                    atol=1e-8, fast_mode=device == "cpu")


def test_a_score_mod_without_its_derivative_is_refused_when_a_gradient_is_wanted(device):
    q = torch.zeros((1, 4, 1, 8), device=device, requires_grad=True)
    with pytest.raises(ValueError, match="needs score_mod_grad"):
        nf_torch.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 2)
    with torch.no_grad():
        assert nf_torch.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 2).shape == q.shape


def test_without_a_gradient_the_forward_takes_no_lse(device):
    """Under no_grad, or with no input that requires a gradient, the forward is `numbaflash.attention` without
    return_lse, whose plan may differ (`tiling.ROW_SUMS_HEADDIMS`: softcap alone at headdim 64 on Hopper): the same
    out bit for bit; with a gradient, the one with it."""
    import numbaflash

    q, k, v = (torch.tensor(x, device=device) for x in inputs(Case(1, 40, 50, 2, 1, 64, "float16", seed=3)))
    without, with_lse = numbaflash.attention(q, k, v, softcap=30.0), numbaflash.attention(q, k, v, softcap=30.0,
                                                                                         return_lse=True)[0]
    assert torch.equal(nf_torch.attention(q, k, v, softcap=30.0), without)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.no_grad():
        assert torch.equal(nf_torch.attention(*leaves, softcap=30.0), without)
    assert torch.equal(nf_torch.attention(*leaves, softcap=30.0).detach(), with_lse)


def test_varlen_matches_one_call_per_sequence(device):
    """attention_varlen's output and gradients, sequence by sequence, against attention on each sequence alone,
    with ALiBi slopes per sequence (float64: the two paths run the same kernels' arithmetic)."""
    seqlens_q, seqlens_k = (3, 6), (5, 2)
    case = Case(1, sum(seqlens_q), sum(seqlens_k), 2, 1, 4, "float64", seed=15)
    q, k, v, dout = (torch.tensor(x[0], device=device) for x in inputs(case, extra=[(1, case.seqlen_q, 2, 4)]))
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=device)
                  for n in (seqlens_q, seqlens_k))
    slopes = torch.tensor([[0.2, 0.5], [0.9, 0.1]], dtype=torch.float32, device=device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = nf_torch.attention_varlen(*leaves, cu_q, cu_k, 6, 5, causal=True, alibi_slopes=slopes)
    out.backward(dout)
    for b in range(2):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        alone = [x[s][None].clone().requires_grad_() for x, s in ((q, rows), (k, keys), (v, keys))]
        want = nf_torch.attention(*alone, causal=True, alibi_slopes=slopes[b:b + 1])
        want.backward(dout[rows][None])
        torch.testing.assert_close(out[rows], want[0], rtol=1e-12, atol=1e-12)
        for leaf, single, s in zip(leaves, alone, (rows, keys, keys)):
            torch.testing.assert_close(leaf.grad[s], single.grad[0], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_varlen_reads_unchanged_cu_seqlens_to_the_host_once(device, monkeypatch):
    """The host check of cu_seqlens copies a torch tensor again only after torch wrote to it."""
    from numbaflash import _arrays

    copies = []
    real = _arrays.to_host
    monkeypatch.setattr(_arrays, "to_host", lambda op: copies.append(op.obj) or real(op))
    q = torch.randn(9, 1, 16, device=device, dtype=torch.float16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    first = nf_torch.attention_varlen(q, q, q, cu, cu, 5, 5)
    nf_torch.attention_varlen(q, q, q, cu, cu, 5, 5)
    assert len(copies) == 1  # one tensor for both cu_seqlens, read once
    cu[1] = 5  # sequences of 5 and 4 rows now: the check must read it again
    second = nf_torch.attention_varlen(q, q, q, cu, cu, 5, 5)
    assert len(copies) == 2 and not torch.equal(first, second)
