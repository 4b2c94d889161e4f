"""What the warp-specialized wgmma kernels share: the producer warpgroup, its registers, and the mbarrier steps.

A producer warpgroup (warpgroup 0) fills rings of tiles in shared memory; consumer warpgroups after it
compute. Each ring stage has a "full" mbarrier, on which its copies land (bulk tensor copies by byte
count, `copy_tile`), and an "empty" one, on which each consumer warpgroup arrives once it has read the
stage (`release`). Used by the forward (`ws_forward`) and the backward (`ws_backward`).
"""

from numba import types

from ..intrinsics import (device_function, fence_proxy_async, mbarrier_arrive, mbarrier_try_wait, named_barrier_sync,
                          setmaxnreg_dec, setmaxnreg_inc, tma_load_4d)
from .tiles import ATOM

PRODUCER = 128  # threads of the producer warpgroup
BARRIER_ELEMENTS = 4  # 16-bit elements per 8-byte mbarrier
TAIL_BARRIER = 15  # the named barrier of a producer warp that zeroes a packed sequence's last tile (`tail_zeroer`)
# Registers per thread after setmaxnreg, by consumer warpgroups: the block starts with 65536 / threads
# rounded down to 8 (168 at 384 threads, 128 at 512), and the consumers' raise must not exceed what the
# producer's cut frees, or setmaxnreg.inc waits forever. The producer issues the copies with 24, so three
# consumers take 160 (with 152 a block mask or ALiBi at headdim 64 kept 8 and 140 bytes of local memory).
REGISTERS = {1: (56, 256), 2: (24, 240), 3: (24, 160)}
# Two blocks of one consumer per multiprocessor (`tiling.WgmmaTiles.blocks_per_sm`) start at 128 a thread.
SHARED_REGISTERS = {1: (24, 232)}


def check_registers(table, blocks_per_sm=1):
    """Refuse a table of ``{consumers: (producer's, consumers' registers)}`` whose raise would wait forever."""
    for consumers, (low, high) in table.items():
        if low + consumers * high > (consumers + 1) * (65536 // (128 * (consumers + 1) * blocks_per_sm) // 8 * 8):
            raise ValueError(f"{consumers} consumers of {high} registers beside a producer of {low} do not fit "
                             f"{blocks_per_sm} block(s) per multiprocessor")
    return table


check_registers(REGISTERS)
check_registers(SHARED_REGISTERS, 2)


def register_moves(tiles, tables=(REGISTERS, SHARED_REGISTERS)):
    """``(release, take)``: the producer's setmaxnreg down and the consumers' up to their registers per thread for
    `WgmmaTiles` ``tiles``, from ``tables``: one block per multiprocessor's, two blocks'."""
    low, high = tables[tiles.blocks_per_sm - 1][tiles.warpgroups]
    return setmaxnreg_dec(low), setmaxnreg_inc(high)


@device_function
def wait(smem, barrier, parity):
    """Until the phase of ``parity`` of the mbarrier at element ``barrier`` has completed."""
    while mbarrier_try_wait(smem, barrier, parity) == 0:
        pass


@device_function
def release(smem, barrier, ctid):
    """A consumer warpgroup's one arrival on an empty mbarrier (``ctid``: the thread's index among the
    consumers). A wgmma is the warpgroup's, so once its wait returns in one thread, the product has read its
    whole tile; an arrival by each of the 128 threads made a stage's mbarrier take 256 arrivals per tile."""
    if ctid % 128 == 0:
        mbarrier_arrive(smem, barrier)


def tail_zeroer(D):
    """``zero_rows(words, at, rows, first, lane)``: the 32 lanes of a producer warp zero rows ``first ..`` of the
    ``rows``-row swizzled tile at element ``at``, 8 bytes a store (``words``: the same shared memory as uint64).

    A packed (varlen) sequence's operands are one tensor map's rows (`tensor_maps.spec`), so a tile that
    reaches past the sequence brings the next sequence's rows, where a padded batch's copies bring zeros; the
    kernels' zero scores and probabilities times an inf or NaN there would reach this sequence's results. Such
    a tile lands on a barrier of the producer's own; its warp zeroes the extra rows and `hand_over` releases it.
    A row is one 128-byte line of each swizzle atom, whatever the swizzle does inside it."""
    ATOMS = D // ATOM

    @device_function
    def zero_rows(words, at, rows, first, lane):
        for a in range(ATOMS):
            for i in range((at + (a * rows + first) * ATOM) // 4 + lane, (at + (a + 1) * rows * ATOM) // 4, 32):
                words[i] = types.uint64(0)

    return zero_rows


@device_function
def hand_over(smem, full, lane):
    """After `tail_zeroer`'s stores: they reach wgmma's reads (the async proxy), and lane 0's arrival on the
    stage's ``full`` mbarrier (which expects one) releases the tile to the consumers."""
    fence_proxy_async()
    named_barrier_sync(TAIL_BARRIER, 32)
    if lane == 0:
        mbarrier_arrive(smem, full)


def bulk_copier(D):
    """``copy_tile(smem, dst, full, maps, which, head, row, b, rows)``: rows ``row ..`` of ``head`` of batch
    element ``b`` through map ``which`` into the swizzled tile at element ``dst``, one box per swizzle atom of
    head dim ``D``, landing on the ``full`` mbarrier; whoever issues them announces their ``2 rows D`` bytes
    first (``mbarrier_arrive_expect_tx``)."""
    ATOMS = D // ATOM

    @device_function
    def copy_tile(smem, dst, full, maps, which, head, row, b, rows):
        for a in range(ATOMS):
            tma_load_4d(smem, dst + a * rows * ATOM, maps, which, a * ATOM, head, row, b, full)

    return copy_tile
