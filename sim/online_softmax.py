"""The online-softmax recurrence on NumPy tiles, as FlashAttention-2's forward pass runs it.

For each block of scores the running max ``m`` may grow; everything accumulated against the old max
is rescaled by ``alpha = exp(m_old - m_new)`` before the block is added, and the division by the
running sum ``l`` waits until the last block. With a ``threshold`` the max moves only where a block's
exceeds it by more than that, as the tensor-core kernels do (FlashAttention-4's conditional rescaling): the
exponentials then reach up to ``exp(threshold)``, and the result is the same, since ``m``, ``l`` and ``acc``
keep one reference point.
"""

import numpy as np


def update(m, l, acc, s, v, threshold=0.0):
    """Fold one tile into the running state.

    Args:
        m, l: ``(rows,)`` running max and running sum (start at -inf and 0).
        acc: ``(rows, headdim)`` unnormalized output accumulator (starts at 0).
        s: ``(rows, cols)`` scores of this tile, -inf where hidden.
        v: ``(cols, headdim)`` values of this tile.
        threshold: how far (natural log) a row's tile max must exceed ``m`` to move it; the kernels' is 8 in
            base 2 (`numbaflash.kernels.softmax.RESCALE_LOG2`).

    Returns the new ``(m, l, acc)``.
    """
    m_tile = np.maximum(m, s.max(axis=1))
    with np.errstate(invalid="ignore"):  # -inf - -inf: a row that has seen only hidden scores keeps m = -inf
        m_new = np.where(m_tile - m > threshold, m_tile, m)  # +inf at a row's first visible score: it moves
    # A row that has seen only hidden scores keeps m = -inf; exponentiate it against 0 so that
    # exp(-inf - base) gives 0 instead of exp(-inf + inf) = nan.
    base = np.where(np.isfinite(m_new), m_new, 0.0)
    p = np.exp(s - base[:, None])  # (rows, cols)
    alpha = np.exp(m - base)  # (rows,): rescales everything summed against the old max
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v


def finalize(m, l, acc):
    """The one normalization at the end: output rows ``acc / l`` and ``LSE = m + log l``.

    A row that saw no key (``l == 0``) gets output 0 and LSE -inf.
    """
    seen = l > 0
    out = acc / np.where(seen, l, 1.0)[:, None]
    lse = np.full(m.shape, -np.inf)
    lse[seen] = m[seen] + np.log(l[seen])
    return out, lse
