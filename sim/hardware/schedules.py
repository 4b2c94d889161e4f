"""A block mask's schedule as the kernels read it: the loads of its table and of partial tiles' verdicts.

A block-masked call's kernels learn which tiles to visit from the block mask's table (`numbaflash.kernels.key_tiles`,
`query_tiles`: a block's count, each visit's entry and each visit's slot in the bits) and, on a tile the mask_mod
does not show whole, each row's verdicts from the bits. Every such load is a warp instruction of its own, and
`READS` gives, per kernel, how many the compiled code makes (ncu's executed instructions per SASS line, H100, 8
documents at N = 4096 and 8192 and a causal block mask; `.bench/ncu_bm.py`, `.bench/ncu_mma_bm.py`,
`.bench/ncu_simt_bm.py`):

* the query tile a forward or dQ block runs (`grid_order`'s entry at the end of the row of its grid position):
  every warp of the block, once (all lanes at one address: one sector);
* the count: every warp of the block, once, where any key is visible to the block (all lanes at one address: one
  sector); mma.sync's warps also read the first visit's entry before the loop;
* each visit's entry and slot: each consumer warp (every warp of a CUDA-core block), two loads a visit; mma.sync's
  warps also read the next visit's entry (for its copies) on every visit but the last; mma.sync's forward loads
  the slot only on a partial tile, where its mask step reads it (its entry twice instead: its barriers keep the
  compiler from reusing the first load);
* v5's producer: the forward reads the entry of every tile it copies K of and of every tile it copies V of (two a
  visit), the backward passes one a visit, by the one thread that issues the bulk copies (the forward's cp.async
  producer: every producer warp);
* a partial tile's verdicts: each consumer warp loads each of its fragment rows' 32-column words (lane ``4 g + t``
  at rows ``g`` and ``g + 8`` of each m-tile), once a word, or again for each of its 8-column chunks where the loop
  over them keeps the load in its branch (`gradients.row_steps` in both dQ passes, mma.sync's dK/dV pass); a
  CUDA-core thread ``(r, c)`` loads, for each of its ``thread_m`` rows (keys in the dK/dV pass), the one word that
  holds its ``thread_n`` columns.

Requested sectors follow from the lanes' addresses; the L2 model sees each block's table row and each slot's words.
v5's dK/dV kernel that also accumulates dQ (deterministic=False) reads as the dK/dV pass (its global bytes equal
ncu's, `measure_io`'s atomic cases). Not modelled: v3's wgmma kernels without a producer warpgroup.
"""

from dataclasses import dataclass

import numpy as np

from numbaflash.block_sparsity import FULL
from numbaflash.kernels.fragments import lane_row
from numbaflash.kernels.wgmma.pipeline import PRODUCER
from numbaflash.tiling import MmaTiles, Tiles, WgmmaTiles

from .patterns import simt_lanes
from .sectors import sectors, unique_bytes

ENTRY_BYTES = 4  # int32 tables and verdict words


@dataclass(frozen=True)
class Reads:
    """One kernel's schedule loads, in warp instructions (see the module's docstring)."""

    first: int  # per consumer warp and block, beside every warp's count
    visit: int  # per consumer warp and visit
    next_visit: int  # per consumer warp and visit but the last
    partial: int  # per consumer warp and partial visit, beside its verdicts
    producer: int  # per visit, by the producer's issuing thread
    chunked: bool  # verdict words loaded once per 8-column chunk (the tensor-core kernels' fragments)


# (family, pass) -> Reads; family "v5" (a producer warpgroup), "mma" or "simt" (the CUDA cores)
READS = {
    ("v5", "forward"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=2, chunked=False),
    ("v5", "dq"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=1, chunked=True),
    ("v5", "dkdv"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=1, chunked=False),
    ("mma", "forward"): Reads(first=1, visit=2, next_visit=1, partial=1, producer=0, chunked=False),
    ("mma", "dq"): Reads(first=1, visit=2, next_visit=1, partial=0, producer=0, chunked=True),
    ("mma", "dkdv"): Reads(first=1, visit=2, next_visit=1, partial=0, producer=0, chunked=True),
    ("simt", "forward"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=0, chunked=False),
    ("simt", "dq"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=0, chunked=False),
    ("simt", "dkdv"): Reads(first=0, visit=2, next_visit=0, partial=0, producer=0, chunked=False),
}


def index_on(shape, axis, i):
    """``i`` on a block mask's batch or head axis of length ``shape[axis]``, which is 1 where the mask does not depend
    on it."""
    return i if shape[axis] > 1 else 0


def family(tiles):
    """The key of `READS` for a plan's tiles, None where the kernels' schedule reads are not modelled."""
    if isinstance(tiles, WgmmaTiles) and tiles.producer:
        return "v5"
    return "mma" if isinstance(tiles, MmaTiles) else "simt" if isinstance(tiles, Tiles) else None


class ScheduleReads:
    """The schedule reads of one pass (``kind``: "forward", "dq" or "dkdv") of a plan with a block mask whose kernels'
    reads are modelled (`family`), charged block by block to a `kernels.Ledger`."""

    def __init__(self, walk, kind):
        t, mask = walk.plan.tiles, walk.block_mask
        self.kind, self.tiles = kind, t
        which = family(t)
        self.reads = READS[which, kind]
        if kind == "dkdv":  # blocks of keys, visiting (query head, query tile) pairs of their GQA group
            classes = mask.classify(t.block_n, t.block_m)
            shown = mask.visited(t.block_n, t.block_m, walk.left, walk.right) & (classes != FULL)
            per_head = shown.sum(axis=2)  # (batch or 1, heads or 1, key blocks)
            if per_head.shape[1] > 1:  # a kv head's row lists its group's heads
                partial = per_head.reshape(per_head.shape[0], -1, walk.group, per_head.shape[2]).sum(axis=2)
            else:  # a mask of any head: the one row lists each of the group's heads
                partial = walk.group * per_head
            self.blocks, visits = shown.shape[3], walk.group * shown.shape[2]
        else:
            classes = mask.classify(t.block_m, t.block_n)
            shown = mask.visited(t.block_m, t.block_n, walk.left, walk.right) & (classes != FULL)
            partial = shown.sum(axis=3)
            self.blocks, visits = shown.shape[2], shown.shape[3]
        self.classes = classes
        self.axes = partial.shape[:2]  # (batch or 1, heads or 1) of the table
        # entries of a block's row of the table; a forward's or dQ pass's rows end in `grid_order`'s entry
        self.width = 2 * (visits + 1) + (kind != "dkdv")
        self.first_slot = (np.cumsum(partial.ravel()) - partial.ravel()).reshape(partial.shape)
        self.words = -(-t.block_n // 32)  # of a row of verdicts on a streamed tile (keys, or dK/dV's query rows)
        cp_async_producer = which == "v5" and kind == "forward" and not t.tma
        self.producer = self.reads.producer * (PRODUCER // 32 if cp_async_producer else 1)
        self.warps = t.threads // 32
        self.simt = which == "simt"
        self.consumers = self.warps if self.simt else t.warps  # warps that read the visits

    def charge(self, ledger, b, head, block, visits):
        """A block's reads: ``head`` the query head (forward, dQ) or kv head (dK/dV), ``block`` its query or key
        block, ``visits`` as `kernels.Walk` lists them (first keys; (query head, first row) pairs for dK/dV)."""
        classes, bn = self.classes, self.tiles.block_n
        cb = index_on(classes.shape, 0, b)
        if self.kind == "dkdv":
            partial = [classes[cb, index_on(classes.shape, 1, h), q // bn, block] != FULL for h, q in visits]
        else:
            partial = classes[cb, index_on(classes.shape, 1, head), block, np.asarray(visits, np.int64) // bn] != FULL
        partials = int(np.count_nonzero(partial))
        b, head = index_on(self.axes, 0, b), index_on(self.axes, 1, head)
        row = ((b * self.axes[1] + head) * self.blocks + block) * self.width
        n = len(visits)

        def make():
            r = self.reads
            loads = self.warps + n * self.producer + self.consumers * (
                (r.first if n else 0) + n * r.visit + max(n - 1, 0) * r.next_visit + partials * r.partial)
            read = np.concatenate([[0], 1 + np.arange(n), self.width // 2 + 1 + np.arange(n)])  # count, entries, slots
            return loads * 32, unique_bytes((row + read) * ENTRY_BYTES, ENTRY_BYTES)

        ledger.charge("load", ("schedule", b, head, block), ("schedule", n, partials, row % 8, self.width), make)
        slot = self.first_slot[b, head, block]
        for _ in range(partials):
            ledger.charge("load", ("verdicts", slot), ("verdicts", self.kind), self._verdict_cost)
            slot += 1

    def charge_grid_tile(self, ledger, b, head, x):
        """Block ``x`` of a forward or dQ grid's row reading which query tile it runs (`key_tiles.grid_tile`): every
        warp of the block, once, the last entry of the table's row ``x``."""
        b, head = index_on(self.axes, 0, b), index_on(self.axes, 1, head)
        at = (((b * self.axes[1] + head) * self.blocks + x) * self.width + self.width - 1) * ENTRY_BYTES
        ledger.charge("load", ("grid tile", b, head, x), ("grid tile", self.warps),
                      lambda: (self.warps * 32, unique_bytes([at], ENTRY_BYTES)))

    def _verdict_cost(self):
        """One partial tile's verdict loads by every consumer warp: (requested bytes, distinct bytes); a slot's
        words start on a sector (``block_m`` rows of whole words), so every slot costs the same. ``addresses``: a
        row per warp instruction, a column per lane."""
        t = self.tiles
        if self.simt:  # thread (r, c): its rows r thread_m + a, the word of its columns c thread_n ..
            r, c = simt_lanes(t.threads, t.cols_t)
            addresses = np.concatenate([((r * t.thread_m + a) * self.words + c * t.thread_n // 32) * ENTRY_BYTES
                                        for a in range(t.thread_m)])
            return sectors(addresses) * 32, unique_bytes(addresses, ENTRY_BYTES)
        g = np.arange(32) // 4
        chunks = min(4, -(-t.block_n // 8)) if self.reads.chunked else 1  # loads of each word
        rows = [t.rows_per_warp * warp + lane_row(r, g) for warp in range(t.warps) for r in range(2 * t.m_tiles)]
        addresses = np.array([(row * self.words + w) * ENTRY_BYTES for row in rows for w in range(self.words)
                              for _ in range(chunks)])
        return sectors(addresses) * 32, unique_bytes(addresses, ENTRY_BYTES)
