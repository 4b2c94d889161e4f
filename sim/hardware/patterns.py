"""The addresses each kind of global access in the kernels touches, one warp instruction per row.

Each function mirrors one piece of kernel code (named in its docstring) and returns an ``(instructions,
32)`` array of byte addresses, ``-1`` where a lane does not access memory (rows past the sequence,
columns past the head dim, lanes a branch leaves out), for `sectors` to cost. Copies also return
their shared-memory destinations.

Arrays are described by `Operand`: byte strides and the address of element 0 modulo 1024, which is
all that sector and line counts depend on.
"""

from dataclasses import dataclass

import numpy as np

from numbaflash.kernels.fragments import rows_aligned

LANES = 32
ALIGN = 1024  # allocations start at least this aligned; counts only see addresses modulo 128


@dataclass(frozen=True)
class Operand:
    """A 4-D (batch, seqlen, heads, headdim) or 3-D (batch, heads, seqlen) array: shape, byte strides,
    element size, and the byte address of its first element modulo `ALIGN`."""

    shape: tuple
    strides: tuple
    itemsize: int
    offset: int = 0

    @classmethod
    def contiguous(cls, shape, itemsize, offset=0):
        strides, step = [], itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(tuple(shape), tuple(reversed(strides)), itemsize, offset % ALIGN)

    @classmethod
    def of(cls, array):
        """The operand of a NumPy, CuPy or torch array (its strides and address alignment)."""
        from numbaflash import _arrays

        op = _arrays.describe(array, "array")
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[op.dtype]
        return cls(tuple(op.shape), tuple(op.strides), itemsize, op.ptr % ALIGN)

    def at(self, *index):
        """Byte address of an element (index arrays broadcast)."""
        return self.offset + sum(np.asarray(i, dtype=np.int64) * s for i, s in zip(index, self.strides))

    def address(self, *index):
        """`at` for integer indices, in plain Python (the walks call it once per access)."""
        address = self.offset
        for i, s in zip(index, self.strides):
            address += i * s
        return address

    @property
    def dense(self):
        """Whether the elements fill their memory with no gap (the contiguous layout of this shape)."""
        return self.strides == Operand.contiguous(self.shape, self.itemsize).strides

    @property
    def seqlen(self):
        return self.shape[1] if len(self.shape) == 4 else self.shape[2]


def by_instruction(addresses):
    """Flat lane addresses in thread order (e = 32 w + lane + k THREADS) as rows of 32: every kernel loop
    ``for e in range(tid, n, THREADS)`` gives each warp instruction 32 consecutive e."""
    addresses = np.asarray(addresses, dtype=np.int64).ravel()
    pad = -len(addresses) % LANES
    return np.concatenate([addresses, np.full(pad, -1, dtype=np.int64)]).reshape(-1, LANES)


def staged_rows(op, b, h, row0, rows, headdim, slot_elems, slots):
    """``(addresses, i, c)``: a tile of ``rows`` rows staged by consecutive threads, slot ``c`` (``slot_elems``
    head-dim elements) of row ``i`` at ``e = i * slots + c`` (the stagers of `kernels.simt.tiles`,
    `kernels.mma.tiles` and `kernels.wgmma.tiles`; the preprocess with ``slots`` a multiple of 32).
    A slot is read only inside the sequence and the head dim."""
    e = np.arange(rows * slots)
    i, c = e // slots, e % slots
    valid = (row0 + i < op.seqlen) & (c * slot_elems < headdim)
    addresses = np.where(valid, op.at(b, row0 + i, h, c * slot_elems), -1)
    return by_instruction(addresses), by_instruction(i), by_instruction(c)


def clamped_rows(op, b, h, row0, rows, headdim, slots):
    """Lane addresses of the staged preprocess's loads (`kernels.simt.backward.build_staged_preprocess`): every
    (row, element) of ``rows`` rows, in 32-element steps of ``slots`` per row, each lane's row clamped to the
    sequence's last and its element to the head dim's last, so that rows past the sequence repeat the last
    row's requests (a sequence of no rows loads nothing)."""
    if op.seqlen == 0:
        return by_instruction(np.full(rows * slots, -1))
    e = np.arange(rows * slots)
    i, c = e // slots, e % slots
    return by_instruction(op.at(b, np.minimum(row0 + i, op.seqlen - 1), h, np.minimum(c, headdim - 1)))


def padded_destinations(i, c, D):
    """Shared bytes of the mma.sync stager's copies: rows of D + 8 halves (`kernels.mma.tiles.row_stride`)."""
    return (i * (D + 8) + c * 8) * 2


def swizzled_destinations(i, c, rows):
    """Shared bytes of the wgmma stager's copies: 64-column atoms, 16-byte chunks XOR-swizzled by row."""
    return ((c // 8) * rows * 64 + i * 64 + ((c % 8) ^ (i % 8)) * 8) * 2


def hidden_rows(out, lse, b, h, row_start, row_end):
    """``(out addresses, lse addresses)`` of `kernels.blocks.write_hidden_rows`: consecutive threads write
    consecutive head-dim elements of the rows; the thread at column 0 also writes the row's LSE."""
    headdim = out.shape[3]
    e = np.arange((row_end - row_start) * headdim)
    i, c = e // headdim, e % headdim
    return (by_instruction(out.at(b, row_start + i, h, c)),
            by_instruction(np.where(c == 0, lse.at(b, h, row_start + i), -1)))


def _fragment_lanes(m_tiles, columns):
    """Per lane ``4 g + t`` of the accumulator layout: (m-tile, half, column chunk, element) instructions."""
    mi, half, j, e, g, t = np.meshgrid(np.arange(m_tiles), np.arange(2), np.arange(columns // 8), np.arange(2),
                                       np.arange(8), np.arange(4), indexing="ij")
    shape = (-1, LANES)
    return tuple(x.reshape(shape) for x in (mi, half, j, e, g, t))


def fragment_stores(op, b, h, warp_row, m_tiles, D, paired):
    """`kernels.fragments.fragment_writer`: ``(addresses, bytes a lane stores)``, lane ``4 g + t`` writing rows
    ``g`` and ``g + 8`` of each m-tile, columns ``8 j + 2 t`` and ``+ 1``: with ``paired`` where every row is 4-byte
    aligned, one 32-bit store per column pair, else one 16-bit store per element; rows and columns outside dropped."""
    mi, half, j, e, g, t = _fragment_lanes(m_tiles, D)
    row, col = warp_row + 16 * mi + g + 8 * half, 8 * j + 2 * t + e
    stores = np.where((row < op.seqlen) & (col < op.shape[3]), op.at(b, row, h, col), -1)
    if paired and op.offset % 4 == 0 and rows_aligned(op.strides):
        return stores[e[:, 0] == 0], 4  # the pair's first element; an even head dim leaves no pair half outside
    return stores, 2


def quad_rows(warp_row, m_tiles):
    """Row of each lane for the per-row instructions of a tensor-core warp: instruction ``r`` (0 .. 2 m_tiles - 1),
    lane ``4 g + t`` -> row ``warp_row + 16 (r // 2) + g + 8 (r % 2)`` (`kernels.fragments.lane_row`)."""
    r, g, t = np.meshgrid(np.arange(2 * m_tiles), np.arange(8), np.arange(4), indexing="ij")
    return (warp_row + 16 * (r // 2) + g + 8 * (r % 2)).reshape(-1, LANES), t.reshape(-1, LANES)


def lse_stores(lse, b, h, warp_row, m_tiles):
    """`kernels.softmax`'s ``write_lse``: the quad's first lane writes each row's LSE."""
    row, t = quad_rows(warp_row, m_tiles)
    return np.where((t == 0) & (row < lse.seqlen), lse.at(b, h, row), -1)


def row_statistics(stat, b, h, rows):
    """`kernels.simt.backward.row_statistics` for lanes at ``rows`` (instructions x lanes): LSE and D are
    read for rows inside the sequence (one array of each per call)."""
    return np.where(rows < stat.seqlen, stat.at(b, h, rows), -1)


def stats_rows_mma(q0, block_n, threads):
    """Rows read by the mma.sync dK/dV kernel's ``load_stats``: entry ``i = tid + j THREADS`` of (LSE of the
    tile's rows, then their D) reads row ``q0 + i % block_n`` of both arrays, for ``i < 2 block_n``."""
    per_thread = -(-2 * block_n // threads)
    j, tid = np.meshgrid(np.arange(per_thread), np.arange(threads), indexing="ij")
    i = tid + j * threads
    return np.where(i < 2 * block_n, q0 + i % block_n, 1 << 40).reshape(-1, LANES)


def simt_lanes(threads, cols_t):
    """``(r, c)`` of every lane, one row of 32 per warp: a CUDA-core thread's row group and column group."""
    tid = np.arange(threads).reshape(-1, LANES)
    return tid // cols_t, tid % cols_t


def patch_stores(op, b, h, row0, tiles, D, thread_rows, vv):
    """`kernels.simt.tiles.patch_writer`: thread (r, c) writes row ``row0 + r * thread_rows + a``, columns
    ``g * COLS_T * VV + c * VV + x``, one scalar store per (a, g, x) instruction."""
    r, c = simt_lanes(tiles.threads, tiles.cols_t)
    td = D // tiles.cols_t
    out = []
    for a in range(thread_rows):
        row = row0 + r * thread_rows + a
        for g in range(td // vv):
            for x in range(vv):
                col = g * tiles.cols_t * vv + c * vv + x
                out.append(np.where((row < op.seqlen) & (col < op.shape[3]), op.at(b, row, h, col), -1))
    return np.concatenate(out)
