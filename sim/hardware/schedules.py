"""A block mask's schedule as v5's kernels read it: the loads of its table and of a partial tile's verdict words.

A block-masked call's kernels learn which tiles to visit from the block mask's table (`numbaflash.kernels.key_tiles`,
`query_tiles`: a block's count, each visit's entry and each visit's slot in the bits) and, on a tile the mask_mod
does not show whole, each row's verdicts from the bits. Every such load is a warp instruction of its own:

* the count: every warp of the block, once (every thread reads it, at one address: one sector a warp);
* each visit's entry and slot: each consumer warp, two loads a visit (the entry gives both the tile and whether it
  is full);
* the producer's copies: the forward reads the entry of every tile it copies K of and of every tile it copies V of
  (two a visit), the backward passes one a visit, by the one thread that issues the bulk copies (by every producer
  warp when they stage with cp.async; a dK/dV pass's producer warp reads it whole);
* a partial tile's verdicts: each consumer warp, one load per fragment row (rows ``g`` and ``g + 8`` of its 16) and
  32-column word of the tile, lane ``4 g + t`` at its row's word; the dQ pass loads the word again for each of its
  8-column chunks (its loop over them keeps the load in its branch: `gradients.row_steps`), four loads a word.

So ncu counted them, sector for sector (H100, l1tex's global load sectors and the executed instructions per SASS
line: v5's forward with a causal block mask and with 8 documents on both its tile shapes, and the backward's
passes; `scripts/measure_io.py`). Only v5's kernels (a producer warpgroup) are modelled; the other families' reads of the
table are left out of their predictions.
"""

import numpy as np

from numbaflash.block_sparsity import FULL
from numbaflash.kernels.fragments import lane_row
from numbaflash.kernels.wgmma.pipeline import PRODUCER

from .sectors import sectors, unique_bytes

# Table entries the producer's issuing warp(s) read per visit, by pass.
PRODUCER_READS = {"forward": 2, "dq": 1, "dkdv": 1}
CONSUMER_READS = 2  # per visit and consumer warp: its entry and its slot
ENTRY_BYTES = 4  # int32 tables and verdict words


class ScheduleReads:
    """The schedule reads of one pass (``kind``: "forward", "dq" or "dkdv") of a v5 plan with a block mask, charged
    block by block to a `kernels.Ledger`."""

    def __init__(self, walk, kind):
        t, mask = walk.plan.tiles, walk.block_mask
        self.kind, self.tiles = kind, t
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
        self.width = 2 * (visits + 1)  # entries of a block's row of the table
        self.first_slot = (np.cumsum(partial.ravel()) - partial.ravel()).reshape(partial.shape)
        self.words = -(-t.block_n // 32)  # of a row of verdicts on a streamed tile (keys, or dK/dV's query rows)
        # loads of each word: once, or once per 8-column chunk in it (the dQ pass)
        self.loads_per_word = min(4, -(-t.block_n // 8)) if kind == "dq" else 1
        producers = 1 if t.tma or kind != "forward" else PRODUCER // 32  # the forward's cp.async producer: every warp
        self.producer_reads = PRODUCER_READS[kind] * producers
        self.warps = t.threads // 32
        self._verdicts = None

    def charge(self, ledger, b, head, block, visits):
        """A block's reads: ``head`` the query head (forward, dQ) or kv head (dK/dV), ``block`` its query or key
        block, ``visits`` as `kernels.Walk` lists them (first keys; (query head, first row) pairs for dK/dV)."""
        on = lambda i, axis: i if self.classes.shape[axis] > 1 else 0
        if self.kind == "dkdv":
            partial = [self.classes[on(b, 0), on(h, 1), q // self.tiles.block_n, block] != FULL for h, q in visits]
        else:
            partial = self.classes[on(b, 0), on(head, 1), block, np.asarray(visits, np.int64) // self.tiles.block_n] != FULL
        b, head = (i if n > 1 else 0 for i, n in zip((b, head), self.axes))
        row = ((b * self.axes[1] + head) * self.blocks + block) * self.width
        visits = len(partial)
        entries = (self.warps + visits * (self.producer_reads + CONSUMER_READS * self.tiles.warps)) * 32
        read = np.concatenate([[0], 1 + np.arange(visits), self.width // 2 + 1 + np.arange(visits)])
        distinct = unique_bytes((row + read) * ENTRY_BYTES, ENTRY_BYTES)
        ledger.charge("load", ("schedule", b, head, block), ("schedule", visits, row % 8, self.width),
                      lambda: (entries, distinct))
        slot = self.first_slot[b, head, block]
        for _ in range(int(np.count_nonzero(partial))):
            ledger.charge("load", ("verdicts", slot), ("verdicts", self.kind), self._verdict_cost)
            slot += 1

    def _verdict_cost(self):
        """One partial tile's verdict loads by every consumer warp: (requested bytes, distinct bytes); a slot's
        words start on a sector (``block_m`` rows of whole words), so every slot costs the same."""
        t = self.tiles
        g = np.arange(32) // 4
        rows = [16 * warp + lane_row(r, g) for warp in range(t.warps) for r in range(2 * t.m_tiles)]
        addresses = np.array([(row * self.words + w) * ENTRY_BYTES for row in rows for w in range(self.words)
                              for _ in range(self.loads_per_word)])
        return sectors(addresses) * 32, unique_bytes(addresses, ENTRY_BYTES)
