"""Simulator emulations of the intrinsics of `ptx`: plain Python with the same semantics.

Under NUMBA_ENABLE_CUDASIM=1 kernels are Python too, so these are called as they are. Collectives go
through `exchange`. Each is tested against its definition in tests/test_intrinsics.py, in both modes.
"""

import threading

import ml_dtypes
import numpy as np

from . import simulated_blocks
from .exchange import Meeting as _Meeting, exchange, group_result
from .polynomials import EX2_FMA_COEFFICIENTS, EX2_FMA_F16X2_COEFFICIENTS, EX2_FMA_F16X2_FLOOR, EX2_FMA_F16X2_MAGIC

_registry_lock = threading.Lock()


def _group(value, width):
    lanes, lane = exchange(value)
    start = lane - lane % width
    return lanes[start:start + width]

def group_max(value, width):
    return max(_group(value, width))

def warp_any(predicate):
    lanes, _ = exchange(bool(predicate))
    return any(lanes)

def warp_uniform(value):
    # Lane 0's value, through an exchange as the shuffle takes it: a call by part of a warp then waits for the
    # missing lanes (`simulated_blocks` reports the block's deadlock), where the hardware's shfl.sync hangs. Returning
    # ``value`` let a packed forward's copies, issued by one thread, pass the simulator and hang the H200.
    lanes, _ = exchange(value)
    return lanes[0]

def group_sum(value, width):
    # The butterfly's order of additions, so the simulator rounds exactly as the GPU does.
    values = _group(value, width)
    lane = threading.current_thread().thread_id % width
    offset = width // 2
    while offset > 0:
        values = [values[i] + values[i ^ offset] for i in range(width)]
        offset //= 2
    return values[lane]

def _along(i, x):
    """Index ``i`` (an integer, or a tuple of them) moved ``x`` elements along the last axis."""
    return i[:-1] + (i[-1] + x,) if isinstance(i, tuple) else i + x

def _vector(arr, i, n):
    return tuple(arr[_along(i, x)] for x in range(n))

def load2(arr, i):
    return _vector(arr, i, 2)

def load4(arr, i):
    return _vector(arr, i, 4)

def store2(arr, i, lo, hi):
    # The hardware's one store of both elements faults unless it is aligned to their size: this refuses it alike.
    index = i if isinstance(i, tuple) else (i,)
    address = arr.__array_interface__["data"][0] + sum(int(x) * stride for x, stride in zip(index, arr.strides))
    if address % (2 * arr.itemsize):
        raise ValueError(f"store2 at {i}: the two elements are not aligned to {2 * arr.itemsize} bytes")
    arr[i], arr[_along(i, 1)] = lo, hi

def store2_row(arr, i, col, lo, hi):
    # The hardware's store runs along the row from its first element's address, so it writes elsewhere unless the
    # last axis is contiguous: this refuses such an array.
    if arr.strides[-1] != arr.itemsize:
        raise ValueError(f"store2_row: the last axis's stride is {arr.strides[-1]} bytes, not {arr.itemsize}")
    store2(arr, tuple(i) + (col,), lo, hi)

def float_bits(x):
    return np.array(x, dtype=np.float32).view(np.uint32)[()]

def bits_float(u):
    return np.array(u, dtype=np.uint32).view(np.float32)[()]

# Where lane l's register r, half h sits in A (16 x 16) and B (16 x 8), and register r in C/D (16 x 8).
_l, _r, _h = np.ogrid[:32, :4, :2]
A_AT = ((_l >> 2) + 8 * (_r & 1), 2 * (_l & 3) + _h + 8 * (_r >> 1))
_l, _r, _h = np.ogrid[:32, :2, :2]
B_AT = (2 * (_l & 3) + _h + 8 * _r, np.broadcast_to(_l >> 2, (32, 2, 2)))
_l, _r = np.ogrid[:32, :4]
C_AT = ((_l >> 2) + 8 * (_r >> 1), 2 * (_l & 3) + (_r & 1))

def _matrix(words, dtype, shape, at):
    """A warp's fragment registers (uint32 of two 16-bit values, low half first) as one matrix."""
    m = np.zeros(shape, dtype=np.float64)
    regs = np.array(words, dtype=np.uint32)
    m[at] = regs.view(dtype).reshape(regs.shape + (2,))
    return m

def _mma(dtype, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    def product(lanes):
        a = _matrix([x[0] for x in lanes], dtype, (16, 16), A_AT)
        b = _matrix([x[1] for x in lanes], dtype, (16, 8), B_AT)
        c = np.zeros((16, 8), dtype=np.float64)
        c[C_AT] = np.array([x[2] for x in lanes], dtype=np.float32)
        # Products of 16-bit values are exact in float32; the sum is rounded once, to float32.
        return (a @ b + c).astype(np.float32)

    d, lane = group_result(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), product)
    g, t = lane >> 2, lane & 3
    return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

def mma_f16(*regs):
    return _mma(np.float16, *regs)

def mma_bf16(*regs):
    return _mma(ml_dtypes.bfloat16, *regs)

def _word(lo, hi):
    return np.uint32(int(lo) | (int(hi) << 16))

def ldmatrix_x4(smem, i):
    rows, lane = exchange(int(i))
    g, t = lane >> 2, lane & 3
    return tuple(_word(smem[rows[8 * j + g] + 2 * t], smem[rows[8 * j + g] + 2 * t + 1]) for j in range(4))

def ldmatrix_x4_trans(smem, i):
    rows, lane = exchange(int(i))
    g, t = lane >> 2, lane & 3
    return tuple(_word(smem[rows[8 * j + 2 * t] + g], smem[rows[8 * j + 2 * t + 1] + g]) for j in range(4))

def cp_async_16(smem, i, src, index, nbytes):
    # The copy completes at once: a legal schedule of an asynchronous copy (it may land any time
    # before the wait), so the kernels' barriers and waits are what make it correct either way.
    b, row, h, col = index
    for x in range(8):
        smem[i + x] = src[b, row, h, col + x] if nbytes else 0

def cp_async_commit():
    pass

def cp_async_wait_all():
    pass

def cp_async_wait_one():
    pass

def _pack(lo, hi, dtype):
    return np.array([lo, hi], dtype=np.float32).astype(dtype).view(np.uint32)[0]

def pack_f16(lo, hi):
    return _pack(lo, hi, np.float16)

def pack_bf16(lo, hi):
    return _pack(lo, hi, ml_dtypes.bfloat16)

def ex2(x):
    return np.float32(np.exp2(np.float32(x)))

def ex2_fma(x):
    # ptx.ex2_fma step by step: float64 Horner steps round like fma.rn (a float32 product is exact in float64)
    # but for the rare double rounding of a tie.
    x = np.maximum(np.float32(x), np.float32(-127))
    if not np.isfinite(x):
        return np.float32(np.nan)
    floor = np.floor(x)
    f = np.float64(np.float32(x - floor))
    c1, c2, c3 = (np.float64(np.float32(c)) for c in EX2_FMA_COEFFICIENTS)
    p = np.float32(f * c3 + c2)
    p = np.float32(np.float64(p) * f + c1)
    p = np.float32(np.float64(p) * f + 1.0)
    power = np.uint32(((int(floor) + 127) << 23) & 0xFFFFFFFF).view(np.float32)
    return np.float32(p * power)

def _half(v):
    """``v`` rounded to float16, held in float64 (which holds each float16 sum and fused product exactly, so rounding
    it to float16 rounds like an f16x2 instruction)."""
    return np.float64(np.float16(v))


_F16X2_COEFFICIENTS = tuple(_half(c) for c in EX2_FMA_F16X2_COEFFICIENTS)


def _ex2_fma_half(x):
    # one half of ptx.ex2_fma_f16x2, step by step
    with np.errstate(over="ignore"):  # beyond float16's range: infinite, as cvt.rn.f16x2.f32 gives
        x = _half(np.float32(x))
    if np.isnan(x):
        return np.float16(np.nan)
    x = max(x, float(EX2_FMA_F16X2_FLOOR))
    t = _half(x + EX2_FMA_F16X2_MAGIC)
    f = _half(x - _half(t - EX2_FMA_F16X2_MAGIC))
    c0, c1, c2, c3 = _F16X2_COEFFICIENTS
    p = _half(f * c3 + c2)
    p = _half(p * f + c1)
    p = _half(p * f + c0)
    power = np.uint16((int(np.float16(t).view(np.uint16)) << 10) & 0x7C00).view(np.float16)
    return np.float16(p * np.float64(power))

def ex2_fma_f16x2(lo, hi):
    return np.uint32(int(_ex2_fma_half(hi).view(np.uint16)) << 16 | int(_ex2_fma_half(lo).view(np.uint16)))

def rcp(x):
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1) / np.float32(x))

def tanh_approx(x):
    return np.float32(np.tanh(np.float32(x)))


def _named_barrier(barrier):
    manager = threading.current_thread()._manager  # one per running thread block
    with _registry_lock:  # the block's threads find or make its barriers together
        barriers = manager.__dict__.setdefault("_numbaflash_named_barriers", {})
        return barriers.setdefault(int(barrier), _Meeting())


def named_barrier_sync(barrier, threads):
    # A hardware barrier other than syncthreads': the ``threads``-th arrival completes it and releases the threads
    # that wait (``bar.sync``); an arriving thread (``bar.arrive``) does not wait.
    _named_barrier(barrier).arrive(int(threads), True, simulated_blocks.waiting)
    simulated_blocks.passed()  # outside the barrier's lock, which the others need to arrive


def named_barrier_arrive(barrier, threads):
    _named_barrier(barrier).arrive(int(threads), False, simulated_blocks.waiting)
