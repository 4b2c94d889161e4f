"""The score and mask modifications of `numbaflash.mods`, compiled into every kernel family.

Every kernel takes one more argument, ``mod``: a tuple of what the modifications read at run time, in
this order and only those in use: a block mask's table and partial tiles' bits (`key_tiles`, or a dK/dV
pass's `query_tiles`), a varlen call's cu_seqlens_q and cu_seqlens_k (`sequences`), the softcap (the
accumulator type), the ALiBi slopes (float32 ``(1 or batch, nheads)``), then the user's ``mod_args``. A
kernel built without any takes an empty tuple, and every function here compiles to nothing.

With softcap, ALiBi or a score_mod the kernels work on natural-log scores: ``x = softmax_scale * q . k`` (the kernel's
scale argument is then ``softmax_scale`` itself, not ``softmax_scale * log2(e)``), ``logit`` modifies it,
and the softmax multiplies by log2(e) before ex2. ``mask_mod`` and ``score_mod`` see only indices inside
``[0, seqlen_q) x [0, seqlen_k)`` that the causal/window mask shows, so their ``mod_args`` are indexed in
bounds: a hidden score, or a row past the sequence, reaches a score_mod only in the tensor-core dK/dV passes
without a mask_mod, at a visible pair's indices, its result dropped (`gradients`, `masks.visible_pair`).

`modifiers` gives, as a `Modifiers`:

* ``prepare(b, h, mod)``: what the functions below read for batch element ``b`` and head ``h`` (``bh``):
  the cap and its reciprocal, the head's slope, the user's mod_args; once per head, so a score pays no
  division and no load of the slopes.
* ``prepare_staged(mod, slope)``: `prepare`'s values with the head's ALiBi slope given (v5's dK/dV consumers read
  it from the stage their producer filled, `wgmma.ws_backward`), so a tile neither loads it nor divides for its
  head.
* ``logit(x, b, h, row, key, distance, bh)``: the modified natural-log score; ``distance`` is ALiBi's
  ``|row + seqlen_k - seqlen_q - key|`` as a float, which the kernels compute per row once and offset by
  constants per element (an int-to-float conversion per score ran at an eighth of the FMA rate).
* ``logit2(s, scale, b, h, row, key, distance, bh)``: for the backwards, ``(base-2 logit, d modified / d x)`` of
  the score ``x = s * scale`` in the kernel's units (``scale`` the kernel's scale argument, or 1 for a kernel
  that staged its operands scaled): ``(x, 1)`` without modifications, where ``x`` already is a base-2 logit.
  softcap alone (`numbaflash.mods.Mods.softcap_alone`) takes ``tanh(s * (scale / cap))`` and leaves the cap for
  the exponent's FFMA with the LSE, as the forwards fold it into the softmax's scale: two instructions per score
  fewer than the chain of scale, 1 / cap, cap and log2(e) (SASS of v5's dQ and dK/dV kernels, ptxas 13.0), and
  softcap's backward went from 1.22x to 1.20x the plain one at headdim 64 and from 1.22x to 1.14x at 128 (H100,
  N = 16384, 16 heads, stream timing, .bench/cap_bwd.py, both builds in one run).
* ``visible(b, h, row, key, bh)``: ``mask_mod``'s verdict (True without one).
* ``slope(bh)``: the head's ALiBi slope (0 without ALiBi).
* ``cap(bh)``: softcap's ``(cap, 1 / cap)`` (``(1, 1)`` without), for kernels that keep softcap's scores as
  ``tanh(x / cap)`` and fold the cap into the softmax's scale.
* ``natural(x)``: ``x`` times what turns the kernel's scale units into natural ones: ln(2) without
  modified scores, 1 with (the backwards' dK = natural(scale) dS^T Q). A mask_mod alone keeps the plain
  kernel's units: it only hides scores.
"""

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import types
from numba.np.numpy_support import from_dtype

from .intrinsics import device_function, tanh_approx


@device_function
def alibi_side(rows_start, rows_end, cols_start, cols_end, cols_offset):
    """+1 if every column ``c`` of ``[cols_start, cols_end)`` has ``c + cols_offset`` at or right of every row of
    ``[rows_start, rows_end)``, -1 if at or left of it, else 0. With a score's ALiBi distance ``D = c +
    cols_offset - row`` a tile of side ``s != 0`` has ``|D| = s D``: its bias is a row term plus a column term
    (`numbaflash.mods.Mods.alibi_alone`), two FMAs a score where ``|D|`` took a multiplication, an addition and
    an FMA."""
    if rows_end - 1 <= cols_start + cols_offset:
        return 1
    if rows_start >= cols_end - 1 + cols_offset:
        return -1
    return 0


# The largest |slope / softmax_scale| whose column and row terms stay finite in float32 (2^64 times a key tile's
# columns and any sequence's rows, both below 2^32).
_GAMMA_LIMIT = np.float32(2.0 ** 64)


@device_function
def alibi_columns_units(scale, slope):
    """``(units, gamma, ok)`` of ALiBi alone's scores in a kernel whose tensor cores add each one-sided tile's
    column term (`wgmma.alibi_columns`): scores are natural-log scores over ``units``, ``gamma = slope / units``
    the bias per key in those units. ``ok``: |slope / scale| is below 2^64, so the tensor cores take one-sided
    tiles' columns in units of ``scale``; else (``scale`` 0, or a slope 2^64 times it) every tile's bias is
    formed per score in natural units (units 1), and the column operands hold zeros."""
    # without a branch, so that a kernel's loop hoists the division
    gamma = slope / (scale if scale != 0 else types.float32(1))
    ok = scale != 0 and abs(gamma) < _GAMMA_LIMIT  # False for NaN
    return (scale if ok else types.float32(1)), (gamma if ok else slope), ok


@device_function
def alibi_columns_offset(row, n_start, seqlen_q, seqlen_k):
    """How far right of ``row``'s diagonal key ``n_start`` is, as a float32 (exact below 2^24): one int64 sum and
    conversion per tile, from which `alibi_columns_side` and the row terms follow (int64 sides and row terms in
    each warp and in the kernel took 57 more instructions a warp tile, ncu, H100)."""
    return types.float32(n_start + seqlen_q - seqlen_k - row)


@device_function
def alibi_columns_side(offset, block_n):
    """`alibi_side` of a warpgroup's 64 rows and a tile of ``block_n`` keys whose first is ``offset`` right of the
    warpgroup's first row's diagonal (`alibi_columns_offset`): the side the tensor cores' column term took, which
    the kernel finds by `alibi_side` (a float offset's rounding past 2^24 cannot cross 63 or 1 - block_n)."""
    if offset >= types.float32(63):
        return 1
    if offset <= types.float32(1 - block_n):
        return -1
    return 0


def kernel_type(mods, ACC):
    """The numba type of the ``mod`` argument of a kernel accumulating in ``ACC``."""
    # A block mask's (table, bits) (`block_sparsity.BlockMask.key_tiles`), C-contiguous as it makes them, so that
    # `key_tiles` indexes them from their shapes with unsigned indices
    members = ([types.Tuple((types.Array(types.int32, 4, "C"), types.Array(types.int32, 3, "C")))]
               if mods.block_sparse else [])
    members += [types.Array(types.int32, 1, "A")] * 2 if mods.packed else []
    members += ([ACC] if mods.softcap else []) + ([types.Array(types.float32, 2, "A")] if mods.alibi else [])
    members += [types.Array(from_dtype(np.dtype(dtype)), ndim, "A") for dtype, ndim in mods.arg_types]
    return types.Tuple(tuple(members))


def values(mods, softcap, slopes, mod_args, ACC, cu_seqlens=()):
    """The ``mod`` tuple a launch passes: `kernel_type`'s members (arrays as `_arrays.Operand`s), less the
    block mask's table and bits, which each launch puts first (they depend on the plan's tiles and the pass).
    ``cu_seqlens``: a varlen call's ``(cu_seqlens_q, cu_seqlens_k)``."""
    return (tuple(cu_seqlens) + ((ACC(softcap),) if mods.softcap else ()) + ((slopes,) if mods.alibi else ())
            + tuple(mod_args))


class Modifiers(NamedTuple):
    modified: bool  # scores change: softcap, ALiBi or score_mod (the kernels then work in natural-log units)
    masked: bool  # a mask_mod hides keys: every tile's visible scores go through it
    prepare: object
    prepare_staged: object
    logit: object
    logit2: object
    visible: object
    natural: object
    cap: object
    slope: object


_REGISTERED = set()


def _user(fn):
    """The user's function as a device function (registered once, however many kernels call it)."""
    if fn not in _REGISTERED:
        device_function(fn)
        _REGISTERED.add(fn)
    return fn


@functools.lru_cache(maxsize=None)
def modifiers(mods, ACC, fast=False):
    """The `Modifiers` of `Mods` ``mods`` in kernels accumulating in ``ACC``; ``fast`` (the 16-bit tensor-core
    kernels) takes softcap's tanh from one ``tanh.approx.f32`` instead of libdevice's tanhf.

    tanh.approx's relative error (about 2^-11) is a 16-bit score's rounding error, which the naive attention
    of the same precision makes too, and on the H100 the softcap properties hold flash-attn's rule at real
    sizes. Where tanh saturates (|score| several times the cap) the naive attention's rounding of the score
    is damped by 1 - tanh^2 and tanh.approx's error is not: an emulation erring by 2^-11 on every score fails
    the LSE rule on the tests' softcap 1.5 (5x naive's error), so the rule rests on the hardware erring less
    there than its documented bound, as it does: at most 2^-16.6 relative below |x| = 2 and 2^-18.5 beyond,
    unbiased (H200, every 64th float32 in [-12, 12]; the simulator's emulation is exact). On the
    special-function unit, which also runs the softmax's ex2 and is what bounds a headdim-64 kernel, it is one
    instruction per score where ``1 - 2 / (e^(2y) + 1)`` took two (ex2 and rcp)."""
    ONE, LN2, LOG2E = ACC(1), ACC(math.log(2.0)), ACC(math.log2(math.e))
    MODIFIED, MASKED = mods.scores_modified, mods.mask_mod is not None
    ALIBI = mods.alibi
    CAPPED = mods.softcap_alone
    CAP_AT = int(mods.block_sparse) + 2 * int(mods.packed)  # in the kernel's mod tuple
    SLOPES_AT = CAP_AT + int(mods.softcap)
    SLOPE_AT = 2 * int(mods.softcap)  # in the prepared tuple, after the cap and its reciprocal
    USER_AT = SLOPE_AT + int(mods.alibi)  # in the prepared tuple
    USER_AT_KERNEL = SLOPES_AT + int(mods.alibi)
    tanh = tanh_approx if fast else math.tanh

    if mods.softcap:
        @device_function
        def cap_values(mod):
            return mod[CAP_AT], ONE / mod[CAP_AT]

        @device_function
        def softcap(x, bh):
            t = tanh(x * bh[1])
            return bh[0] * t, ONE - t * t

        @device_function
        def cap(bh):
            return bh[0], bh[1]
    else:
        @device_function
        def cap_values(mod):
            return ()

        @device_function
        def cap(bh):
            return ONE, ONE

        @device_function
        def softcap(x, bh):
            return x, ONE

    if mods.alibi:
        @device_function
        def slope_values(b, h, mod):
            slopes = mod[SLOPES_AT]
            return (ACC(slopes[b if slopes.shape[0] > 1 else 0, h]),)

        @device_function
        def alibi(x, distance, bh):
            return x - bh[SLOPE_AT] * distance

        @device_function
        def slope(bh):
            return bh[SLOPE_AT]
    else:
        @device_function
        def slope_values(b, h, mod):
            return ()

        @device_function
        def alibi(x, distance, bh):
            return x

        @device_function
        def slope(bh):
            return ACC(0)

    if mods.active:
        @device_function
        def prepare(b, h, mod):
            return cap_values(mod) + slope_values(b, h, mod) + mod[USER_AT_KERNEL:]

        @device_function
        def prepare_staged(mod, slope):
            return cap_values(mod) + ((ACC(slope),) if ALIBI else ()) + mod[USER_AT_KERNEL:]
    else:
        @device_function
        def prepare(b, h, mod):
            return ()

        @device_function
        def prepare_staged(mod, slope):
            return ()

    if mods.score_mod is not None:
        score_mod = _user(mods.score_mod)
        score_mod_grad = _user(mods.score_mod_grad) if mods.score_mod_grad is not None else None

        @device_function
        def user_score(x, b, h, row, key, bh):
            return ACC(score_mod(x, b, h, row, key, *bh[USER_AT:]))

        if score_mod_grad is not None:
            @device_function
            def user_grad(x, b, h, row, key, bh):
                return (ACC(score_mod(x, b, h, row, key, *bh[USER_AT:])),
                        ACC(score_mod_grad(x, b, h, row, key, *bh[USER_AT:])))
        else:
            @device_function
            def user_grad(x, b, h, row, key, bh):  # forward-only kernels never call it
                return ACC(score_mod(x, b, h, row, key, *bh[USER_AT:])), ONE
    else:
        @device_function
        def user_score(x, b, h, row, key, bh):
            return x

        @device_function
        def user_grad(x, b, h, row, key, bh):
            return x, ONE

    if mods.mask_mod is not None:
        mask_mod = _user(mods.mask_mod)

        @device_function
        def visible(b, h, row, key, bh):
            return mask_mod(b, h, row, key, *bh[USER_AT:])
    else:
        @device_function
        def visible(b, h, row, key, bh):
            return True

    @device_function
    def logit(x, b, h, row, key, distance, bh):
        x, _ = softcap(x, bh)
        return user_score(alibi(x, distance, bh), b, h, row, key, bh)

    @device_function
    def logit_grad(x, b, h, row, key, distance, bh):
        x, dcap = softcap(x, bh)
        x, duser = user_grad(alibi(x, distance, bh), b, h, row, key, bh)
        return x, dcap * duser

    @device_function
    def logit2(s, scale, b, h, row, key, distance, bh):
        if CAPPED:  # tanh(s scale / cap) (one product: scale / cap is the loop's), the cap in the LSE's FFMA
            t = tanh(s * (scale * bh[1]))
            return t * (bh[0] * LOG2E), ONE - t * t
        if MODIFIED:
            y, grad = logit_grad(s * scale, b, h, row, key, distance, bh)
            return y * LOG2E, grad
        return s * scale, ONE

    @device_function
    def natural(x):
        return x if MODIFIED else x * LN2

    return Modifiers(MODIFIED, MASKED, prepare, prepare_staged, logit, logit2, visible, natural, cap, slope)
