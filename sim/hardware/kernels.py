"""The global accesses of every kernel a `numbaflash.tiling.Plan` launches, block by block, in launch order.

Each ``*_blocks`` function walks its kernel's grid as the GPU starts it (blockIdx.x fastest) and, for
every thread block, charges each access the kernel code makes (`patterns` gives its addresses) to a
`Ledger`: requested sectors for the global-bytes counters, and the block's sequence of tiles for the
L2 model (`l2`). Blocks with no visible key load nothing, as in the kernels; rows past the sequence
and columns past the head dim are never read; padded head dims are staged as zeros, not loaded.
"""

from dataclasses import dataclass, field

import numpy as np

from numbaflash import masks
from numbaflash.tiling import MmaTiles, WgmmaTiles
from numbaflash.kernels.mma.forward import PAIRED_STORES
from numbaflash.kernels.simt.backward import STAGED_ROWS_PER_WARP
from numbaflash.kernels.simt.tiles import vector_width

from . import patterns, schedules
from .schedules import index_on
from .sectors import LINE, box_bytes, copy_sectors, sectors, unique_bytes

KINDS = ("load", "copy", "tma", "store", "reduce")


@dataclass
class Ledger:
    """Bytes one kernel requests by kind (sectors x 32; bulk tensor copies in the bytes the TMA unit
    delivers) and, per thread block in launch order, the tiles it touches: ``(tile, distinct bytes, written)``.
    A reduction (``red.global.add``, done in L2) touches its tile twice: a read, from DRAM unless L2 holds
    it, and a write that leaves it dirty."""

    requested: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    blocks: list = field(default_factory=list)
    _costs: dict = field(default_factory=dict)

    def start_block(self):
        self.blocks.append([])

    def charge(self, kind, tile, key, make):
        """Charge one access: ``make()`` -> (requested bytes, distinct bytes), memoized on ``key`` (the access's
        shape and its first address modulo 128, all a count depends on)."""
        if key not in self._costs:
            self._costs[key] = make()
        requested, distinct = self._costs[key]
        self.requested[kind] += requested
        if distinct:
            if kind == "reduce":
                self.blocks[-1].append((tile, distinct, False))
            self.blocks[-1].append((tile, distinct, kind in ("store", "reduce")))


def _load(op, addresses, size):
    """An access of ``size``-byte lanes: its requested sectors and the bytes DRAM moves for it."""
    return lambda: (sectors(addresses) * 32, _distinct(op, addresses, size))


def _distinct(op, addresses, size):
    """Bytes DRAM moves for lane accesses of ``size`` bytes at ``addresses``, once per tile: their distinct
    sectors, or, for a dense operand (rows of every head back to back, all read or written by the
    kernel), their distinct bytes, since a sector shared with a neighbouring head's row moves once for both."""
    if op.dense:
        addresses = np.asarray(addresses)
        return int(np.unique(addresses[addresses >= 0]).size) * size
    return unique_bytes(addresses, size)


def _dram_bytes(op, row_starts, row_bytes):
    """`_distinct` for whole rows of ``row_bytes`` at ``row_starts`` (-1: outside the tensor)."""
    starts = np.asarray(row_starts, dtype=np.int64)
    starts = starts[starts >= 0]
    if op.dense:
        return int(starts.size) * row_bytes
    if starts.size == 0:
        return 0
    first, last = starts // 32, (starts + row_bytes - 1) // 32
    return int((last - first + 1).sum()) * 32


def _rows_key(op, b, h, row0, rows):
    """What a count of ``rows`` rows from ``row0`` depends on: the first address modulo a line, and how
    many of the rows lie inside the sequence."""
    return op.address(b, row0, h) % LINE, min(op.seqlen - row0, rows)


def _stat_key(op, b, h, row0, rows):
    return op.address(b, h, row0) % LINE, min(op.seqlen - row0, rows)


class Stager:
    """How one kernel stages a tile of a 4-D operand: cp.async into padded or swizzled rows, bulk tensor
    copies (TMA), or loads (vectors of ``vector`` elements, or one element at a time)."""

    def __init__(self, how, D, headdim, vector):
        self.how, self.D, self.headdim, self.vector = how, D, headdim, vector

    def stage(self, ledger, name, op, b, h, row0, rows):
        tile = (name, b, h, row0)
        key = (self.how, name, rows, self.vector, *_rows_key(op, b, h, row0, rows))
        if self.how == "tma":
            ledger.charge("tma", tile, key, lambda: self._boxes(op, b, h, row0, rows))
            return
        copies = self.how in ("padded", "swizzled") and self.vector == 8

        def make():
            addresses, i, c = patterns.staged_rows(op, b, h, row0, rows, self.headdim, self.vector, self.D // self.vector)
            if not copies:
                return _load(op, addresses, self.vector * op.itemsize)()
            dst = (patterns.padded_destinations(i, c, self.D) if self.how == "padded"
                   else patterns.swizzled_destinations(i, c, rows))
            return copy_sectors(addresses, dst) * 32, _distinct(op, addresses, 8 * op.itemsize)

        ledger.charge("copy" if copies else "load", tile, key, make)

    def _boxes(self, op, b, h, row0, rows):
        delivered = distinct = 0
        for atom in range(self.D // 64):
            cols = min(self.headdim, 64 * atom + 64) - 64 * atom
            row = row0 + np.arange(rows)
            starts = np.where(row < op.seqlen, op.at(b, row, h, 64 * atom), -1)
            delivered += box_bytes(starts, cols * op.itemsize, 64 * op.itemsize)
            distinct += _dram_bytes(op, starts, cols * op.itemsize)
        return delivered, distinct


def stager_for(plan, vec):
    """The `Stager` of a plan's tensor-core or CUDA-core kernels (``vec``: the launch's vector staging)."""
    t, D, headdim = plan.tiles, plan.headdim_padded, plan.headdim
    if isinstance(t, WgmmaTiles):
        return Stager("tma", D, headdim, 8) if t.tma else Stager("swizzled", D, headdim, 8 if vec else 1)
    if isinstance(t, MmaTiles):
        return Stager("padded", D, headdim, 8 if vec else 1)
    return Stager("loads", D, headdim, 4 if vec else 1)


def _hidden(ledger, ops, b, h, row_start, row_end):
    out, lse = ops["out"], ops["lse"]
    key = ("hidden", row_end - row_start, *_rows_key(out, b, h, row_start, row_end - row_start), lse.address(b, h, row_start) % LINE)

    def make():
        o, l = patterns.hidden_rows(out, lse, b, h, row_start, row_end)
        return (sectors(o) + sectors(l)) * 32, _distinct(out, o, out.itemsize) + _distinct(lse, l, lse.itemsize)

    ledger.charge("store", ("out", b, h, row_start), key, make)


def _tensor_core_outputs(ledger, plan, out, lse, b, h, row0, warps, rows_per_warp, name):
    """O (or dQ, dK, dV) fragments of every warp of a block, and with ``lse`` its rows' LSE."""
    m_tiles, D = rows_per_warp // 16, plan.headdim_padded
    paired = True if isinstance(plan.tiles, WgmmaTiles) else PAIRED_STORES  # as the kernels' writers
    key = ("fragments", name, warps, m_tiles, D, *_rows_key(out, b, h, row0, warps * rows_per_warp))

    def make():
        warp_stores = [patterns.fragment_stores(out, b, h, row0 + w * rows_per_warp, m_tiles, D, paired)
                       for w in range(warps)]
        return _load(out, np.concatenate([stores for stores, _ in warp_stores]), warp_stores[0][1])()

    ledger.charge("store", (name, b, h, row0), key, make)
    if lse is not None:
        key = ("lse", warps, m_tiles, *_stat_key(lse, b, h, row0, warps * rows_per_warp))
        lses = (np.concatenate([patterns.lse_stores(lse, b, h, row0 + w * rows_per_warp, m_tiles) for w in range(warps)])
                if key not in ledger._costs else None)
        ledger.charge("store", ("lse", b, h, row0), key, _load(lse, lses, 4))


def _simt_outputs(ledger, plan, out, lse, b, h, row0, name):
    t, D = plan.tiles, plan.headdim_padded
    acc_bytes = 8 if plan.dtype == "float64" else 4
    vv = vector_width(D // t.cols_t, acc_bytes)
    key = ("patch", name, *_rows_key(out, b, h, row0, t.block_m))
    stores = patterns.patch_stores(out, b, h, row0, t, D, t.thread_m, vv) if key not in ledger._costs else None
    ledger.charge("store", (name, b, h, row0), key, _load(out, stores, out.itemsize))
    if lse is not None:
        key = ("simt lse", *_stat_key(lse, b, h, row0, t.block_m))

        def make():
            r, c = patterns.simt_lanes(t.threads, t.cols_t)
            rows = [row0 + r * t.thread_m + a for a in range(t.thread_m)]
            addresses = np.concatenate([np.where((c == 0) & (row < lse.seqlen), lse.at(b, h, row), -1) for row in rows])
            return sectors(addresses) * 32, _distinct(lse, addresses, lse.itemsize)

        ledger.charge("store", ("lse", b, h, row0), key, make)


def _statistics(ledger, plan, ops, b, h, q0, rows, kind, rows_of):
    """LSE and D rows a backward block reads (``rows_of(q0)``: lane rows, instructions x lanes)."""
    if plan.staged_statistics:
        _staged_statistics(ledger, ops["delta"], b, h, q0, rows, kind, rows_of)
        return
    for name in ("lse", "delta"):
        op = ops[name]
        key = ("stats", kind, name, *_stat_key(op, b, h, q0, rows))
        addresses = patterns.row_statistics(op, b, h, rows_of(q0)) if key not in ledger._costs else None
        ledger.charge("load", (name, b, h, q0), key, _load(op, addresses, op.itemsize))


def _staged_statistics(ledger, stats, b, h, q0, rows, kind, rows_of):
    """The same from a staged preprocess's ``stats`` (batch, nheads, 2, padded rows: the base-2 LSE, then D;
    `simt.backward.build_staged_preprocess`), every row of a whole tile: v5's dK/dV producer copies a tile's two
    runs of ``rows`` floats in bulk (``kind`` "dkdv"), the dQ kernel's lanes load theirs at ``rows_of(q0)``."""
    for which in (0, 1):
        start = stats.address(b, h, which, q0)
        tile = (("stats", which), b, h, q0)
        if kind == "dkdv":
            nbytes = rows * stats.itemsize
            key = ("stats bulk", rows, start % LINE)
            ledger.charge("tma", tile, key, lambda start=start, n=nbytes: (n, _dram_bytes(stats, [start], n)))
        else:
            key = ("stats", kind, rows, start % LINE)
            addresses = stats.at(b, h, which, rows_of(q0)) if key not in ledger._costs else None
            ledger.charge("load", tile, key, _load(stats, addresses, stats.itemsize))


@dataclass
class Walk:
    """What every walk of an attention kernel's grid needs: the plan, the operands (`patterns.Operand` by
    name), how the kernel stages tiles, and the mask: the causal/window bounds and, optionally, a
    `numbaflash.block_sparsity.BlockMask`, whose non-empty tiles are all a kernel visits."""

    plan: object
    ops: dict
    stager: Stager
    left: int
    right: int
    block_mask: object = None

    def schedule(self, kind):
        """The `ScheduleReads` of pass ``kind`` where the kernels' reads of a block mask's schedule are modelled, else
        None."""
        if self.block_mask is None or schedules.family(self.plan.tiles) is None:
            return None
        return schedules.ScheduleReads(self, kind)

    @property
    def seqlens(self):
        return self.ops["q"].seqlen, self.ops["k"].seqlen

    @property
    def group(self):
        return self.plan.nheads // self.plan.nheads_kv

    def query_blocks(self, ledger, schedule=None):
        """``(b, h, row_start, row_end, lo, hi)`` of every query block (forward, dQ) in launch order, the last
        rows first or the block mask's `grid_order` (`kernels.blocks.query_blocks`), each opening a block in
        ``ledger``; ``schedule``: the pass's `schedules.ScheduleReads`, charged each block's read of its tile."""
        seqlen_q, seqlen_k = self.seqlens
        bm, bn = self.plan.tiles.block_m, self.plan.tiles.block_n
        m_blocks = -(-seqlen_q // bm)
        order = None if self.block_mask is None else self.block_mask.grid_order(bm, bn, self.left, self.right)
        for b in range(self.plan.batch):
            for h in range(self.plan.nheads):
                for x in range(m_blocks):
                    ledger.start_block()
                    if schedule:
                        schedule.charge_grid_tile(ledger, b, h, x)
                    tile = m_blocks - 1 - x if order is None else order[index_on(order.shape, 0, b),
                                                                        index_on(order.shape, 1, h), x]
                    row_start = int(tile) * bm
                    row_end = min(row_start + bm, seqlen_q)
                    lo, hi = masks.block_key_range(row_start, row_end, seqlen_q, seqlen_k, self.left, self.right)
                    yield b, h, row_start, row_end, lo, hi

    def key_tiles(self, b, h, row_start, lo, hi):
        """The first keys of the tiles a query block (forward, dQ) visits, in order (`kernels.key_tiles`):
        every tile of its visible range ``[lo, hi)``, or the block mask's non-empty ones."""
        bm, bn = self.plan.tiles.block_m, self.plan.tiles.block_n
        if self.block_mask is None:
            return range((lo // bn) * bn, hi, bn)
        visited = self.block_mask.visited(bm, bn, self.left, self.right)
        row = visited[index_on(visited.shape, 0, b), index_on(visited.shape, 1, h), row_start // bm]
        return (np.flatnonzero(row) * bn).tolist()

    def query_visits(self, b, hk, key_start, q_lo, q_hi):
        """The (query head, first row) pairs a dK/dV key block visits over its GQA group, heads in order and
        each head's tiles ascending (`kernels.query_tiles`)."""
        bk, bq = self.plan.tiles.block_m, self.plan.tiles.block_n
        heads = range(hk * self.group, (hk + 1) * self.group)
        if self.block_mask is None:
            return [(h, q) for h in heads for q in range((q_lo // bq) * bq, q_hi, bq)]
        visited = self.block_mask.visited(bq, bk, self.left, self.right)
        vb = index_on(visited.shape, 0, b)
        return [(h, int(q) * bq) for h in heads
                for q in np.flatnonzero(visited[vb, index_on(visited.shape, 1, h), :, key_start // bk])]

    def outputs(self, ledger, name, lse, b, h, row0):
        """The block's rows of ``name`` (O, dQ, dK or dV), and of ``lse`` unless None, as its kernel writes them."""
        t, out = self.plan.tiles, self.ops[name]
        lse = None if lse is None else self.ops[lse]
        if isinstance(t, (MmaTiles, WgmmaTiles)):
            _tensor_core_outputs(ledger, self.plan, out, lse, b, h, row0, t.warps, t.rows_per_warp, name)
        else:
            _simt_outputs(ledger, self.plan, out, lse, b, h, row0, name)


def forward_blocks(walk, ledger):
    """Every forward kernel: Q once, K and V per visited key tile, O and LSE once (`kernels.*.forward`); a
    block that visits none writes its rows as hidden."""
    bm, bn = walk.plan.tiles.block_m, walk.plan.tiles.block_n
    schedule = walk.schedule("forward")
    for b, h, row_start, row_end, lo, hi in walk.query_blocks(ledger, schedule):
        tiles = walk.key_tiles(b, h, row_start, lo, hi) if lo < hi else ()
        if schedule and lo < hi:
            schedule.charge(ledger, b, h, row_start // bm, tiles)
        if len(tiles) == 0:
            _hidden(ledger, walk.ops, b, h, row_start, row_end)
            continue
        walk.stager.stage(ledger, "q", walk.ops["q"], b, h, row_start, bm)
        for n in tiles:
            walk.stager.stage(ledger, "k", walk.ops["k"], b, h // walk.group, n, bn)
            walk.stager.stage(ledger, "v", walk.ops["v"], b, h // walk.group, n, bn)
        walk.outputs(ledger, "out", "lse", b, h, row_start)


def preprocess_blocks(plan, ops, rows_per_block, ledger):
    """D = rowsum(dO * O): a warp reads each of its rows in 32-element steps (one row per warp: lane 0 writes D;
    with staged statistics, `simt.backward.build_staged_preprocess`, `STAGED_ROWS_PER_WARP` rows at clamped
    addresses, `patterns.clamped_rows`, and lane r reads row r's LSE and writes both to ``stats``, for rows
    padded to whole tiles)."""
    out, delta = ops["out"], ops["delta"]
    staged = plan.staged_statistics
    slots = 32 * -(-plan.headdim // 32)
    for b in range(plan.batch):
        for h in range(plan.nheads):
            for row0 in range(0, delta.shape[3] if staged else out.seqlen, rows_per_block):
                ledger.start_block()
                for name in ("out", "dout"):
                    op = ops[name]
                    key = ("preprocess", name, rows_per_block, *_rows_key(op, b, h, row0, rows_per_block))
                    if staged:  # rows past the sequence repeat the last row's loads: its address matters too
                        key += (op.address(b, max(op.seqlen - 1, 0), h) % LINE,)
                    addresses = None if key in ledger._costs else (
                        patterns.clamped_rows(op, b, h, row0, rows_per_block, plan.headdim, slots) if staged else
                        patterns.staged_rows(op, b, h, row0, rows_per_block, plan.headdim, 1, slots)[0])
                    ledger.charge("load", (name, b, h, row0), key, _load(op, addresses, op.itemsize))
                rows = row0 + np.arange(rows_per_block)
                if staged:
                    _staged_rows(ledger, ops["lse"], delta, b, h, row0, rows)
                    continue
                key = ("delta", rows_per_block, *_stat_key(delta, b, h, row0, rows_per_block))
                addresses = np.where(rows < delta.seqlen, delta.at(b, h, rows), -1)[:, None]
                ledger.charge("store", ("delta", b, h, row0), key, _load(delta, addresses, delta.itemsize))


def _staged_rows(ledger, lse, stats, b, h, row0, rows):
    """A staged preprocess block's warps, lane r of each its row r: the LSE loaded inside the sequence, the base-2
    LSE and D stored for every row, one instruction per warp."""
    by_warp = rows.reshape(-1, STAGED_ROWS_PER_WARP)
    key = ("preprocess lse", rows.size, *_stat_key(lse, b, h, row0, rows.size))
    addresses = np.where(by_warp < lse.seqlen, lse.at(b, h, by_warp), -1)
    ledger.charge("load", ("lse", b, h, row0), key, _load(lse, addresses, lse.itemsize))
    for which in (0, 1):
        key = ("stats store", rows.size, stats.address(b, h, which, row0) % LINE)
        addresses = stats.at(b, h, which, by_warp)
        ledger.charge("store", (("stats", which), b, h, row0), key, _load(stats, addresses, stats.itemsize))


def dkdv_blocks(walk, ledger, accumulate_dq=False):
    """The dK/dV kernels: K and V of a key block once; Q, dO, LSE and D of every query tile it visits (that
    sees it, or the block mask's), for every head of the GQA group (the CUDA-core kernel stages Q and dO twice,
    k-major then row-major); with ``accumulate_dq`` (v5's ``dkdv_dq``) also each query tile's dS K added to
    ``dq_acc``."""
    t, ops = walk.plan.tiles, walk.ops
    seqlen_q, seqlen_k = walk.seqlens
    bk, bq = t.block_m, t.block_n
    mma = isinstance(t, (MmaTiles, WgmmaTiles))  # the tensor-core kernels stage LSE and D alike
    if mma:  # every thread loads them (with a producer warpgroup, staged statistics are copied in bulk)
        rows_of = lambda q0: patterns.stats_rows_mma(q0, bq, t.threads)
    else:
        r, c = patterns.simt_lanes(t.threads, t.cols_t)
        rows_of = lambda q0: np.concatenate([q0 + c * t.thread_n + a for a in range(t.thread_n)])
    schedule = walk.schedule("dkdv")
    for b in range(walk.plan.batch):
        for hk in range(walk.plan.nheads_kv):
            for key_start in range(0, seqlen_k, bk):
                ledger.start_block()
                q_lo, q_hi = masks.query_range(key_start, min(key_start + bk, seqlen_k), seqlen_q, seqlen_k,
                                               walk.left, walk.right)
                visits = walk.query_visits(b, hk, key_start, q_lo, q_hi) if q_lo < q_hi else ()
                if schedule and q_lo < q_hi:
                    schedule.charge(ledger, b, hk, key_start // bk, visits)
                if visits:
                    walk.stager.stage(ledger, "k", ops["k"], b, hk, key_start, bk)
                    walk.stager.stage(ledger, "v", ops["v"], b, hk, key_start, bk)
                    for h, q_start in visits:
                        for _ in range(1 if mma else 2):
                            walk.stager.stage(ledger, "q", ops["q"], b, h, q_start, bq)
                            walk.stager.stage(ledger, "dout", ops["dout"], b, h, q_start, bq)
                        _statistics(ledger, walk.plan, ops, b, h, q_start, bq, "dkdv", rows_of)
                        if accumulate_dq:
                            _reduce_dq(ledger, ops["dq_acc"], b, h, q_start, bq)
                walk.outputs(ledger, "dk", None, b, hk, key_start)
                walk.outputs(ledger, "dv", None, b, hk, key_start)


def _reduce_dq(ledger, dq_acc, b, h, q0, rows):
    """`wgmma.ws_backward.dq_accumulator`: ``rows`` query rows x every 64-column chunk of the padded head dim of
    float32 ``dq_acc``, added with ``red.global.add.v2.f32`` (lane 4 g + t: row g (+ 8), columns 8 j + 2 t, + 1);
    the rows are padded, so every tile adds whole rows."""
    key = ("reduce", rows, dq_acc.address(b, q0, h, 0) % LINE)

    def make():
        g, t = np.arange(32) // 4, np.arange(32) % 4
        row = q0 + np.arange(0, rows, 16)[:, None, None, None] + g + 8 * np.arange(2)[None, None, :, None]
        col = (np.arange(0, dq_acc.shape[3], 8)[None, :, None, None] + 2 * t).astype(np.int64)
        addresses = dq_acc.at(b, row, h, col).reshape(-1, 32)
        return _load(dq_acc, addresses, 8)()

    ledger.charge("reduce", ("dq_acc", b, h, q0), key, make)


def dq_postprocess_blocks(plan, ops, rows_per_block, ledger):
    """dQ = scale dq_acc, rounded (`simt.backward.build_dq_postprocess`): one warp per row reads the row's head
    dim of dq_acc one element per lane and writes it to dQ."""
    slots = 32 * -(-plan.headdim // 32)
    seqlen_q = ops["dq"].seqlen
    for b in range(plan.batch):
        for h in range(plan.nheads):
            for row0 in range(0, seqlen_q, rows_per_block):
                ledger.start_block()
                for name, kind in (("dq_acc", "load"), ("dq", "store")):
                    op = ops[name]
                    rows = min(rows_per_block, seqlen_q - row0)
                    key = ("postprocess", name, rows, *_rows_key(op, b, h, row0, rows_per_block))
                    addresses = (patterns.staged_rows(op, b, h, row0, rows, plan.headdim, 1, slots)[0]
                                 if key not in ledger._costs else None)
                    ledger.charge(kind, (name, b, h, row0), key, _load(op, addresses, op.itemsize))


def dq_blocks(walk, ledger):
    """The dQ kernels: Q, dO, LSE and D of a query block once; K and V of every visited key tile (the
    CUDA-core kernel stages K twice, k-major then row-major)."""
    t, ops = walk.plan.tiles, walk.ops
    bm, bn = t.block_m, t.block_n
    mma = isinstance(t, (MmaTiles, WgmmaTiles))
    if mma:
        rows_of = lambda q0: np.concatenate([patterns.quad_rows(q0 + w * t.rows_per_warp, t.m_tiles)[0]
                                             for w in range(t.warps)])
    else:
        r, c = patterns.simt_lanes(t.threads, t.cols_t)
        rows_of = lambda q0: np.concatenate([q0 + r * t.thread_m + a for a in range(t.thread_m)])
    schedule = walk.schedule("dq")
    for b, h, row_start, row_end, lo, hi in walk.query_blocks(ledger, schedule):
        tiles = walk.key_tiles(b, h, row_start, lo, hi) if lo < hi else ()
        if schedule and lo < hi:
            schedule.charge(ledger, b, h, row_start // bm, tiles)
        if len(tiles):
            walk.stager.stage(ledger, "q", ops["q"], b, h, row_start, bm)
            walk.stager.stage(ledger, "dout", ops["dout"], b, h, row_start, bm)
            _statistics(ledger, walk.plan, ops, b, h, row_start, bm, "dq", rows_of)
            for n in tiles:
                for _ in range(1 if mma else 2):
                    walk.stager.stage(ledger, "k", ops["k"], b, h // walk.group, n, bn)
                walk.stager.stage(ledger, "v", ops["v"], b, h // walk.group, n, bn)
        walk.outputs(ledger, "dq", None, b, h, row_start)
