"""How each storage dtype enters and leaves a kernel.

Kernels accumulate in float32 (float64 for float64 inputs). Every input element is converted once, when
its tile is staged in shared memory, and every output element is rounded once, when it is written.
bfloat16 arrays reach the kernels as their raw uint16 bits (numba has no bfloat16 array type that also
runs under the simulator): widening is a 16-bit shift, narrowing rounds to nearest even.
"""

import numpy as np
from numba import float32, float64, uint16, uint32
from numba.types import float16

from .intrinsics import bits_float, device_function, float_bits

STORAGE = ("float16", "bfloat16", "float32", "float64")


@device_function
def f32_to_f16(x):
    return float16(x)


@device_function
def bf16_to_f32(bits):
    return bits_float(uint32(bits) << 16)


@device_function
def f32_to_bf16(x):
    bits = float_bits(float32(x))
    if (bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(0x7FC0)  # NaN stays a quiet NaN (rounding could carry it into infinity)
    bits = bits + uint32(0x7FFF) + ((bits >> 16) & uint32(1))
    return uint16(bits >> 16)


@device_function
def to_f32(x):
    return float32(x)


@device_function
def to_f64(x):
    return float64(x)


def codec(storage):
    """``(accumulator type, load, store)`` for a storage dtype name."""
    return {
        "float16": (float32, to_f32, f32_to_f16),
        "bfloat16": (float32, bf16_to_f32, f32_to_bf16),
        "float32": (float32, to_f32, to_f32),
        "float64": (float64, to_f64, to_f64),
    }[storage]


def kernel_dtype(storage):
    """The NumPy dtype a kernel's array arguments have for a storage dtype (bfloat16 as raw bits)."""
    return np.dtype({"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}[storage])
