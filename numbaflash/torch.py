"""numbaflash for PyTorch: `attention` and `attention_varlen` as a ``torch.autograd.Function``.

Tensors reach the kernels without a copy (their data pointer and strides, the memory DLPack would
hand over, without needing CuPy), and the kernels run on torch's current CUDA stream. The backward
pass is numbaflash's deterministic recomputation from the saved log-sum-exp. torch is imported only
here: ``pip install numbaflash[torch]``.

CPU tensors are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), which is how this
module is tested without a GPU.
"""

import numpy as np
import torch

from . import arguments, interface, varlen
from .kernels.intrinsics import SIMULATOR


def _to_arrays(tensors):
    if all(t.is_cuda for t in tensors):
        return tensors
    if not SIMULATOR:
        raise TypeError("numbaflash.torch needs CUDA tensors (CPU tensors run only on the CUDA simulator)")
    arrays = []
    for t in tensors:
        t = t.detach()
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: hand over the bits, viewed as ml_dtypes'
            import ml_dtypes

            arrays.append(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        else:
            arrays.append(t.numpy())
    return arrays


def _to_tensors(arrays, like):
    if like.is_cuda:
        return arrays
    return tuple(torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
                 if a.dtype.name == "bfloat16" else torch.from_numpy(a) for a in arrays)


class Attention(torch.autograd.Function):
    """out = softmax(scale Q K^T + mask) V; saves q, k, v, out and the log-sum-exp for the backward.

    ``lengths``: None, or a varlen call's ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``;
    ``backward_options``: what only the backward takes (``deterministic``); ``gradient``: whether a backward may
    run (`_gradient`), else the forward takes no LSE and saves nothing."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, options, backward_options, gradient):
        ctx.options, ctx.backward_options = options, backward_options
        ctx.lengths = () if lengths is None else (*_to_arrays(lengths[:2]), *lengths[2:])
        forward = interface.attention if lengths is None else varlen.attention_varlen
        if not gradient:  # no backward will run: the LSE is not asked for (`tiling.make_plan`'s ``lse``)
            return _to_tensors((forward(*_to_arrays((q, k, v)), *ctx.lengths, **options),), q)[0]
        out, lse = _to_tensors(forward(*_to_arrays((q, k, v)), *ctx.lengths, return_lse=True, **options), q)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backward = interface.attention_backward if not ctx.lengths else varlen.attention_varlen_backward
        grads = backward(*_to_arrays((dout, q, k, v, out, lse)), *ctx.lengths, **ctx.options, **ctx.backward_options)
        return (*_to_tensors(grads, q), None, None, None, None)


def _gradient(q, k, v):
    """Whether a gradient may be asked for, so the forward keeps the LSE for the backward (inside
    ``Function.forward`` grad mode is off, and ``needs_input_grad`` follows requires_grad under no_grad too)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))


def _options(function, q, k, v, causal, softmax_scale, window_size, modifications, **more_tensors):
    """The keyword arguments of the numbaflash call, checked where torch adds something to check: every
    array a torch tensor, and a score_mod's derivative present when a gradient will be asked for."""
    tensors = [("q", q), ("k", k), ("v", v), *more_tensors.items()]
    if modifications["alibi_slopes"] is not None:
        tensors.append(("alibi_slopes", modifications["alibi_slopes"]))
    mod_args = modifications["mod_args"]
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of torch tensors; got {type(mod_args).__name__}")
    tensors += [(f"mod_args[{i}]", x) for i, x in enumerate(mod_args)]
    for name, x in tensors:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"numbaflash.torch.{function} takes torch tensors; {name} is a {type(x).__module__}."
                            f"{type(x).__name__} (use numbaflash.{function} for CuPy or NumPy arrays)")
    arguments.flag(causal, "causal")
    if modifications["score_mod"] is not None and modifications["score_mod_grad"] is None and _gradient(q, k, v):
        raise ValueError("a gradient through score_mod needs score_mod_grad(score, b, h, q_idx, kv_idx, *mod_args): "
                         "d score_mod / d score (numbaflash does not differentiate Python)")
    modified = dict(modifications, mod_args=tuple(mod_args))
    if modified["alibi_slopes"] is not None:
        modified["alibi_slopes"] = _to_arrays((modified["alibi_slopes"],))[0]
    modified["mod_args"] = tuple(_to_arrays(modified["mod_args"])) if modified["mod_args"] else ()
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=arguments.window(window_size), **modified)


def attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None, deterministic=True):
    """Differentiable `numbaflash.attention` on torch tensors; shapes, dtypes, masks and modifications as there.

    q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k, nheads_kv, headdim)``; returns
    out shaped like q. Gradients flow to q, k and v (not to alibi_slopes or mod_args); a score_mod needs
    its score_mod_grad when a gradient is asked for. ``deterministic``: as `numbaflash.attention_backward`'s.
    """
    options = _options("attention", q, k, v, causal, softmax_scale, window_size, dict(
        softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
        mask_mod=mask_mod, mod_args=mod_args))
    arguments.flag(deterministic, "deterministic")
    return Attention.apply(q, k, v, None, dict(options, block_mask=block_mask), dict(deterministic=deterministic),
                           _gradient(q, k, v))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None,
                     mask_mod=None, mod_args=()):
    """Differentiable `numbaflash.attention_varlen` on torch tensors (flash-attn's ``flash_attn_varlen_func``).

    q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_kv, headdim)``, cu_seqlens int32 tensors
    of ``num_sequences + 1`` cumulative lengths on q's device; returns out shaped like q.
    """
    options = _options("attention_varlen", q, k, v, causal, softmax_scale, window_size, dict(
        softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
        mask_mod=mask_mod, mod_args=mod_args), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return Attention.apply(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), options, {},
                           _gradient(q, k, v))
