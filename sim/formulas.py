"""Closed forms for every schedule's HBM traffic, derived independently of the schedules' tile loops.

Notation (per batch element and head): N_q, N_k sequence lengths, d head dimension, B_r x B_c blocks,
T_r = ceil(N_q / B_r). Masks enter through three sums over the query blocks, each computed from the
block's visible key range [lo, hi) (`numbaflash.masks.block_key_range`) by arithmetic alone:

* ``pairs``  = sum_i rows_i * n_i, where n_i = ceil(hi/B_c) - floor(lo/B_c) key blocks are visible
  to block i: the query rows moved by schedules that revisit Q_i once per visible key block;
* ``keys``   = sum_i (min(B_c ceil(hi/B_c), N_k) - B_c floor(lo/B_c)): key rows moved when K, V are
  streamed once per query block;
* ``seen``   = sum of rows_i over query blocks that see any key (the rest load nothing);
* ``union``  = key rows of the key blocks visible to some query: K, V loaded once per key block.

Without a mask: pairs = N_q T_c, keys = N_k T_r, seen = N_q, union = N_k.

With a block mask (``Problem.block_mask``, FlashAttention-2) the sums run over every batch element and head,
from the tiles its table marks visited (`block_mask_sums`): ``seen`` and ``keys`` on the forward's (and the
dQ pass's) blocks, ``pairs`` and ``union`` on the key pass's.
"""

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .problem import cdiv


@dataclass(frozen=True)
class MaskSums:
    pairs: int
    keys: int
    seen: int
    union: int


def mask_sums(p, blocks):
    br, bc = blocks.rows, blocks.cols
    pairs = keys = seen = 0
    for r0 in range(0, p.seqlen_q, br):
        r1 = min(r0 + br, p.seqlen_q)
        lo, hi = p.key_range(r0, r1)
        if lo >= hi:
            continue
        j_lo, j_hi = lo // bc, cdiv(hi, bc)
        pairs += (r1 - r0) * (j_hi - j_lo)
        keys += min(j_hi * bc, p.seqlen_k) - j_lo * bc
        seen += r1 - r0
    lo, hi = p.key_range(0, p.seqlen_q)
    union = min(cdiv(hi, bc) * bc, p.seqlen_k) - (lo // bc) * bc if lo < hi else 0
    return MaskSums(pairs, keys, seen, union)


def block_mask_sums(p, blocks):
    """`MaskSums` over all batch elements and heads (``union`` over kv heads: a key block a group's heads
    all skip loads nothing), from the block mask's table of ``blocks`` by array sums."""
    br, bc = blocks.rows, blocks.cols
    visited = p.visited(br, bc)  # (batch, nheads, query blocks, key blocks)
    rows = np.minimum(np.arange(1, visited.shape[2] + 1) * br, p.seqlen_q) - np.arange(visited.shape[2]) * br
    keys = np.minimum(np.arange(1, visited.shape[3] + 1) * bc, p.seqlen_k) - np.arange(visited.shape[3]) * bc
    by_group = visited.reshape(p.batch, p.nheads_kv, p.group * visited.shape[2], visited.shape[3]).any(axis=2)
    return MaskSums(pairs=int((visited * rows[:, None]).sum()), keys=int((visited * keys).sum()),
                    seen=int((visited.any(axis=3) * rows).sum()), union=int((by_group * keys).sum()))


def totals(p, blocks):
    """`mask_sums` summed over every batch element and head (kv head for ``union``)."""
    if p.block_mask is not None:
        return block_mask_sums(p, blocks)
    m, bh, bhk = mask_sums(p, blocks), p.batch * p.nheads, p.batch * p.nheads_kv
    return MaskSums(bh * m.pairs, bh * m.keys, bh * m.seen, bhk * m.union)


FORMULAS = {
    ("standard", False): "S, P: 2 N_q N_k each; Q, O: N_q d; K, V: N_k d  (= 4N^2 + 4Nd for N_q = N_k)",
    ("standard", True): "P 2, dP 2, dS 3 (x N_q N_k); dO 2, Q, dQ (x N_q d); K, V, dK, dV (x N_k d)  (= 7N^2 + 8Nd)",
    ("flash1", False): "init O, l, m; K, V: N_k d; per visible tile: Q_i, O_i read, O_i written, l_i, m_i read+written",
    ("flash1", True): "init dQ, dK, dV; K, V, dK, dV: N_k d; per visible tile: Q_i, O_i, dO_i read, dQ_i read+written, l_i, m_i read",
    ("flash2", False): "Q, O: N_q d; LSE: N_q; K, V: N_k d per query block  (= 2N_q d + N_q + 2 N_k d T_r)",
    ("flash2", True): "D: O, dO read, D written; K, V: N_k d; dK, dV: N_k d; per visible tile: Q_i, dO_i, LSE_i, D_i"
                      " [+ dQ_i read+written | + a dQ pass streaming K, V per query block]",
}


def predicted(algorithm, backward, p, blocks, dq="accumulate", staged=False):
    """Per-tensor ``{"reads": n, "writes": n}`` in elements for the schedule, summed over batch and heads
    (``staged``: FlashAttention-2's backward with the LSE staged beside D, `algorithms.flash2`)."""
    bh, bhk = p.batch * p.nheads, p.batch * p.nheads_kv
    nq, nk, d = p.seqlen_q, p.seqlen_k, p.headdim
    r, w = defaultdict(int), defaultdict(int)
    if algorithm == "standard":
        nn = bh * nq * nk
        if not backward:
            r.update(Q=bh * nq * d, K=bhk * nk * d, V=bhk * nk * d, S=nn, P=nn)
            w.update(S=nn, P=nn, O=bh * nq * d)
        else:
            r.update(P=2 * nn, dP=nn, dS=2 * nn, dO=2 * bh * nq * d, Q=bh * nq * d, K=bhk * nk * d, V=bhk * nk * d)
            w.update(dP=nn, dS=nn, dQ=bh * nq * d, dK=bhk * nk * d, dV=bhk * nk * d)
        return _combine(r, w)
    if algorithm == "flash1":
        m = mask_sums(p, blocks)
        if not backward:
            r.update(K=bh * m.union * d, V=bh * m.union * d, Q=bh * m.pairs * d, O=bh * m.pairs * d,
                     l=bh * m.pairs, m=bh * m.pairs)
            w.update(O=bh * (nq + m.pairs) * d, l=bh * (nq + m.pairs), m=bh * (nq + m.pairs))
        else:
            r.update(K=bhk * m.union * d, V=bhk * m.union * d, Q=bh * m.pairs * d, O=bh * m.pairs * d,
                     dO=bh * m.pairs * d, dQ=bh * m.pairs * d, l=bh * m.pairs, m=bh * m.pairs)
            w.update(dQ=bh * (nq + m.pairs) * d, dK=bhk * (nk + m.union) * d, dV=bhk * (nk + m.union) * d)
        return _combine(r, w)
    m = totals(p, blocks)  # the forward's and the dQ pass's blocks
    if not backward:
        r.update(Q=m.seen * d, K=m.keys * d, V=m.keys * d)
        w.update(O=bh * nq * d, LSE=bh * nq)
        return _combine(r, w)
    # The key pass's sums: a two-pass schedule's dK/dV pass may run its own blocks; the dQ pass runs `blocks`.
    k = totals(p, blocks.key_pass) if dq == "separate" else m
    r.update(O=bh * nq * d, dO=(bh * nq + k.pairs) * d, D=k.pairs, LSE=k.pairs, Q=k.pairs * d, K=k.union * d,
             V=k.union * d)
    w.update(D=bh * nq, dK=bhk * nk * d, dV=bhk * nk * d)
    if dq == "accumulate":
        r["dQ"] = k.pairs * d
        w["dQ"] = (bh * nq + k.pairs) * d
    elif dq == "atomic":  # zeros, a read-modify-write per visible step, then one pass rounding into dQ
        r["dQ_acc"] = (k.pairs + bh * nq) * d
        w["dQ_acc"] = (bh * nq + k.pairs) * d
        w["dQ"] = bh * nq * d
    else:  # the dQ pass: Q_i, dO_i, LSE_i, D_i once per query block that sees a key, K and V streamed
        for name, n in (("Q", m.seen * d), ("dO", m.seen * d), ("LSE", m.seen), ("D", m.seen),
                        ("K", m.keys * d), ("V", m.keys * d)):
            r[name] += n
        w["dQ"] = bh * nq * d
    if staged:  # the preprocess reads each row's LSE once and writes it beside D; the passes read that copy
        r["LSE2"], r["LSE"] = r["LSE"], bh * nq
        w["LSE2"] = bh * nq
    return _combine(r, w)


def _combine(reads, writes):
    names = sorted(set(reads) | set(writes))
    per_tensor = {n: {"reads": reads.get(n, 0), "writes": writes.get(n, 0)} for n in names}
    total_r, total_w = sum(reads.values()), sum(writes.values())
    return {"reads": total_r, "writes": total_w, "total": total_r + total_w, "per_tensor": per_tensor}


def asymptotic(algorithm, p, sram_elems):
    """The textbook expression: 4N^2 + 4Nd for standard attention, N^2 d^2 / M for FlashAttention."""
    bh, nq, nk, d = p.batch * p.nheads, p.seqlen_q, p.seqlen_k, p.headdim
    if algorithm == "standard":
        return "4N^2 + 4Nd", bh * (4 * nq * nk + 2 * (nq + nk) * d)
    return "N^2 d^2 / M", bh * nq * nk * d * d / sram_elems
