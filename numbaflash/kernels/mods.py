"""The score and mask modifications of `numbaflash.mods`, compiled into every kernel family.

A kernel built with an active `Mods` takes one more argument, ``mod``: a tuple of what the
modifications read at run time, in this order and only those in use: the softcap (the accumulator
type), the ALiBi slopes (float32 ``(1 or batch, nheads)``), then the user's ``mod_args``. A kernel
built without takes an empty tuple, and every function here compiles to nothing.

With modifications the kernels work on natural-log scores: ``x = softmax_scale * q . k`` (the kernel's
scale argument is then ``softmax_scale`` itself, not ``softmax_scale * log2(e)``), ``logit`` modifies it,
and the softmax multiplies by log2(e) before ex2. A hidden score, or a row past the sequence, never
reaches the user's function: ``mask_mod`` and ``score_mod`` see only indices inside ``[0, seqlen_q) x
[0, seqlen_k)`` that the causal/window mask shows, so their ``mod_args`` are indexed in bounds.

`modifiers` gives, as a `Modifiers`:

* ``logit(x, b, h, row, key, offset, mod)``: the modified natural-log score (``offset = seqlen_k - seqlen_q``).
* ``logit2(x, b, h, row, key, offset, mod)``: for the backwards, ``(base-2 logit, d modified / d x)`` of a
  score ``x`` in the kernel's units (``s * scale`` with the kernel's scale argument): ``(x, 1)`` without
  modifications, where ``x`` already is a base-2 logit.
* ``visible(b, h, row, key, mod)``: ``mask_mod``'s verdict (True without one).
* ``natural(x)``: ``x`` times what turns the kernel's scale units into natural ones: ln(2) without
  modifications, 1 with (the backwards' dK = natural(scale) dS^T Q).
"""

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import types
from numba.np.numpy_support import from_dtype

from .intrinsics import device_function


def kernel_type(mods, ACC):
    """The numba type of the ``mod`` argument of a kernel accumulating in ``ACC``."""
    members = ([ACC] if mods.softcap else []) + ([types.Array(types.float32, 2, "A")] if mods.alibi else [])
    members += [types.Array(from_dtype(np.dtype(dtype)), ndim, "A") for dtype, ndim in mods.arg_types]
    return types.Tuple(tuple(members))


def values(mods, softcap, slopes, mod_args, ACC):
    """The ``mod`` tuple a launch passes: `kernel_type`'s members (arrays as `_arrays.Operand`s)."""
    if not mods.active:
        return ()
    return (((ACC(softcap),) if mods.softcap else ()) + ((slopes,) if mods.alibi else ()) + tuple(mod_args))


class Modifiers(NamedTuple):
    active: bool
    logit: object
    logit2: object
    visible: object
    natural: object


_REGISTERED = set()


def _user(fn):
    """The user's function as a device function (registered once, however many kernels call it)."""
    if fn not in _REGISTERED:
        device_function(fn)
        _REGISTERED.add(fn)
    return fn


@functools.lru_cache(maxsize=None)
def modifiers(mods, ACC):
    """The `Modifiers` of `Mods` ``mods`` in kernels accumulating in ``ACC``."""
    ONE, LN2, LOG2E = ACC(1), ACC(math.log(2.0)), ACC(math.log2(math.e))
    MODIFIED = mods.active
    SOFTCAP_AT = 0
    SLOPES_AT = SOFTCAP_AT + int(mods.softcap)
    USER_AT = SLOPES_AT + int(mods.alibi)

    if mods.softcap:
        @device_function
        def softcap(x, mod):
            cap = mod[SOFTCAP_AT]
            t = math.tanh(x / cap)
            return cap * t, ONE - t * t
    else:
        @device_function
        def softcap(x, mod):
            return x, ONE

    if mods.alibi:
        @device_function
        def alibi(x, b, h, row, key, offset, mod):
            slopes = mod[SLOPES_AT]
            slope = slopes[b if slopes.shape[0] > 1 else 0, h]
            return x - ACC(slope) * ACC(abs(row + offset - key))
    else:
        @device_function
        def alibi(x, b, h, row, key, offset, mod):
            return x

    if mods.score_mod is not None:
        score_mod = _user(mods.score_mod)
        score_mod_grad = _user(mods.score_mod_grad) if mods.score_mod_grad is not None else None

        @device_function
        def user_score(x, b, h, row, key, mod):
            return ACC(score_mod(x, b, h, row, key, *mod[USER_AT:]))

        if score_mod_grad is not None:
            @device_function
            def user_grad(x, b, h, row, key, mod):
                return ACC(score_mod(x, b, h, row, key, *mod[USER_AT:])), ACC(score_mod_grad(x, b, h, row, key,
                                                                                             *mod[USER_AT:]))
        else:
            @device_function
            def user_grad(x, b, h, row, key, mod):  # forward-only kernels never call it
                return ACC(score_mod(x, b, h, row, key, *mod[USER_AT:])), ONE
    else:
        @device_function
        def user_score(x, b, h, row, key, mod):
            return x

        @device_function
        def user_grad(x, b, h, row, key, mod):
            return x, ONE

    if mods.mask_mod is not None:
        mask_mod = _user(mods.mask_mod)

        @device_function
        def visible(b, h, row, key, mod):
            return mask_mod(b, h, row, key, *mod[USER_AT:])
    else:
        @device_function
        def visible(b, h, row, key, mod):
            return True

    @device_function
    def logit(x, b, h, row, key, offset, mod):
        x, _ = softcap(x, mod)
        return user_score(alibi(x, b, h, row, key, offset, mod), b, h, row, key, mod)

    @device_function
    def logit_grad(x, b, h, row, key, offset, mod):
        x, dcap = softcap(x, mod)
        x, duser = user_grad(alibi(x, b, h, row, key, offset, mod), b, h, row, key, mod)
        return x, dcap * duser

    @device_function
    def logit2(x, b, h, row, key, offset, mod):
        if MODIFIED:
            y, grad = logit_grad(x, b, h, row, key, offset, mod)
            return y * LOG2E, grad
        return x, ONE

    @device_function
    def natural(x):
        return x if MODIFIED else x * LN2

    return Modifiers(MODIFIED, logit, logit2, visible, natural)

