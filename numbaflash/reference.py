"""Float64 NumPy attention that materializes S and P: the single source of truth.

Kernels, the IO simulator and the benchmarks all check themselves against these two functions.
They are written for clarity, not speed: every intermediate is an explicit (seqlen_q, seqlen_k) array.

Layout is flash-attn's: ``(batch, seqlen, nheads, headdim)``.

Mask alignment (bottom-right, as flash-attn >= 2.1). ``x`` is a visible score, ``.`` a hidden one.

causal, seqlen_q = 2 < seqlen_k = 5 (query i sits at key position i + 3)::

    x x x x .
    x x x x x

causal, seqlen_q = 5 > seqlen_k = 2 (the first three queries see no key: output 0, LSE -inf)::

    . .
    . .
    . .
    x .
    x x

window_size = (1, 0) with seqlen_q = seqlen_k = 4 (each query sees itself and one key before)::

    x . . .
    x x . .
    . x x .
    . . x x
"""

import numpy as np

from . import mods
from .masks import key_range, normalize_window


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Boolean ``(seqlen_q, seqlen_k)`` array: True where query row i may attend to key j."""
    left, right = normalize_window(causal, window_size)
    mask = np.zeros((seqlen_q, seqlen_k), dtype=bool)
    for row in range(seqlen_q):
        lo, hi = key_range(row, seqlen_q, seqlen_k, left, right)
        if lo < hi:
            mask[row, lo:hi] = True
    return mask


def _scores(q, k, softmax_scale, causal, window_size, modifications=None):
    """Scaled, modified, masked scores ``(batch, nheads, seqlen_q, seqlen_k)``, -inf where hidden, and the
    derivative of the modified scores by the scaled ones (`mods.modify`)."""
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / np.sqrt(headdim)
    k_per_q_head = np.repeat(k, nheads // nheads_kv, axis=2)  # (batch, seqlen_k, nheads, headdim)
    s = _heads_first(q) @ _heads_first(k_per_q_head).swapaxes(-1, -2) * softmax_scale
    modifications = dict(modifications or {})
    block = modifications.pop("block_mask", None)  # a block mask only schedules: its mask_mod is the mask
    mask_mod = modifications.pop("mask_mod", None) or (block.mask_mod if block is not None else None)
    s, ds = mods.modify(s, **modifications)
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size) & mods.visible(mask_mod, s.shape,
                                                                                  modifications.get("mod_args", ()))
    return np.where(mask, s, -np.inf), (None if ds is None else np.where(mask, ds, 0))


def _probabilities(s):
    """Row softmax of masked scores; a row with no visible key gives P = 0 and LSE = -inf."""
    row_max = s.max(axis=-1, keepdims=True)  # (batch, nheads, seqlen_q, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(s - row_max)
    row_sum = e.sum(axis=-1, keepdims=True)
    p = e / np.where(row_sum > 0, row_sum, 1.0)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]  # (batch, nheads, seqlen_q), -inf where empty
    return p, lse


def _as(precision, *arrays):
    return [np.asarray(a, dtype=precision) for a in arrays]


def _heads_first(x):
    """(batch, seqlen, nheads, headdim) -> (batch, nheads, seqlen, headdim), for batched matmul (BLAS)."""
    return x.transpose(0, 2, 1, 3)


def attention_probabilities(q, k, causal=False, softmax_scale=None, window_size=(-1, -1), precision=np.float64,
                            **modifications):
    """The attention matrix P ``(batch, nheads, seqlen_q, seqlen_k)`` (rows of zeros where no key is visible)."""
    q, k = _as(precision, q, k)
    return _probabilities(_scores(q, k, softmax_scale, causal, window_size, modifications)[0])[0]


def attention_forward(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), precision=np.float64,
                      **modifications):
    """Exact attention in float64.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; nheads is a multiple of nheads_kv (GQA/MQA),
            query head h reads key/value head ``h // (nheads // nheads_kv)``.
        causal: bottom-right aligned causal mask (see the module docstring).
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        window_size: ``(left, right)``, -1 for unbounded.
        precision: float64; ``np.longdouble`` (x86's 80-bit extended) makes a truth finer than float64
            itself, to judge float64 kernels by.
        modifications: ``softcap``, ``alibi_slopes``, ``score_mod``, ``mask_mod``, ``mod_args`` (NumPy
            arrays), as `numbaflash.attention` takes them (`numbaflash.mods`).

    Returns:
        out ``(batch, seqlen_q, nheads, headdim)`` and lse ``(batch, nheads, seqlen_q)`` in ``precision``,
        the natural log of each row's softmax denominator (``-inf`` for a row that sees no key).
    """
    q, k, v = _as(precision, q, k, v)
    s, _ = _scores(q, k, softmax_scale, causal, window_size, modifications)
    p, lse = _probabilities(s)  # p: (batch, nheads, seqlen_q, seqlen_k)
    v_per_q_head = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = _heads_first(p @ _heads_first(v_per_q_head))
    return out, lse


def attention_backward(dout, q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), precision=np.float64,
                       **modifications):
    """Gradients of `attention_forward`'s output in float64, by materializing P.

    Args:
        dout: ``(batch, seqlen_q, nheads, headdim)``, the gradient of the output.
        q, k, v, causal, softmax_scale, window_size, precision, modifications: as in `attention_forward`
            (with ``score_mod``, also ``score_mod_grad``, its derivative).

    Returns:
        dq ``(batch, seqlen_q, nheads, headdim)``, dk and dv ``(batch, seqlen_k, nheads_kv, headdim)``;
        for GQA, dk and dv sum the contributions of every query head in the group.
    """
    dout, q, k, v = _as(precision, dout, q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    group = nheads // nheads_kv
    if softmax_scale is None:
        softmax_scale = 1.0 / np.sqrt(headdim)
    s, ds_modified = _scores(q, k, softmax_scale, causal, window_size, modifications)
    p, _ = _probabilities(s)  # (batch, nheads, seqlen_q, seqlen_k)
    k_h, v_h = (_heads_first(np.repeat(x, group, axis=2)) for x in (k, v))  # (batch, nheads, seqlen_k, headdim)
    q_h, do_h = _heads_first(q), _heads_first(dout)  # (batch, nheads, seqlen_q, headdim)
    dv_h = _heads_first(p.swapaxes(-1, -2) @ do_h)  # (batch, seqlen_k, nheads, headdim)
    dp = do_h @ v_h.swapaxes(-1, -2)  # (batch, nheads, seqlen_q, seqlen_k)
    delta = (p * dp).sum(axis=-1, keepdims=True)  # rowsum(dO * O), (batch, nheads, seqlen_q, 1)
    ds = p * (dp - delta) * ds_modified * softmax_scale
    dq = _heads_first(ds @ k_h)
    dk_h = _heads_first(ds.swapaxes(-1, -2) @ q_h)
    dk = dk_h.reshape(batch, seqlen_k, nheads_kv, group, headdim).sum(axis=3)
    dv = dv_h.reshape(batch, seqlen_k, nheads_kv, group, headdim).sum(axis=3)
    return dq, dk, dv
