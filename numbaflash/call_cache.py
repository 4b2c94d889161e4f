"""Validated calls, remembered by layout: a model calls attention with a few layouts, again and again.

`interface.inspect` checks every argument of a call, and a call then plans and decides how its tiles are
staged: about a third of a small forward's host time (H100 host, `.bench/hostprof.py`). What they find
depends only on the operands' layout (kind, shape, strides, dtype, device, and address modulo 16, which
decides vector staging and the copy engine) and on the options, so for 4-D calls without modifications it
is kept here, keyed by them; a repeated layout costs a dictionary lookup and still reads each operand.
Options enter the key with their exact types, so a value the checks refuse (``causal=1``, a NaN scale)
never matches one they accepted.
"""

from collections import OrderedDict

KEPT = 256  # layouts; the least recently used goes first


def key(ops, causal, softmax_scale, window_size, modifications, backward):
    """The key of a call's layout and options, or None where the call is not remembered (modifications,
    2-D operands, options of other types than the plain ones)."""
    if any(len(op.shape) != 4 for op in ops) or not _plain(modifications or {}):
        return None
    if type(causal) is not bool or not (softmax_scale is None or type(softmax_scale) is float):
        return None
    if type(window_size) not in (tuple, list) or len(window_size) != 2 or any(type(w) is not int for w in window_size):
        return None
    layout = tuple((op.kind, op.shape, op.strides, op.dtype, op.device, op.ptr % 16) for op in ops)
    return layout, causal, softmax_scale, tuple(window_size), backward


def _plain(modifications):
    """Whether ``modifications`` (`interface.MODIFICATIONS`'s keywords) are all off, as given by default."""
    get = modifications.get
    softcap, mod_args = get("softcap", 0.0), get("mod_args", ())
    return (get("alibi_slopes") is None and get("score_mod") is None and get("score_mod_grad") is None
            and get("mask_mod") is None and get("block_mask") is None and type(softcap) is float and softcap == 0.0
            and type(mod_args) is tuple and not mod_args)


_CALLS = OrderedDict()


def get(call_key):
    """The validated call (operands None) kept under ``call_key``, or None."""
    if call_key is None:
        return None
    call = _CALLS.get(call_key)
    if call is not None:
        _CALLS.move_to_end(call_key)
    return call


def put(call_key, call):
    """Keep ``call`` (a template: its operands are dropped, so no array is kept alive) under ``call_key``."""
    if call_key is None:
        return
    _CALLS[call_key] = call
    while len(_CALLS) > KEPT:
        _CALLS.popitem(last=False)
