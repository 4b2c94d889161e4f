"""FlashAttention-2: forward (its Algorithm 1) and backward (its Algorithm 2, or the two-pass variant).

Forward: the outer loop runs over query blocks, so Q_i, the output accumulator and the row statistics
stay on chip while K and V stream past; O and LSE are written once. A query block that sees no key
writes O = 0 and LSE = -inf and loads nothing.

Backward: D = rowsum(dO * O) first, then

* ``dq="accumulate"`` (the paper): one pass per key block; dQ_i is read, updated and written back to
  HBM on every visible step (atomic adds on a GPU, so not deterministic there);
* ``dq="separate"`` (numbaflash's deterministic kernels): a dK/dV pass per key block with no dQ traffic,
  then a dQ pass per query block that keeps dQ_i on chip, recomputing S and P: more arithmetic, no
  atomics, bitwise reproducible;
* ``dq="atomic"`` (numbaflash's ``deterministic=False``): the paper's pass, dQ summed in a float32
  workspace ``dQ_acc`` (zeroed first, atomic adds on a GPU), then rounded into dQ row block by row block.

With ``staged`` (numbaflash's Hopper v5 backward, whose producers copy a tile's LSE and D in bulk) the
preprocess also reads each row's LSE and writes it beside D, as ``LSE2``, which both passes read instead.
"""

import numpy as np

from .. import online_softmax
from . import common
from .common import rows, vec


def forward(h, p, blocks, ctx):
    for b, hq, hk, i, r0, r1 in p.query_blocks(blocks.rows):
        with h.step("forward", b=b, h=hq, i=i):
            key_blocks = p.visible_cols(r0, r1, blocks.rows, blocks.cols, b, hq)
            if not key_blocks:
                h.fill("O", rows(b, hq, r0, r1), 0.0)
                h.fill("LSE", vec(b, hq, r0, r1), -np.inf)
                continue
            n = r1 - r0
            qi = h.load("Q", rows(b, hq, r0, r1))
            acc = h.alloc("O_i", (n, p.headdim))
            m, l = h.alloc("m_i", (n,), -np.inf), h.alloc("l_i", (n,))
            for j, c0, c1 in key_blocks:
                with h.step("forward", b=b, h=hq, i=i, j=j):
                    kj, vj = h.load("K", rows(b, hk, c0, c1)), h.load("V", rows(b, hk, c0, c1))
                    s = h.alloc("S_ij", (n, c1 - c0))
                    if h.compute:
                        s.a[:] = common.scores(ctx, qi.a, kj.a, r0, r1, c0, c1)
                        m.a[:], l.a[:], acc.a[:] = online_softmax.update(m.a, l.a, acc.a, s.a, vj.a)
            if h.compute:
                acc.a[:], m.a[:] = online_softmax.finalize(m.a, l.a, acc.a)  # m now holds LSE
            h.store(acc, "O", rows(b, hq, r0, r1))
            h.store(m, "LSE", vec(b, hq, r0, r1))


def _probabilities(ctx, qi, kj, lse, r0, r1, c0, c1):
    """P_ij = exp(S_ij - LSE_i); a row with LSE = -inf saw no key and gets P = 0."""
    s = common.scores(ctx, qi, kj, r0, r1, c0, c1)
    return np.exp(s - common.finite_or(lse, np.inf)[:, None])


def _preprocess(h, p, blocks, staged):
    """D = rowsum(dO * O), one pass over O and dO; ``staged``: the LSE copied beside it."""
    for b, hq, _, i, r0, r1 in p.query_blocks(blocks.rows):
        with h.step("D = rowsum(dO*O)", b=b, h=hq, i=i):
            oi, doi = h.load("O", rows(b, hq, r0, r1)), h.load("dO", rows(b, hq, r0, r1))
            di = h.alloc("D_i", (r1 - r0,))
            if h.compute:
                di.a[:] = (oi.a * doi.a).sum(axis=1)
            h.store(di, "D", vec(b, hq, r0, r1))
            if staged:
                h.store(h.load("LSE", vec(b, hq, r0, r1)), "LSE2", vec(b, hq, r0, r1))


def _key_block_pass(h, p, blocks, ctx, accumulate_dq, dq_name="dQ", lse_name="LSE"):
    """For each key block: dK_j, dV_j on chip over every visible query block of the head group."""
    d = p.headdim
    for b, hk, j, c0, c1 in p.key_blocks(blocks.cols):
        with h.step("dK, dV", b=b, h_kv=hk, j=j):
            heads = range(hk * p.group, (hk + 1) * p.group)
            query_blocks = {hq: p.visible_rows(c0, c1, blocks.rows, blocks.cols, b, hq) for hq in heads}
            if not any(query_blocks.values()):
                h.fill("dK", rows(b, hk, c0, c1), 0.0)
                h.fill("dV", rows(b, hk, c0, c1), 0.0)
                continue
            kj, vj = h.load("K", rows(b, hk, c0, c1)), h.load("V", rows(b, hk, c0, c1))
            dkj, dvj = h.alloc("dK_j", (c1 - c0, d)), h.alloc("dV_j", (c1 - c0, d))
            for hq in heads:
                for i, r0, r1 in query_blocks[hq]:
                    with h.step("dK, dV", b=b, h=hq, i=i, j=j):
                        n = r1 - r0
                        qi, doi = h.load("Q", rows(b, hq, r0, r1)), h.load("dO", rows(b, hq, r0, r1))
                        lse, di = h.load(lse_name, vec(b, hq, r0, r1)), h.load("D", vec(b, hq, r0, r1))
                        dqi = h.load(dq_name, rows(b, hq, r0, r1)) if accumulate_dq else None
                        pt, ds = h.alloc("P_ij", (n, c1 - c0)), h.alloc("dS_ij", (n, c1 - c0))
                        if h.compute:
                            pt.a[:] = _probabilities(ctx, qi.a, kj.a, lse.a, r0, r1, c0, c1)
                            dvj.a[:] += pt.a.T @ doi.a
                            ds.a[:] = pt.a * (doi.a @ vj.a.T - di.a[:, None])
                            dkj.a[:] += ctx.scale * (ds.a.T @ qi.a)
                            if accumulate_dq:
                                dqi.a[:] += ctx.scale * (ds.a @ kj.a)
                        if accumulate_dq:
                            h.store(dqi, dq_name, rows(b, hq, r0, r1))
            h.store(dkj, "dK", rows(b, hk, c0, c1))
            h.store(dvj, "dV", rows(b, hk, c0, c1))


def _round_dq(h, p, blocks):
    """dQ = dQ_acc, read once and written once in the inputs' dtype."""
    for b, hq, _, i, r0, r1 in p.query_blocks(blocks.rows):
        with h.step("dQ = dQ_acc", b=b, h=hq, i=i):
            h.store(h.load("dQ_acc", rows(b, hq, r0, r1)), "dQ", rows(b, hq, r0, r1))


def _query_block_pass(h, p, blocks, ctx, lse_name="LSE"):
    """For each query block: dQ_i on chip over its visible key blocks, recomputing P and dS."""
    for b, hq, hk, i, r0, r1 in p.query_blocks(blocks.rows):
        with h.step("dQ", b=b, h=hq, i=i):
            key_blocks = p.visible_cols(r0, r1, blocks.rows, blocks.cols, b, hq)
            if not key_blocks:
                h.fill("dQ", rows(b, hq, r0, r1), 0.0)
                continue
            n = r1 - r0
            qi, doi = h.load("Q", rows(b, hq, r0, r1)), h.load("dO", rows(b, hq, r0, r1))
            lse, di = h.load(lse_name, vec(b, hq, r0, r1)), h.load("D", vec(b, hq, r0, r1))
            dqi = h.alloc("dQ_i", (n, p.headdim))
            for j, c0, c1 in key_blocks:
                with h.step("dQ", b=b, h=hq, i=i, j=j):
                    kj, vj = h.load("K", rows(b, hk, c0, c1)), h.load("V", rows(b, hk, c0, c1))
                    pt, ds = h.alloc("P_ij", (n, c1 - c0)), h.alloc("dS_ij", (n, c1 - c0))
                    if h.compute:
                        pt.a[:] = _probabilities(ctx, qi.a, kj.a, lse.a, r0, r1, c0, c1)
                        ds.a[:] = pt.a * (doi.a @ vj.a.T - di.a[:, None])
                        dqi.a[:] += ctx.scale * (ds.a @ kj.a)
            h.store(dqi, "dQ", rows(b, hq, r0, r1))


def backward(h, p, blocks, ctx, dq="accumulate", staged=False):
    _preprocess(h, p, blocks, staged)
    lse_name = "LSE2" if staged else "LSE"
    if dq in ("accumulate", "atomic"):
        name = "dQ" if dq == "accumulate" else "dQ_acc"
        with h.step("init"):
            for b in range(p.batch):
                for hq in range(p.nheads):
                    h.fill(name, rows(b, hq, 0, p.seqlen_q), 0.0)
        _key_block_pass(h, p, blocks, ctx, accumulate_dq=True, dq_name=name, lse_name=lse_name)
        if dq == "atomic":
            _round_dq(h, p, blocks)
    else:
        _key_block_pass(h, p, blocks.key_pass, ctx, accumulate_dq=False, lse_name=lse_name)
        _query_block_pass(h, p, blocks, ctx, lse_name)
