"""Validated calls, remembered by layout: a model calls attention with a few layouts, again and again.

`interface.inspect` checks every argument of a call, and a call then plans and decides how its tiles are
staged: about a third of a small forward's host time (H100 host, `.bench/hostprof.py`). What they find
depends only on the operands' layout (kind, shape, strides, dtype, device, and address modulo 16, which
decides vector staging and the copy engine) and on the options, so for 4-D calls it is kept here, keyed by
them; a repeated layout costs a dictionary lookup and still reads each operand. Options enter the key with
their exact types, so a value the checks refuse (``causal=1``, a NaN scale) never matches one they
accepted. The modifications enter it too: softcap's value, the user's functions and the block mask by
identity, and the layout of each array they read (ALiBi's slopes, mod_args), whose operands the call
passes on (`key` describes them). Validated every time, a forward with softcap took 40 microseconds of host
time, with ALiBi 44 and with a block mask 67, against a plain call's 23; remembered, 23-34 (this project's CPU
machine, the simulator's host path with the launch stubbed: `.bench/hostmods.py`).
"""

import types
from collections import OrderedDict

from . import _arrays
from .block_sparsity import BlockMask

KEPT = 256  # layouts; the least recently used goes first


def key(ops, causal, softmax_scale, window_size, modifications, backward):
    """``(key, arrays)``: the key of a call's layout and options, or None where the call is not remembered (2-D
    operands, options of other types than the ones the checks accept), and the `_arrays.Operand`s of the
    modifications' arrays (slopes, then mod_args; None without a key)."""
    if any(len(op.shape) != 4 for op in ops):
        return None, None
    if type(causal) is not bool or not (softmax_scale is None or type(softmax_scale) is float):
        return None, None
    if type(window_size) not in (tuple, list) or len(window_size) != 2 or any(type(w) is not int for w in window_size):
        return None, None
    mods = _modifications(modifications or {}, ops[0].kind)
    if mods is None:
        return None, None
    options, arrays = mods
    layout = tuple((op.kind, op.shape, op.strides, op.dtype, op.device, op.ptr % 16) for op in ops)
    return (layout, causal, softmax_scale, tuple(window_size), backward, options), arrays


_NO_FUNCTIONS = (None, None, None)
_PLAIN = (0.0, False, _NO_FUNCTIONS, None, ())


def _modifications(modifications, kind):
    """``(options, arrays)`` for the key of `interface.MODIFICATIONS`'s keywords, or None where they are not
    remembered: a softcap that is not a float, a function that is not a plain one, arrays of another library
    than q's (the checks' messages for those come from the full validation)."""
    get = modifications.get
    softcap, slopes, mod_args, block = get("softcap", 0.0), get("alibi_slopes"), get("mod_args", ()), get("block_mask")
    functions = (get("score_mod"), get("score_mod_grad"), get("mask_mod"))
    if type(softcap) is not float or type(mod_args) is not tuple or not (block is None or type(block) is BlockMask):
        return None
    if functions == _NO_FUNCTIONS and slopes is None and block is None and not mod_args and softcap == 0.0:
        return _PLAIN, []  # the common call: nothing to describe
    if any(f is not None and type(f) is not types.FunctionType for f in functions):
        return None
    given = ((slopes,) if slopes is not None else ()) + mod_args
    if any(_arrays.library(type(x)) != kind for x in given):  # q's kind names its library (but "cai")
        return None
    try:
        arrays = [_arrays.describe(x, "") for x in given]
    except (TypeError, ValueError):  # a host torch tensor, say: the checks name it
        return None
    layouts = tuple((op.shape, op.strides, op.dtype, op.device) for op in arrays)
    return (softcap, slopes is not None, functions, block, layouts), arrays


_CALLS = OrderedDict()


def get(call_key):
    """The validated call (operands and the modifications' arrays None) kept under ``call_key``, or None."""
    if call_key is None:
        return None
    call = _CALLS.get(call_key)
    if call is not None:
        _CALLS.move_to_end(call_key)
    return call


def put(call_key, call):
    """Keep ``call`` (a template: its operands and modification arrays are dropped, so no array of the call is
    kept alive) under ``call_key``."""
    if call_key is None:
        return
    _CALLS[call_key] = call
    while len(_CALLS) > KEPT:
        _CALLS.popitem(last=False)
