"""What the schedules share: HBM index helpers and the masked score tile."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Context:
    """Per-run constants: the softmax scale and, when computing, the (seqlen_q, seqlen_k) visibility mask."""

    scale: float
    mask: np.ndarray = None


def rows(b, h, r0, r1):
    """Rows [r0, r1) of head h in a (batch, seqlen, nheads, headdim) tensor: a (rows, headdim) tile."""
    return (b, slice(r0, r1), h, slice(None))


def block(b, h, r0, r1, c0, c1):
    """Block [r0, r1) x [c0, c1) of head h in a (batch, nheads, seqlen_q, seqlen_k) score tensor."""
    return (b, h, slice(r0, r1), slice(c0, c1))


def vec(b, h, r0, r1):
    """Entries [r0, r1) of head h in a (batch, nheads, seqlen_q) row statistic (LSE, l, m, D)."""
    return (b, h, slice(r0, r1))


def scores(ctx, q_tile, k_tile, r0, r1, c0, c1):
    """scale * Q_i K_j^T with hidden scores set to -inf."""
    s = ctx.scale * (q_tile @ k_tile.T)
    return np.where(ctx.mask[r0:r1, c0:c1], s, -np.inf)


def finite_or(x, fallback):
    """Row statistics of rows that have seen no key yet are -inf; use ``fallback`` as their base."""
    return np.where(np.isfinite(x), x, fallback)
