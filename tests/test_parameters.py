"""`kernels.parameters`: a launch's arguments packed at the offsets the driver gives for the kernel's
parameters (numba's ABI: an array is meminfo, parent, nitems, itemsize, data, shape..., strides...)."""

import ctypes
import struct

import numpy as np
import pytest
from numba import types

from numbaflash import _arrays
from numbaflash.kernels import parameters

SIGNATURE = (types.Array(types.uint16, 4, "A"), types.float32, types.boolean, types.int64,
             types.Tuple((types.Array(types.int32, 2, "A"), types.float64)))


def natural_offsets(sizes):
    """C's layout of parameters of these sizes, each aligned to its size (what nvcc's ABI gives)."""
    offsets, at = [], 0
    for size in sizes:
        at = -(-at // size) * size
        offsets.append(at)
        at += size
    return offsets


def test_arguments_land_at_their_parameters_offsets():
    q = np.zeros((2, 3, 4, 8), np.uint16)[:, :, :, ::2]  # strided
    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    args = (_arrays.describe(q, "q"), 0.75, True, -5, (_arrays.describe(table, "table"), 2.5))
    sizes = [8] * 13 + [4, 1, 8] + [8] * 9 + [8]
    offsets = natural_offsets(sizes)
    packer = parameters.Packer(SIGNATURE, offsets)
    buffer, size, extra = packer.pack(args)[:3]
    assert list(extra)[1] == ctypes.addressof(buffer) and list(extra)[3] == ctypes.addressof(size)
    assert size.value == packer.size == offsets[-1] + 8
    raw = bytes(buffer)

    def at(i, code):
        return struct.unpack_from("<" + code, raw, offsets[i])[0]

    want_q = [0, 0, q.size, 2, q.ctypes.data, *q.shape, *q.strides]
    assert [at(i, "q") for i in range(13)] == want_q
    assert (at(13, "f"), at(14, "?"), at(15, "q")) == (0.75, True, -5)
    assert [at(16 + i, "q") for i in range(9)] == [0, 0, 6, 4, table.ctypes.data, 2, 3, 12, 4]
    assert at(25, "d") == 2.5


def test_a_kernel_whose_parameters_differ_from_its_signature_is_refused():
    with pytest.raises(RuntimeError, match="takes 3 parameters, its signature gives 26"):
        parameters.Packer(SIGNATURE, [0, 8, 16])


def test_a_remembered_layout_packs_what_a_full_pack_does():
    # A layout's later launches copy the kept bytes and write only addresses and int64 scalars; other float or
    # bool scalars pack in full. Every combination must give the bytes of a full pack.
    offsets = natural_offsets([8] * 13 + [4, 1, 8] + [8] * 9 + [8])
    packer = parameters.Packer(SIGNATURE, offsets)
    layout = {}
    for value, count in ((0.75, 3), (0.75, -7), (-1.5, -7), (-1.5, 2**40)):
        q = np.zeros((2, 3, 4, 8), np.uint16)[:, :, :, ::2]
        table = np.arange(6, dtype=np.int32).reshape(2, 3)
        args = (_arrays.describe(q, "q"), value, value > 0, count, (_arrays.describe(table, "table"), 2 * value))
        remembered = bytes(packer.pack(args, layout)[0])
        full = bytes(packer.pack(args)[0])
        assert remembered == full, (value, count)
        assert struct.unpack_from("<q", full, offsets[15])[0] == count
    assert list(layout) == [packer]
