"""numbaflash: exact FlashAttention in Python with Numba CUDA kernels.

``attention``, ``plan`` and ``explain`` import numba on first use, so a program can still choose the
CUDA simulator (NUMBA_ENABLE_CUDASIM=1) after ``import numbaflash``.
"""

import importlib

from .reference import attention_backward as reference_backward
from .reference import attention_forward as reference_forward

_LAZY = {
    "attention": "interface",
    "attention_backward": "interface",
    "explain": "interface",
    "plan": "interface",
    "attention_varlen": "varlen",
    "attention_varlen_backward": "varlen",
    "Plan": "tiling",
    "Device": "tiling",
    "block_mask": "block_sparsity",
    "BlockMask": "block_sparsity",
}

__all__ = ["reference_forward", "reference_backward", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
