"""FlashAttention-1: Algorithm 1 (forward) and Algorithm 4 (backward) of the FlashAttention paper.

The outer loop runs over key/value blocks, the inner one over query blocks, so the running output
O_i and its statistics l_i, m_i go back to HBM after every inner step and come back for the next key
block. Hidden tiles are skipped; a key block no query sees is never loaded.
"""

import numpy as np

from . import common
from .common import rows, vec


def forward(h, p, blocks, ctx):
    """Algorithm 1: O, l, m initialized in HBM, then read and written back on every visible (i, j)."""
    d = p.headdim
    with h.step("init"):
        for b in range(p.batch):
            for hq in range(p.nheads):
                h.fill("O", rows(b, hq, 0, p.seqlen_q), 0.0)
                h.fill("l", vec(b, hq, 0, p.seqlen_q), 0.0)
                h.fill("m", vec(b, hq, 0, p.seqlen_q), -np.inf)
    for b in range(p.batch):
        for hq in range(p.nheads):
            hk = hq // p.group
            for j, c0, c1 in p.col_blocks(blocks.cols):
                query_blocks = p.visible_rows(c0, c1, blocks.rows, blocks.cols)
                if not query_blocks:
                    continue
                with h.step("forward", b=b, h=hq, j=j):
                    kj = h.load("K", rows(b, hk, c0, c1))
                    vj = h.load("V", rows(b, hk, c0, c1))
                    for i, r0, r1 in query_blocks:
                        with h.step("forward", b=b, h=hq, i=i, j=j):
                            _forward_step(h, b, hq, r0, r1, c0, c1, kj, vj, ctx, d)


def _forward_step(h, b, hq, r0, r1, c0, c1, kj, vj, ctx, d):
    n = r1 - r0
    qi, oi = h.load("Q", rows(b, hq, r0, r1)), h.load("O", rows(b, hq, r0, r1))
    li, mi = h.load("l", vec(b, hq, r0, r1)), h.load("m", vec(b, hq, r0, r1))
    s = h.alloc("S_ij", (n, c1 - c0))
    m_tile, l_tile = h.alloc("m~_ij", (n,)), h.alloc("l~_ij", (n,))
    m_new, l_new = h.alloc("m_new", (n,)), h.alloc("l_new", (n,))
    if h.compute:
        s.a[:] = common.scores(ctx, qi.a, kj.a, r0, r1, c0, c1)
        m_tile.a[:] = s.a.max(axis=1)
        s.a[:] = np.exp(s.a - common.finite_or(m_tile.a, 0.0)[:, None])  # P~_ij, in place
        l_tile.a[:] = s.a.sum(axis=1)
        m_new.a[:] = np.maximum(mi.a, m_tile.a)
        base = common.finite_or(m_new.a, 0.0)
        alpha, beta = np.exp(mi.a - base), np.exp(m_tile.a - base)
        l_new.a[:] = alpha * li.a + beta * l_tile.a
        # Algorithm 1 keeps O_i normalized: undo the old normalization, add the block, renormalize.
        unnorm = (alpha * li.a)[:, None] * oi.a + beta[:, None] * (s.a @ vj.a)
        oi.a[:] = unnorm / np.where(l_new.a > 0, l_new.a, 1.0)[:, None]
    h.store(oi, "O", rows(b, hq, r0, r1))
    h.store(l_new, "l", vec(b, hq, r0, r1))
    h.store(m_new, "m", vec(b, hq, r0, r1))


def backward(h, p, blocks, ctx):
    """Algorithm 4: dQ, dK, dV initialized in HBM; dQ_i read, updated and written on every visible (i, j)."""
    with h.step("init"):
        for b in range(p.batch):
            for hq in range(p.nheads):
                h.fill("dQ", rows(b, hq, 0, p.seqlen_q), 0.0)
            for hk in range(p.nheads_kv):
                h.fill("dK", rows(b, hk, 0, p.seqlen_k), 0.0)
                h.fill("dV", rows(b, hk, 0, p.seqlen_k), 0.0)
    for b, hk, j, c0, c1 in p.key_blocks(blocks.cols):
        query_blocks = p.visible_rows(c0, c1, blocks.rows, blocks.cols)
        if not query_blocks:
            continue  # dK_j = dV_j = 0 from the initialization
        with h.step("backward", b=b, h_kv=hk, j=j):
            kj, vj = h.load("K", rows(b, hk, c0, c1)), h.load("V", rows(b, hk, c0, c1))
            dkj = h.alloc("dK_j", (c1 - c0, p.headdim))
            dvj = h.alloc("dV_j", (c1 - c0, p.headdim))
            for hq in range(hk * p.group, (hk + 1) * p.group):
                for i, r0, r1 in query_blocks:
                    with h.step("backward", b=b, h=hq, i=i, j=j):
                        _backward_step(h, b, hq, r0, r1, c0, c1, kj, vj, dkj, dvj, ctx)
            h.store(dkj, "dK", rows(b, hk, c0, c1))
            h.store(dvj, "dV", rows(b, hk, c0, c1))


def _backward_step(h, b, hq, r0, r1, c0, c1, kj, vj, dkj, dvj, ctx):
    n = r1 - r0
    qi, oi = h.load("Q", rows(b, hq, r0, r1)), h.load("O", rows(b, hq, r0, r1))
    doi, dqi = h.load("dO", rows(b, hq, r0, r1)), h.load("dQ", rows(b, hq, r0, r1))
    li, mi = h.load("l", vec(b, hq, r0, r1)), h.load("m", vec(b, hq, r0, r1))
    s = h.alloc("S_ij", (n, c1 - c0))
    dp = h.alloc("dP_ij", (n, c1 - c0))
    di = h.alloc("D_i", (n,))
    if h.compute:
        s.a[:] = common.scores(ctx, qi.a, kj.a, r0, r1, c0, c1)
        # P_ij = diag(l_i)^-1 exp(S_ij - m_i); rows that saw no key have l_i = 0 and P = 0.
        s.a[:] = np.exp(s.a - common.finite_or(mi.a, 0.0)[:, None]) / np.where(li.a > 0, li.a, 1.0)[:, None]
        dvj.a[:] += s.a.T @ doi.a
        dp.a[:] = doi.a @ vj.a.T
        di.a[:] = (doi.a * oi.a).sum(axis=1)
        dp.a[:] = s.a * (dp.a - di.a[:, None])  # dS_ij, in place
        dqi.a[:] += ctx.scale * (dp.a @ kj.a)
        dkj.a[:] += ctx.scale * (dp.a.T @ qi.a)
    h.store(dqi, "dQ", rows(b, hq, r0, r1))
