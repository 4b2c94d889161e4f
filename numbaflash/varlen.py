"""Packed variable-length batches: `attention_varlen` and `attention_varlen_backward`, in flash-attn's layout.

q is ``(total_q, nheads, headdim)`` and k, v ``(total_k, nheads_kv, headdim)``; sequence ``b`` is
``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` attending to ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``. A call
equals one `numbaflash.attention` call per sequence: masks aligned bottom-right within each sequence,
ALiBi distances and the user's ``q_idx``, ``kv_idx`` local to it, ``b`` its index (``alibi_slopes`` may be
``(num_sequences, nheads)``). It runs as one launch per kernel, whose grid covers the longest sequence: each
block narrows the operands to its own sequence (`kernels.sequences`) and returns at once past its end, so no
sequence is padded and no work is spent on padding.
"""

import dataclasses
import weakref
from typing import NamedTuple

import numpy as np

from . import _arrays, arguments, interface, tiling

_NAMES = ("cu_seqlens_q", "cu_seqlens_k")


@dataclasses.dataclass
class _Packed:
    """A validated varlen call: the `interface.Call` the kernels run (batch = number of sequences, seqlens =
    the longest ones), its operands with a stride-0 batch axis, and the packed totals."""

    call: interface.Call
    total_q: int
    total_k: int


class _Lengths(NamedTuple):
    """What the checks need of a cu_seqlens array, read once on the host."""

    first: int
    last: int
    never_decreasing: bool
    longest: int  # the longest sequence
    head: str  # its first entries, for a message


def _read_lengths(op):
    cu = _arrays.to_host(op).astype(np.int64)
    lengths = np.diff(cu)
    head = f"{cu[:4].tolist()}{' ...' if len(cu) > 4 else ''}"
    return _Lengths(int(cu[0]), int(cu[-1]), bool((lengths >= 0).all()), int(lengths.max()), head)


# cu_seqlens already read, by id: (weak reference, torch's version counter, `_Lengths`). A model passes the same
# cu_seqlens to every layer, forward and backward; a torch tensor whose version counter has not moved holds the
# same values (unless written behind torch's back, through another library's view of its memory), so only its first
# call pays the copy and its synchronization (5-30% of a short call on the H100) and the checks' NumPy reductions.
_READ = {}


def _lengths(op):
    x = op.obj
    version = getattr(x, "_version", None) if op.kind == "torch" else None
    if version is None:
        return _read_lengths(op)
    entry = _READ.get(id(x))
    if entry is not None and entry[0]() is x and entry[1] == version:
        return entry[2]
    lengths = _read_lengths(op)
    _READ[id(x)] = (weakref.ref(x, lambda _, key=id(x): _READ.pop(key, None)), version, lengths)
    return lengths


# Longest-sequence pairs remembered per layout of the packed views (`_packed_memo`); past it, the pairs start over.
_PAIRS_KEPT = 64


def _packed_memo(memo, seqlen_q, seqlen_k):
    """What a varlen call remembers (`interface.Call.memo`): the share of its views' layout ``memo`` for its longest
    sequences. The views' shapes show the packed totals, not the longest sequences, which the plan's grid covers: a
    call of the same layout with a longer sequence took the plan remembered for a shorter one, and its rows past
    that one's length were never computed."""
    if memo is None:
        return None
    pairs = memo.setdefault("packed", {})
    if (seqlen_q, seqlen_k) not in pairs and len(pairs) >= _PAIRS_KEPT:
        pairs.clear()
    return pairs.setdefault((seqlen_q, seqlen_k), {})


def _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, totals):
    """The cu_seqlens as Operands and the number of sequences; each checked on the host (a small copy):
    int32, 1-D, equal lengths >= 2, from 0, non-decreasing, ending at its total; max_seqlen at least the
    longest sequence (the grid covers max_seqlen: a shorter one would leave rows uncomputed)."""
    ops = []
    for x, name, total, longest in zip((cu_seqlens_q, cu_seqlens_k), _NAMES, totals, (max_seqlen_q, max_seqlen_k)):
        if isinstance(x, np.ndarray) != (q.kind == "numpy"):
            raise TypeError(f"{name} must be an array of the same kind as q ({q.kind}); got "
                            f"{type(x).__module__}.{type(x).__name__}")
        op = _arrays.describe(x, name)
        if op.device != q.device:
            raise ValueError(f"{name} is on device {op.device}, q on device {q.device}: put them on one device")
        if op.dtype != "int32" or len(op.shape) != 1 or op.shape[0] < 2:
            raise ValueError(f"{name} must be int32 of shape (num_sequences + 1,), at least 2 entries (flash-attn's "
                             f"cumulative lengths); got {op.dtype} of shape {op.shape}")
        cu = _lengths(op)
        if cu.first != 0 or not cu.never_decreasing or cu.last != total:
            raise ValueError(f"{name} must start at 0, never decrease, and end at the packed length {total}; "
                             f"got {cu.head} ending at {cu.last}")
        name_max = "max_seqlen_" + name[-1]
        arguments.positive_int(longest, name_max)
        if longest < cu.longest:
            raise ValueError(f"{name_max} ({longest}) is shorter than the longest sequence in {name} "
                             f"({cu.longest}); pass at least that")
        ops.append(op)
    if ops[0].shape != ops[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence plus one, the same number; "
                         f"got shapes {ops[0].shape} and {ops[1].shape}")
    return ops, ops[0].shape[0] - 1


def _inspect(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
             modifications, backward=False):
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(getattr(x, "shape", ())) != 3:
            raise ValueError(f"{name} must be 3-D, packed sequences (total_{'q' if name == 'q' else 'k'}, nheads, "
                             f"headdim) as in flash-attn's varlen functions; got shape {tuple(getattr(x, 'shape', ()))}")
    ops = interface.describe_operands(q, k, v)
    totals = (ops[0].shape[0], ops[1].shape[0])
    cu_ops, batch = _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ops[0], totals)
    views = [_arrays.batch_operand(op, batch) for op in ops]
    call = interface.inspect_operands(views, causal, softmax_scale, window_size, modifications=modifications,
                                      backward=backward)
    # The grid covers max_seqlen, but no sequence is longer than its packed total: a larger bound (flash-attn takes
    # any) would launch blocks that all return at once, up to a grid the GPU refuses.
    call.seqlen_q, call.seqlen_k = min(int(max_seqlen_q), totals[0]), min(int(max_seqlen_k), totals[1])
    call.memo = _packed_memo(call.memo, call.seqlen_q, call.seqlen_k)
    call.mods = call.remembered("packed mods", lambda: dataclasses.replace(call.mods, packed=True))
    call.mod_values = tuple(cu_ops) + call.mod_values  # `kernels.mods.values`'s order
    return _Packed(call, *totals)


def _modifications(softcap, alibi_slopes, score_mod, score_mod_grad, mask_mod, mod_args):
    return dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
                mask_mod=mask_mod, mod_args=mod_args)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), return_lse=False, plan=None, softcap=0.0,
                     alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=()):
    """`numbaflash.attention` on packed sequences of different lengths (flash-attn's ``flash_attn_varlen_func``).

    Args:
        q: ``(total_q, nheads, headdim)``, the sequences' query rows one after another.
        k, v: ``(total_k, nheads_kv, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(num_sequences + 1,)``, of q's kind and device: sequence ``b`` is
            rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and likewise of k, v). Checked on the host,
            which copies them there (a synchronization on the GPU; a torch tensor is copied again only
            once torch has written to it).
        max_seqlen_q, max_seqlen_k: at least the longest sequence's lengths (the grid covers them, or the packed
            totals where those are shorter).
        plan: ``numbaflash.tiling.make_plan(num_sequences, nheads, nheads_kv, max_seqlen_q, max_seqlen_k,
            headdim, dtype, tiles=..., packed=True)``, to choose the kernel's blocks explicitly.
        causal, softmax_scale, window_size, return_lse, softcap, alibi_slopes, score_mod, score_mod_grad,
            mask_mod, mod_args: as in `numbaflash.attention`, per sequence: masks and ALiBi are aligned
            bottom-right in each sequence, the user's functions get the sequence's index as ``b`` and
            indices local to it, and ``alibi_slopes`` may be ``(num_sequences, nheads)``. Block masks are
            not taken: a packed batch already skips every tile between sequences.

    Returns:
        out ``(total_q, nheads, headdim)``; with ``return_lse`` also lse ``(nheads, total_q)`` (flash-attn's
        varlen layout), float32 (float64 for float64 inputs).
    """
    arguments.flag(return_lse, "return_lse")
    packed = _inspect(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      window_size, _modifications(softcap, alibi_slopes, score_mod, score_mod_grad, mask_mod, mod_args))
    call = packed.call
    with interface._device_context(call):
        plan = (interface._check_plan(plan, call, "forward", lse=return_lse) if plan is not None
                else interface._plan_for(call, backward=False, lse=return_lse))
        out = _arrays.output(call.q, (packed.total_q, call.nheads, call.headdim), call.dtype, "out")
        lse = _arrays.output(call.q, (call.nheads, packed.total_q), call.lse_dtype, "lse")
        interface.run_forward(call, plan, *(_arrays.batch_operand(x, call.batch) for x in (out, lse)))
    return (out.obj, lse.obj) if return_lse else out.obj


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), plan=None):
    """Gradients of `attention_varlen`, deterministic, as `numbaflash.attention_backward`.

    Args:
        dout: ``(total_q, nheads, headdim)``, the gradient of out.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k and the options: as passed to
            `attention_varlen`; out, lse: its outputs (``return_lse=True``).
        plan: ``numbaflash.tiling.make_plan(..., backward=True, tiles=..., packed=True)``, as for
            `attention_varlen`.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v.
    """
    packed = _inspect(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      window_size, _modifications(softcap, alibi_slopes, score_mod, score_mod_grad, mask_mod, mod_args),
                      backward=True)
    call = packed.call
    q_shape = (packed.total_q, call.nheads, call.headdim)
    dout_op, out_op, lse_op = (_arrays.describe(x, name) for x, name in ((dout, "dout"), (out, "out"), (lse, "lse")))
    for op, name in ((dout_op, "dout"), (out_op, "out")):
        interface.check_array(op, name, "match q", q_shape, call.dtype, call)
    want_lse = (call.nheads, packed.total_q)
    interface.check_array(lse_op, "lse", "be attention_varlen's log-sum-exp", want_lse, call.lse_dtype, call)
    with interface._device_context(call):
        plan = (interface._check_plan(plan, call, "backward") if plan is not None
                else interface._plan_for(call, backward=True))
        k_shape = (packed.total_k, call.nheads_kv, call.headdim)
        dq, dk, dv = (_arrays.output(call.q, shape, call.dtype, name)
                      for shape, name in ((q_shape, "dq"), (k_shape, "dk"), (k_shape, "dv")))
        if plan.staged_statistics:  # v5: a staged preprocess locates each sequence's rows itself
            delta_op = _arrays.output(call.q, tiling.packed_delta_shape(plan, packed.total_q), call.lse_dtype, "delta")
            preprocess = None
        else:  # the preprocess works row by row: the packed rows as one batch element
            delta = _arrays.output(call.q, want_lse, call.lse_dtype, "delta")
            preprocess = (*(_arrays.batch_operand(x, 1) for x in (out_op, dout_op, delta)),
                          tiling.preprocess_grid(packed.total_q, call.nheads, 1))
            delta_op = _arrays.batch_operand(delta, call.batch)
        views = [_arrays.batch_operand(x, call.batch) for x in (dout_op, lse_op, out_op, dq, dk, dv)]
        interface.run_backward(call, plan, *views[:3], delta_op, *views[3:], preprocess)
    return dq.obj, dk.obj, dv.obj
