"""numbaflash for PyTorch: `attention` as a ``torch.autograd.Function``.

Tensors reach the kernels without a copy (their data pointer and strides, the memory DLPack would
hand over, without needing CuPy), and the kernels run on torch's current CUDA stream. The backward
pass is numbaflash's deterministic recomputation from the saved log-sum-exp. torch is imported only
here: ``pip install numbaflash[torch]``.

CPU tensors are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), which is how this
module is tested without a GPU.
"""

import numpy as np
import torch

from . import arguments, interface
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
    """out = softmax(scale Q K^T + mask) V; saves q, k, v, out and the log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_size):
        out, lse = _to_tensors(interface.attention(*_to_arrays((q, k, v)), causal=causal, softmax_scale=softmax_scale,
                                                   window_size=window_size, return_lse=True), q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = interface.attention_backward(*_to_arrays((dout, q, k, v, out, lse)), **ctx.options)
        return (*_to_tensors(grads, q), None, None, None)


def attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1)):
    """Differentiable `numbaflash.attention` on torch tensors; shapes, dtypes and masks as there.

    q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k, nheads_kv, headdim)``; returns
    out shaped like q. Gradients flow to q, k and v.
    """
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"numbaflash.torch.attention takes torch tensors; {name} is a {type(x).__module__}."
                            f"{type(x).__name__} (use numbaflash.attention for CuPy or NumPy arrays)")
    return Attention.apply(q, k, v, causal, softmax_scale, arguments.window(window_size))
