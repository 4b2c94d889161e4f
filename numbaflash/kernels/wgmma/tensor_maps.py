"""Tensor maps for the bulk tensor copy engine (TMA): how a producer's copies find a 4-D operand.

A map describes a (batch, seqlen, heads, headdim) array of 16-bit words to the copy engine: dims
innermost first (headdim, heads, seqlen, batch), their byte strides, and a box of 64 head-dim elements
x 1 head x ``rows`` rows x 1 batch element, which lands in shared memory as one 128-byte-swizzle atom
(`wgmma.tiles`); rows past the sequence and columns past the head dim arrive as zeros. The engine needs
the head dim contiguous, the other strides and the address 16-byte aligned: `interface.vector_staging`.

On a GPU the driver encodes each map (cuTensorMapEncodeTiled) and the kernel reads it from device
memory. A map depends only on the operand's address, shape, strides and box, so a set of maps is
encoded and copied once and kept (the last `KEPT` sets). On the simulator a map set is a registry
entry of the operands and boxes, which the emulated copy reads.
"""

import functools
import itertools

import numpy as np

from ..intrinsics import SIMULATOR, TENSOR_MAPS

MAP_BYTES = 128
KEPT = 256
BOX_COLUMNS = 64  # one swizzle atom: 128 bytes of 16-bit elements


def spec(op, rows):
    """What a map of operand ``op`` (an `_arrays.Operand`) with boxes of ``rows`` rows depends on. A packed
    (varlen) operand's stride-0 batch axis (`kernels.sequences`) is one batch element: its kernels address
    rows of the whole packed array, at batch index 0."""
    shape, strides = tuple(op.shape), tuple(op.strides)
    if strides[0] == 0:
        shape, strides = (1,) + shape[1:], (shape[1] * strides[1],) + strides[1:]
    return (op.ptr, shape, strides, rows)


def maps(ops_and_rows):
    """The address (registry key on the simulator) of consecutive maps of ``(operand, rows)`` pairs."""
    if SIMULATOR:
        key = next(_keys)
        TENSOR_MAPS[key] = [(op.obj, rows) for op, rows in ops_and_rows]
        while len(TENSOR_MAPS) > KEPT:
            TENSOR_MAPS.pop(next(iter(TENSOR_MAPS)))
        return key
    # The operands' GPU, current while the call runs (asking numba for the current device costs more).
    return _device_maps(ops_and_rows[0][0].device, tuple(spec(op, rows) for op, rows in ops_and_rows)).ptr


_keys = itertools.count(1)


def encode(ptr, shape, strides, rows):
    """The 128 bytes of one map (GPU: the driver encodes them)."""
    from cuda.bindings import driver as cu

    batch, seqlen, heads, headdim = shape
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, ptr,
        [u64(headdim), u64(heads), u64(seqlen), u64(batch)], [u64(strides[2]), u64(strides[1]), u64(strides[0])],
        [u32(BOX_COLUMNS), u32(1), u32(rows), u32(1)], [u32(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err.name}) for shape {shape}, strides {strides}")
    return np.array(tmap.opaque, dtype=np.uint64).tobytes()


class _DeviceMaps:
    """Maps in device memory (64-byte aligned, as the copy engine requires: cuMemAlloc aligns to 256)."""

    def __init__(self, blob):
        from cuda.bindings import driver as cu

        # Kept for __del__: at interpreter exit, a cached set is freed after imports stop working.
        self._driver = cu
        err, self.ptr = cu.cuMemAlloc(len(blob))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemAlloc of {len(blob)} bytes for tensor maps failed ({err.name})")
        self.ptr = int(self.ptr)
        (err,) = cu.cuMemcpyHtoD(self.ptr, blob, len(blob))  # synchronous: done before any kernel reads it
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"copying tensor maps to the GPU failed ({err.name})")

    def __del__(self):
        # A kernel launched earlier may still read these maps: finish the context's work first.
        self._driver.cuCtxSynchronize()
        self._driver.cuMemFree(self.ptr)


@functools.lru_cache(maxsize=KEPT)
def _device_maps(device, specs):
    return _DeviceMaps(b"".join(encode(*s) for s in specs))
