"""Simulator emulations of `ptx_hopper`: warpgroup products read from shared memory through descriptors.

A wgmma is one exchange among the warpgroup's 128 threads: each deposits its accumulators (and, for
the register form, its A words), the product is computed once from the operands the descriptors
address in ``smem``, and each thread takes back its fragment. It completes at once, a legal schedule of
an asynchronous instruction, so the kernels' fences and waits are what make them correct either way.
The descriptor is decoded as the PTX ISA defines it for the 128-byte swizzle: start address, leading
and stride byte offsets (16-byte units), and the swizzle that XORs address bits 4-6 with bits 7-9.
"""

import functools
import threading

import ml_dtypes
import numpy as np

from . import simulated_blocks
from .exchange import WARPGROUP, exchange, group_result

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SWIZZLE_128B = 1


def shared_address(smem, i):
    return np.uint32(int(i) * smem.itemsize)


def wgmma_fence():
    pass


def wgmma_commit():
    pass


def wgmma_wait0():
    pass


def wgmma_wait1():
    pass


def fence_proxy_async():
    pass


def decode(desc):
    """``(start, leading, stride)`` byte offsets of a 128-byte-swizzle shared-memory matrix descriptor."""
    desc = int(desc)
    if desc >> 62 != SWIZZLE_128B:
        raise ValueError(f"descriptor {desc:#x}: only the 128-byte swizzle is emulated")
    field = lambda shift: ((desc >> shift) & 0x3FFF) << 4
    return field(0), field(16), field(32)


def _swizzle(address):
    return address ^ (((address >> 7) & 7) << 4)


def k_major(smem, desc, rows, dtype):
    """The (rows, 16) operand a K-major descriptor addresses: row r, column k at start + (r // 8) stride
    + (r % 8) 128 + 2 k bytes, swizzled."""
    start, _, stride = decode(desc)
    r, k = np.ogrid[:rows, :16]
    address = _swizzle(start + (r // 8) * stride + (r % 8) * 128 + 2 * k)
    return np.asarray(smem).view(np.uint16)[address // 2].view(dtype).astype(np.float64)


def mn_major_operand(smem, desc, cols, dtype):
    """The (16, cols) operand an MN-major descriptor addresses: row k, column n at start + (n // 64)
    leading + (k // 8) stride + (k % 8) 128 + 2 (n % 64) bytes, swizzled."""
    start, leading, stride = decode(desc)
    k, n = np.ogrid[:16, :cols]
    address = _swizzle(start + (n // 64) * leading + (k // 8) * stride + (k % 8) * 128 + 2 * (n % 64))
    return np.asarray(smem).view(np.uint16)[address // 2].view(dtype).astype(np.float64)


def _fragment_at(n):
    """(rows, cols) of each of a warpgroup's threads' n / 2 accumulators: thread 32 w + 4 g + t holds
    rows 16 w + g (+ 8) and columns 8 j + 2 t (+ 1) at index 4 j + 2 half + e."""
    tid, i = np.ogrid[:WARPGROUP, :n // 2]
    w, g, t = tid // 32, (tid % 32) // 4, tid % 4
    j, half, e = i // 4, (i % 4) // 2, i % 2
    return 16 * w + g + 8 * half, 8 * j + 2 * t + e


def _a_at():
    """(rows, cols) of each thread's four A words' two halves in the register form's 64 x 16 A."""
    tid, r, h = np.ogrid[:WARPGROUP, :4, :2]
    w, g, t = tid // 32, (tid % 32) // 4, tid % 4
    return 16 * w + g + 8 * (r & 1), 2 * t + h + 8 * (r >> 1)


def _product(n, threads, a, b, accumulate):
    at = _fragment_at(n)
    c = np.zeros((64, n), dtype=np.float64)
    if accumulate:
        c[at] = np.array([x[0] for x in threads], dtype=np.float32)
    # Products of 16-bit values are exact in float64; the sum is rounded once, to float32.
    return (a @ b + c).astype(np.float32)[at]


@functools.lru_cache(maxsize=None)
def wgmma_ss(n, storage, mn_major=False, fresh=False):
    dtype = DTYPES[storage]

    def ss(acc, smem, desc_a, desc_b, accumulate):
        def product(threads):
            _, da, db, flag = threads[0]
            flag = flag and not fresh
            if mn_major:
                return _product(n, threads, mn_major_operand(smem, da, 64, dtype).T,
                                mn_major_operand(smem, db, n, dtype), flag)
            return _product(n, threads, k_major(smem, da, 64, dtype), k_major(smem, db, n, dtype).T, flag)

        flat = acc.reshape(-1)
        d, rank = group_result((flat[:n // 2].copy(), int(desc_a), int(desc_b), bool(accumulate)), product, WARPGROUP)
        flat[:n // 2] = d[rank]

    return ss


@functools.lru_cache(maxsize=None)
def wgmma_rs(n, storage, first=0):
    dtype = DTYPES[storage]

    def rs(acc, a0, a1, a2, a3, smem, desc_b):
        def product(threads):
            words = np.array([x[1] for x in threads], dtype=np.uint32)  # (128, 4)
            a = np.zeros((64, 16), dtype=np.float64)
            a[_a_at()] = words.view(dtype).reshape(WARPGROUP, 4, 2)
            return _product(n, threads, a, mn_major_operand(smem, threads[0][2], n, dtype), True)

        flat = acc.reshape(-1)
        d, rank = group_result((flat[first:first + n // 2].copy(), (a0, a1, a2, a3), int(desc_b)), product,
                               WARPGROUP)
        flat[first:first + n // 2] = d[rank]

    return rs


class _Mbarrier:
    """An mbarrier: ``count`` arrivals and every expected transaction byte complete the current phase and
    start the next."""

    def __init__(self, count):
        self.count = self.pending = int(count)
        self.tx = 0  # bytes expected and not yet delivered
        self.phase = 0
        self.sleepers = simulated_blocks.Sleepers()  # threads spinning on the current phase (`mbarrier_try_wait`)
        self.cond = threading.Condition()

    def arrive(self, expect_tx=0):
        with self.cond:
            self.pending -= 1
            self.tx += expect_tx
            self._complete()

    def complete_tx(self, nbytes):
        with self.cond:
            self.tx -= nbytes
            self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            self.sleepers.wake_all()
            self.cond.notify_all()


def _mbarriers():
    manager = threading.current_thread()._manager  # one per running thread block
    return manager.__dict__.setdefault("_numbaflash_mbarriers", {})


def mbarrier_init(smem, i, count):
    _mbarriers()[int(i)] = _Mbarrier(count)


def mbarrier_arrive(smem, i):
    _mbarriers()[int(i)].arrive()


def cp_async_mbarrier_arrive(smem, i):
    # The emulated cp.async lands at once, so every earlier copy of this thread has landed.
    _mbarriers()[int(i)].arrive()


def mbarrier_try_wait(smem, i, parity):
    """1 once the phase of parity ``parity`` has completed (the current phase's parity differs), else 0
    after a short wait (the hardware's try_wait also suspends the thread for a while)."""
    barrier = _mbarriers()[int(i)]
    with barrier.cond:
        if barrier.phase % 2 == int(parity):
            simulated_blocks.waiting(lambda: barrier.phase % 2 == int(parity))
            phase, thread = barrier.phase, threading.current_thread()
            # A thread that tries the same phase again spins on it (`wgmma.pipeline.wait`): asleep until the phase
            # completes (`simulated_blocks.Sleepers`). A single try may be a probe that goes on, and is not counted.
            spinning = thread.__dict__.get("_numbaflash_tried") == (id(barrier), phase)
            thread.__dict__["_numbaflash_tried"] = (id(barrier), phase)
            if spinning:
                barrier.sleepers.add()
            barrier.cond.wait(0.01)
            if spinning and barrier.phase == phase:  # the short wait ran out: awake until the next try
                barrier.sleepers.remove()
        done = barrier.phase % 2 != int(parity)
    if done:
        simulated_blocks.passed()  # outside the barrier's lock (`simulated_blocks.producer_last`)
    return np.uint32(done)


def _whole_warpgroup():
    # setmaxnreg is ``.sync.aligned``: its warpgroup's threads take it together, so a call by part of one meets no
    # one (the simulator fails its block, `simulated_blocks`), where the GPU's is undefined. Registers are not
    # emulated.
    exchange(None, WARPGROUP)


def setmaxnreg_inc(count):
    return _whole_warpgroup


def setmaxnreg_dec(count):
    return _whole_warpgroup


def mbarrier_arrive_expect_tx(smem, i, tx):
    _mbarriers()[int(i)].arrive(int(tx))


TENSOR_MAPS = {}  # key -> [(array (batch, seqlen, heads, headdim), box rows)], written by `wgmma.tensor_maps`


def tensormap_acquire(maps, which):
    pass  # the registry's entries are host objects, visible to every simulated thread


def tma_load_4d(smem, dst, maps, which, c0, c1, c2, c3, barrier):
    array, rows = TENSOR_MAPS[int(maps)][int(which)]
    words = np.asarray(array).view(np.uint16)
    r, col = np.ogrid[:rows, :64]
    row, column = c2 + r, c0 + col
    inside = (row < words.shape[1]) & (column < words.shape[3])
    box = np.where(inside, words[c3, np.minimum(row, words.shape[1] - 1), c1, np.minimum(column, words.shape[3] - 1)], 0)
    address = _swizzle(int(dst) * 2 + r * 128 + col * 2)  # the copy engine writes the 128-byte swizzle
    np.asarray(smem)[address // 2] = box
    _mbarriers()[int(barrier)].complete_tx(rows * 64 * 2)


def bulk_load(smem, dst, src, i, nbytes, barrier):
    """The bytes from ``src[i]`` on (``i`` a tuple of indices), as the copy engine reads them: along the last
    index, which must run contiguously for ``nbytes``."""
    row = np.asarray(src)[tuple(i[:-1])]
    count = int(nbytes) // row.itemsize
    if int(nbytes) % 16 or int(dst) * np.asarray(smem).itemsize % 16 or i[-1] + count > row.shape[0]:
        raise ValueError(f"bulk_load of {nbytes} bytes from index {tuple(i)} of {np.shape(src)} to element {dst}: "
                         "the sizes and addresses must be multiples of 16 bytes, the bytes inside the array")
    data = np.ascontiguousarray(row[i[-1]:i[-1] + count]).view(np.asarray(smem).dtype)
    np.asarray(smem)[int(dst):int(dst) + data.size] = data
    _mbarriers()[int(barrier)].complete_tx(int(nbytes))


_red_lock = threading.Lock()


def red_add2(arr, i, x, y):
    with _red_lock:  # a read-modify-write that no other simulated thread interleaves
        arr[i] += np.float32(x)
        arr[i[:-1] + (i[-1] + 1,)] += np.float32(y)
