"""What a warp's memory instructions cost in 32-byte sectors: the unit Nsight Compute counts.

A warp-wide load or store is served sector by sector: its 32 lanes' accesses cost the number of
distinct 32-byte sectors they touch, so 32 two-byte stores to eight rows cost eight sectors where one
row's 64 contiguous bytes cost two. Every function here takes one tile's instructions as a 2-D array,
one row per warp instruction and one column per lane (a 1-D array is one instruction), of byte addresses (``-1`` for a lane that does not
access memory), and returns the sectors they cost.

Measured on an H100 with `scripts/measure_io.py`, these rules matched ncu's counters exactly:

* `sectors`: ordinary loads and stores (``l1tex__t_sectors_pipe_lsu_mem_global_op_ld`` / ``_st``).
* `copy_sectors`: cp.async (LDGSTS, counted with the loads). Each 128-byte global line an instruction
  reads costs the distinct 32-byte sectors of shared memory its bytes land in: the mma.sync kernels' rows,
  padded by 16 bytes in shared memory, cost 9/8 of their bytes; wgmma's swizzled rows cost exactly theirs.
* `box_bytes`: what a bulk tensor copy (TMA) delivers (``l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld``),
  by a rule measured rather than derived (see there).
"""

import numpy as np

SECTOR = 32
LINE = 128
NO_ACCESS = -1


def _distinct_per_row(keys):
    """Distinct non-negative values in each row of ``keys``, summed over rows."""
    if keys.size == 0:
        return 0
    ordered = np.sort(keys, axis=1)
    new = np.ones(ordered.shape, dtype=bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return int((new & (ordered >= 0)).sum())


def sectors(addresses):
    """Sectors that ordinary loads or stores at ``addresses`` (instructions x lanes) cost.

    Each lane's access is at most 16 bytes and aligned to its size, so it lies in one sector.
    """
    addresses = np.atleast_2d(np.asarray(addresses, dtype=np.int64))
    return _distinct_per_row(np.where(addresses >= 0, addresses // SECTOR, NO_ACCESS))


def copy_sectors(addresses, destinations):
    """Sectors that cp.async copies cost: per instruction, for each 128-byte global line it reads, the
    distinct shared-memory sectors that line's bytes are written to (``destinations``: shared byte offsets)."""
    addresses = np.atleast_2d(np.asarray(addresses, dtype=np.int64))
    destinations = np.atleast_2d(np.asarray(destinations, dtype=np.int64))
    keys = (addresses // LINE) * (1 << 24) + destinations // SECTOR
    return _distinct_per_row(np.where(addresses >= 0, keys, NO_ACCESS))


def box_bytes(row_addresses, row_bytes, box_row_bytes):
    """Bytes a bulk tensor copy (TMA) delivers for one box: ``box_row_bytes`` per box row, inside the tensor
    or not, and one more sector for each row inside it (``row_addresses`` >= 0) whose ``row_bytes`` of
    columns inside the tensor end within a sector.

    An empirical rule: on the H100, boxes of 64 columns (128 bytes) per row delivered 128 bytes per row
    at head dims 48 and 64 and 160 at 40 and 56 (rows of 80 and 112 bytes), and every row of a partial last
    tile past the sequence 128 (`scripts/measure_io.py`, .bench/tma_probe.py)."""
    rows = np.asarray(row_addresses, dtype=np.int64)
    inside = int((rows >= 0).sum())
    return rows.size * box_row_bytes + (inside * SECTOR if row_bytes % SECTOR else 0)


def unique_bytes(addresses, size):
    """Bytes of the distinct sectors that accesses of ``size`` bytes at ``addresses`` touch, whatever the
    instruction: what DRAM moves for them at most once."""
    addresses = np.asarray(addresses, dtype=np.int64).ravel()
    addresses = addresses[addresses >= 0]
    if addresses.size == 0:
        return 0
    first, last = addresses // SECTOR, (addresses + size - 1) // SECTOR
    ids = np.unique(np.concatenate([first, last]))
    return int(ids.size) * SECTOR
