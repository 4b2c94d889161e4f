"""The attention problem a schedule runs on: sizes, heads, mask, and its row and column blocks."""

from dataclasses import dataclass, field

import numpy as np

from numbaflash.masks import block_key_range


def cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Problem:
    """Sizes of one attention call; ``left``/``right`` is the normalized window (-1 unbounded). ``block_mask``: a
    `numbaflash.BlockMask` whose empty tiles the schedule skips (`visited`); None visits every tile the
    causal/window mask shows."""

    seqlen_q: int
    seqlen_k: int
    headdim: int
    batch: int = 1
    nheads: int = 1
    nheads_kv: int = 1
    left: int = -1
    right: int = -1
    block_mask: object = field(default=None, compare=False, repr=False)

    @property
    def group(self):
        return self.nheads // self.nheads_kv

    def row_blocks(self, block_rows):
        """``(i, r0, r1)`` for each block of query rows."""
        return [(i, r0, min(r0 + block_rows, self.seqlen_q)) for i, r0 in enumerate(range(0, self.seqlen_q, block_rows))]

    def col_blocks(self, block_cols):
        """``(j, c0, c1)`` for each block of keys."""
        return [(j, c0, min(c0 + block_cols, self.seqlen_k)) for j, c0 in enumerate(range(0, self.seqlen_k, block_cols))]

    def query_blocks(self, block_rows):
        """``(b, h, h_kv, i, r0, r1)``: each block of query rows of each batch element and query head, in that order
        (h_kv: the key/value head query head h reads)."""
        return [(b, h, h // self.group, i, r0, r1) for b in range(self.batch) for h in range(self.nheads)
                for i, r0, r1 in self.row_blocks(block_rows)]

    def key_blocks(self, block_cols):
        """``(b, h_kv, j, c0, c1)``: each block of keys of each batch element and key/value head, in that order."""
        return [(b, h_kv, j, c0, c1) for b in range(self.batch) for h_kv in range(self.nheads_kv)
                for j, c0, c1 in self.col_blocks(block_cols)]

    def key_range(self, r0, r1):
        return block_key_range(r0, r1, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def visible(self, r0, r1, c0, c1):
        """Whether the tile rows [r0, r1) x keys [c0, c1) holds at least one visible score."""
        lo, hi = self.key_range(r0, r1)
        return max(lo, c0) < min(hi, c1)

    def visited(self, block_rows, block_cols):
        """bool ``(batch, nheads, query blocks, key blocks)``: the tiles of these blocks the block mask leaves
        non-empty and the causal/window mask shows (`numbaflash.BlockMask.visited`, broadcast)."""
        table = self.block_mask.visited(block_rows, block_cols, self.left, self.right)
        return np.broadcast_to(table, (self.batch, self.nheads) + table.shape[2:])

    def visible_cols(self, r0, r1, block_rows, block_cols, b=0, h=0):
        """The key blocks query block ``[r0, r1)`` (of batch element ``b``, head ``h``) must visit; the rest the
        mask hides entirely, or the block mask empties."""
        cols = [(j, c0, c1) for j, c0, c1 in self.col_blocks(block_cols) if self.visible(r0, r1, c0, c1)]
        if self.block_mask is None:
            return cols
        tiles = self.visited(block_rows, block_cols)[b, h, r0 // block_rows]
        return [(j, c0, c1) for j, c0, c1 in cols if tiles[j]]

    def visible_rows(self, c0, c1, block_rows, block_cols, b=0, h=0):
        """The query blocks (of batch element ``b``, head ``h``) that see at least one key of [c0, c1)."""
        rows = [(i, r0, r1) for i, r0, r1 in self.row_blocks(block_rows) if self.visible(r0, r1, c0, c1)]
        if self.block_mask is None:
            return rows
        tiles = self.visited(block_rows, block_cols)[b, h, :, c0 // block_cols]
        return [(i, r0, r1) for i, r0, r1 in rows if tiles[i]]
