"""A two-level memory: tensors in HBM, tiles in an SRAM of fixed capacity, every element moved counted.

An algorithm `load`s a tile of an HBM tensor into SRAM (charged as reads of that tensor), computes on
SRAM-resident tiles only (`Tile.a` refuses a tile that is not resident), and `store`s tiles back
(charged as writes). Scratch that never touches HBM (a score tile, an accumulator) is `alloc`ed in
SRAM. If the resident tiles outgrow the capacity, `SramOverflow` names them and the budget.

Counts are kept per tensor and per tile step: `step()` opens a ledger entry (coordinates plus reads and
writes by tensor) that the reports and the heat map read.

With ``compute=False`` tiles carry shapes only, so a sweep can count the traffic of problems far too
large to evaluate in float64.
"""

import math
from collections import Counter
from contextlib import contextmanager

import numpy as np


class SramOverflow(ValueError):
    """A step's resident tiles do not fit in the simulated SRAM."""


class Tile:
    """A block of elements resident in SRAM; ``a`` is its NumPy data while it stays resident.

    ``label`` is a name or a ``(tensor, index)`` pair, turned into a name only when one is shown.
    """

    __slots__ = ("label", "shape", "size", "data", "resident")

    def __init__(self, label, shape, data):
        self.label = label
        self.shape = shape
        self.size = math.prod(shape)
        self.data = data
        self.resident = True

    @property
    def name(self):
        if isinstance(self.label, str):
            return self.label
        tensor, index = self.label
        return f"{tensor}[{_describe(index)}]"

    @property
    def a(self):
        if not self.resident:
            raise RuntimeError(f"tile {self.name} was evicted from SRAM; algorithms compute on resident tiles only")
        if self.data is None:
            raise RuntimeError(f"tile {self.name}: a count-only run (compute=False) carries no values")
        return self.data


def _describe(index):
    parts = []
    for ix in index:
        if isinstance(ix, slice):
            parts.append(":" if ix == slice(None) else f"{ix.start}:{ix.stop}")
        else:
            parts.append(str(ix))
    return ",".join(parts)


def _key(index):
    """A hashable form of an index tuple (slices are not hashable before Python 3.12)."""
    return tuple((ix.start, ix.stop) if isinstance(ix, slice) else ix for ix in index)


class Hierarchy:
    """HBM tensors, an SRAM of ``capacity`` elements, and the ledger of what moved between them.

    Args:
        capacity: SRAM size in elements.
        hbm: tensor name -> NumPy array (``compute=True``) or shape tuple (``compute=False``).
        compute: whether tiles carry values.
    """

    def __init__(self, capacity, hbm, compute=True):
        self.capacity = int(capacity)
        self.compute = compute
        self.shapes = {}
        self.arrays = {}
        for name, value in hbm.items():
            self.shapes[name] = tuple(value) if not compute else value.shape
            self.arrays[name] = value if compute else None
        self.resident = []
        self.used = 0
        self.peak = 0
        self.reads = Counter()
        self.writes = Counter()
        self.uncharged = Counter()
        self.steps = []
        self._step = None
        self._touched = set()

    def _shape_of(self, tensor, index):
        """The shape of ``tensor[index]`` for an index of ints and unit-step slices, without the data."""
        dims = self.shapes[tensor]
        # The schedules index with ints and slices of non-negative bounds (the hot path of a count).
        shape = tuple(max(0, (dim if ix.stop is None else min(ix.stop, dim)) - (ix.start or 0))
                      for ix, dim in zip(index, dims) if ix.__class__ is slice)
        return shape + dims[len(index):]

    def _admit(self, tile):
        if self.used + tile.size > self.capacity:
            held = ", ".join(f"{t.name} ({t.size})" for t in self.resident)
            raise SramOverflow(
                f"SRAM overflow: {tile.name} needs {tile.size} elements but only "
                f"{self.capacity - self.used} of the {self.capacity}-element budget are free; "
                f"resident: {held or 'nothing'}"
            )
        self.resident.append(tile)
        self.used += tile.size
        self.peak = max(self.peak, self.used)

    def _charge(self, counter, tensor, n):
        counter[tensor] += n
        if self._step is not None:
            ledger = self._step["reads"] if counter is self.reads else self._step["writes"]
            ledger[tensor] = ledger.get(tensor, 0) + n

    def load(self, tensor, index, reuse=False):
        """Bring ``tensor[index]`` into SRAM as a new tile and charge its elements as reads.

        ``reuse=True`` charges a tile only the first time it is loaded in the current `phase`: the
        standard algorithm's GEMMs are library kernels whose operand re-reads stay on chip, and
        Algorithm 0 of the FlashAttention paper counts each GEMM operand once. Re-reads are
        recorded in ``uncharged`` so the report can show them.
        """
        shape = self._shape_of(tensor, index)
        data = self.arrays[tensor][index].copy() if self.compute else None
        tile = Tile((tensor, index), shape, data)
        self._admit(tile)
        if reuse:
            key = (tensor, _key(index))
            if key in self._touched:
                self.uncharged[tensor] += tile.size
                return tile
            self._touched.add(key)
        self._charge(self.reads, tensor, tile.size)
        return tile

    def alloc(self, name, shape, fill=0.0):
        """On-chip scratch (scores, accumulators, row statistics): takes SRAM, moves nothing."""
        data = np.full(shape, fill, dtype=np.float64) if self.compute else None
        tile = Tile(name, tuple(shape), data)
        self._admit(tile)
        return tile

    def store(self, tile, tensor, index):
        """Write a resident tile to ``tensor[index]`` in HBM, charged as writes."""
        shape = self._shape_of(tensor, index)
        if tuple(shape) != tuple(tile.shape):
            raise ValueError(f"storing {tile.name} of shape {tile.shape} into {tensor}[{_describe(index)}] of shape {shape}")
        if self.compute:
            self.arrays[tensor][index] = tile.a
        self._charge(self.writes, tensor, tile.size)

    def fill(self, tensor, index, value):
        """Write a constant block to HBM (zero-initialization, an empty row's output), charged as writes."""
        shape = self._shape_of(tensor, index)
        if self.compute:
            self.arrays[tensor][index] = value
        self._charge(self.writes, tensor, math.prod(shape))

    def free(self, *tiles):
        for tile in tiles:
            if tile.resident:
                tile.resident = False
                self.resident.remove(tile)
                self.used -= tile.size

    @contextmanager
    def phase(self, name):
        """A pass of the algorithm; `load(reuse=True)` charges each tile once per phase."""
        self._touched = set()
        try:
            yield
        finally:
            self._touched = set()

    @contextmanager
    def step(self, phase, **coords):
        """One tile step: its reads and writes by tensor go into the ledger under these coordinates.

        Tiles loaded or allocated inside the step are evicted when it ends.
        """
        entry = {"phase": phase, **coords, "reads": {}, "writes": {}}
        outer, mark = self._step, len(self.resident)
        self._step = entry
        try:
            yield entry
        finally:
            self.free(*self.resident[mark:])
            self._step = outer
            self.steps.append(entry)
