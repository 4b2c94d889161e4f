"""DRAM bytes after the L2 cache: the tiles of a kernel's thread blocks, in launch order, through LRU caches.

The model, each part a fact about the launch or a stated simplification:

* Blocks start in launch order, ``resident`` at a time (SMs x blocks per SM), and a block starts in the
  slot of the first one to finish; running blocks advance one tile per step together, so blocks that
  stream the same K/V tiles (the query blocks of a head, the heads of a GQA group) find them where the
  first one left them.
* A read of a tile not in the cache reads its bytes from DRAM; a write allocates without reading and
  is written back when evicted. Dirty bytes still cached when the kernel ends are written after it,
  where ncu does not count them (so a small kernel's outputs hardly reach DRAM during it).
* The cache starts empty of the kernel's data (ncu flushes caches before each measured pass).
* Capacity is not one number: lines hash to sets, a line that SMs of both L2 partitions read is held
  in both, and replacement is not strict LRU. One LRU cache of any single size turns a working set just
  past it into a miss on every pass, where the counters show a ramp (headdim 128 at N = 16384 re-read
  part of K and V, not all). So the result is the mean over LRU caches of `CAPACITY_FRACTIONS` of L2,
  bounds chosen on the H100 grid of `scripts/measure_io.py` (one LRU size of half L2 was off by up to
  18% there, this mean by at most 10%).
"""

from collections import OrderedDict

CAPACITY_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8)


def dram_bytes(blocks, resident, l2_bytes):
    """``(read, written)`` DRAM bytes of ``blocks`` (launch order; each a list of ``(tile, bytes, written)``),
    ``resident`` at a time, on a GPU with ``l2_bytes`` of L2: the mean over `CAPACITY_FRACTIONS`."""
    accesses = schedule(blocks, resident)
    results = [lru(accesses, int(l2_bytes * f)) for f in CAPACITY_FRACTIONS]
    return (sum(r for r, _ in results) // len(results), sum(w for _, w in results) // len(results))


def schedule(blocks, resident):
    """Every access in the order the running blocks make them: ``(tile number, bytes, written)``."""
    numbers = {}
    accesses = []
    running = [[i, 0] for i in range(min(resident, len(blocks)))]  # [block, next step] per SM slot
    waiting = len(running)
    while running:
        for slot in running:
            block = blocks[slot[0]]
            if slot[1] < len(block):
                tile, nbytes, write = block[slot[1]]
                accesses.append((numbers.setdefault(tile, len(numbers)), nbytes, write))
            slot[1] += 1
        for slot in [s for s in running if s[1] >= len(blocks[s[0]])]:
            if waiting < len(blocks):
                slot[0], slot[1] = waiting, 0
                waiting += 1
            else:
                running.remove(slot)
    return accesses


def lru(accesses, capacity):
    """``(read, written)`` DRAM bytes of ``accesses`` through one LRU cache of ``capacity`` bytes."""
    cache = OrderedDict()  # tile -> dirty
    sizes = {}
    size = read = written = 0
    for tile, nbytes, write in accesses:
        if tile in cache:
            cache.move_to_end(tile)
            if write:
                cache[tile] = True
            continue
        if not write:
            read += nbytes
        cache[tile] = write
        sizes[tile] = nbytes
        size += nbytes
        while size > capacity:
            evicted, dirty = cache.popitem(last=False)
            size -= sizes[evicted]
            if dirty:
                written += sizes[evicted]
    return read, written
