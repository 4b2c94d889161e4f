"""Standard attention: Algorithm 0 (forward) and Algorithm 3 (backward) of the FlashAttention paper.

Every N x N intermediate (S, P in the forward; dP, dS in the backward) goes to HBM and comes back.
The matrix products are library GEMMs, tiled here in B_r x B_c output blocks that fit in SRAM. A GEMM
re-reads its operand panels for every output tile; a real GEMM serves those re-reads on chip and
Algorithm 0 counts each operand once, so operands are loaded with ``reuse=True``: charged on first
touch in the pass, listed as uncharged after. This is the standard algorithm's best case; its
traffic is then exactly 4 N^2 + 4 N d forward and 7 N^2 + 8 N d backward, whatever M.

The row-wise passes (softmax, and dS = P * (dP - rowsum(P * dP))) hold whole rows in SRAM.
"""

import numpy as np

from . import common
from .common import block, rows


def _gemm_tiles(h, p, blocks, phase, a_name, b_name, out_name, compute_tile):
    """out[b, h, i, j] = compute_tile(A_i, B_j): A_i resident along the row, B_j charged once per pass.

    A is indexed by the query head and B by its key/value head.
    """
    with h.phase(phase):
        for b, hq, hk, i, r0, r1 in p.query_blocks(blocks.rows):
            with h.step(phase, b=b, h=hq, i=i):
                a_tile = h.load(a_name, rows(b, hq, r0, r1), reuse=True)
                for j, c0, c1 in p.col_blocks(blocks.cols):
                    with h.step(phase, b=b, h=hq, i=i, j=j):
                        b_tile = h.load(b_name, rows(b, hk, c0, c1), reuse=True)
                        out = h.alloc(f"{out_name}_ij", (r1 - r0, c1 - c0))
                        if h.compute:
                            out.a[:] = compute_tile(a_tile.a, b_tile.a, r0, r1, c0, c1)
                        h.store(out, out_name, block(b, hq, r0, r1, c0, c1))


def _rowwise(h, p, rows_per_step, phase, inputs, output, compute_rows):
    """Load whole rows of the N x N inputs, transform them in SRAM (in place), write one N x N output."""
    with h.phase(phase):
        for b in range(p.batch):
            for hq in range(p.nheads):
                for r0 in range(0, p.seqlen_q, rows_per_step):
                    r1 = min(r0 + rows_per_step, p.seqlen_q)
                    with h.step(phase, b=b, h=hq, i=r0 // rows_per_step):
                        tiles = [h.load(name, block(b, hq, r0, r1, 0, p.seqlen_k)) for name in inputs]
                        if h.compute:
                            tiles[0].a[:] = compute_rows(*(t.a for t in tiles))
                        h.store(tiles[0], output, block(b, hq, r0, r1, 0, p.seqlen_k))


def _accumulate(h, p, phase, out_name, out_heads, outer, steps, update):
    """Each output block = sum over its steps of update(tiles); written once.

    ``outer`` is ``(coordinate name, blocks)``; ``steps(b, head, o0, o1)`` yields, per step, its ledger
    coordinates and the ``(tensor, index, reuse)`` loads it needs.
    """
    name, outer_blocks = outer
    with h.phase(phase):
        for b in range(p.batch):
            for head in range(out_heads):
                for o, o0, o1 in outer_blocks:
                    with h.step(phase, b=b, h=head, **{name: o}):
                        acc = h.alloc(f"{out_name}_acc", (o1 - o0, p.headdim))
                        for coords, loads in steps(b, head, o0, o1):
                            with h.step(phase, b=b, h=head, **{name: o}, **coords):
                                tiles = [h.load(t, ix, reuse=reuse) for t, ix, reuse in loads]
                                if h.compute:
                                    acc.a[:] += update(*(t.a for t in tiles))
                        h.store(acc, out_name, rows(b, head, o0, o1))


def _over_keys(p, blocks, n_by_n, operand):
    """Steps of a query block: every key block j, loading n_by_n[i, j] and operand_j (a K/V tile)."""
    def steps(b, hq, r0, r1):
        for j, c0, c1 in p.col_blocks(blocks.cols):
            yield {"j": j}, [(n_by_n, block(b, hq, r0, r1, c0, c1), False), (operand, rows(b, hq // p.group, c0, c1), True)]
    return steps


def _over_queries(p, blocks, n_by_n, operand):
    """Steps of a key block of kv head hk: every query block of every query head in its group."""
    def steps(b, hk, c0, c1):
        for hq in range(hk * p.group, (hk + 1) * p.group):
            for i, r0, r1 in p.row_blocks(blocks.rows):
                yield {"h_q": hq, "i": i}, [(n_by_n, block(b, hq, r0, r1, c0, c1), False), (operand, rows(b, hq, r0, r1), True)]
    return steps


def forward(h, p, blocks, ctx, softmax_rows):
    """S = scale QK^T (masked) -> HBM; P = softmax(S) -> HBM; O = PV -> HBM."""
    _gemm_tiles(h, p, blocks, "S = QK^T", "Q", "K", "S",
                lambda qt, kt, r0, r1, c0, c1: common.scores(ctx, qt, kt, r0, r1, c0, c1))

    def softmax(s):
        e = np.exp(s - common.finite_or(s.max(axis=1, keepdims=True), 0.0))
        total = e.sum(axis=1, keepdims=True)
        return e / np.where(total > 0, total, 1.0)

    _rowwise(h, p, softmax_rows, "P = softmax(S)", ["S"], "P", softmax)
    _accumulate(h, p, "O = PV", "O", p.nheads, ("i", p.row_blocks(blocks.rows)),
                _over_keys(p, blocks, "P", "V"), lambda pt, vt: pt @ vt)


def backward(h, p, blocks, ctx, softmax_rows):
    """dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)); dQ = scale dS K; dK = scale dS^T Q."""
    scale = ctx.scale
    key_blocks = ("j", p.col_blocks(blocks.cols))
    _accumulate(h, p, "dV = P^T dO", "dV", p.nheads_kv, key_blocks,
                _over_queries(p, blocks, "P", "dO"), lambda pt, dot: pt.T @ dot)
    _gemm_tiles(h, p, blocks, "dP = dO V^T", "dO", "V", "dP", lambda dot, vt, *_: dot @ vt.T)
    _rowwise(h, p, softmax_rows, "dS = P(dP - D)", ["dP", "P"], "dS",
             lambda dpt, pt: pt * (dpt - (pt * dpt).sum(axis=1, keepdims=True)))
    _accumulate(h, p, "dQ = dS K", "dQ", p.nheads, ("i", p.row_blocks(blocks.rows)),
                _over_keys(p, blocks, "dS", "K"), lambda dst, kt: scale * (dst @ kt))
    _accumulate(h, p, "dK = dS^T Q", "dK", p.nheads_kv, key_blocks,
                _over_queries(p, blocks, "dS", "Q"), lambda dst, qt: scale * (dst.T @ qt))
