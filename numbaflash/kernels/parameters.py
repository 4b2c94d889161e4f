"""A kernel's parameters packed into one buffer, and its launch through the driver's cuLaunchKernel.

numba's kernel ABI flattens every argument: an array is (meminfo, parent, nitems, itemsize, data, shape...,
strides...), eight bytes each, a scalar its C type, a tuple argument its members one after another. The
driver takes them either as one pointer per parameter or as one buffer laid out at the parameters' offsets
(``CU_LAUNCH_PARAM_BUFFER_POINTER`` in cuLaunchKernel's ``extra``). The buffer is one `struct` pack from
the offsets the driver reports for the function: cuda.core's ``launch`` converted each of the v5 forward's 68
parameters on its own, 25-37 microseconds per launch on the H100's host, more than SDPA's whole call (16).
"""

import ctypes
import functools
import itertools
import math
import struct
import threading

from numba import types
from numba.np.numpy_support import as_dtype

# struct codes of the scalar parameters the kernels take (arrays' members are all 'q')
_CODES = {types.float32: "f", types.float64: "d", types.int64: "q", types.boolean: "?"}
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0  # cuLaunchKernel's extra keys (CU_LAUNCH_PARAM_*)


def flat_types(signature):
    """A signature's parameters in numba's ABI order: a tuple argument is its members, one after another."""
    for t in signature:
        if isinstance(t, types.BaseTuple):
            yield from flat_types(t)
        else:
            yield t


def flat_values(args, values):
    """`flat_types`'s order for a launch's arguments, appended to ``values``."""
    for a in args:
        if type(a) is tuple:
            flat_values(a, values)
        else:
            values.append(a)


class Packer:
    """Packs a launch's arguments into the parameter buffer of a kernel with ``signature``, at the ``offsets``
    (bytes) the driver gives for its parameters (cuFuncGetParamInfo; cuda.core's ``Kernel.arguments_info``)."""

    def __init__(self, signature, offsets):
        flat = list(flat_types(signature))
        # An array is 5 + 2 ndim 8-byte members (numba's ABI), a scalar its C type.
        sizes = [5 + 2 * t.ndim if isinstance(t, types.Array) else 1 for t in flat]
        codes = [code for t, n in zip(flat, sizes)
                 for code in (["q"] * n if isinstance(t, types.Array) else [_CODES[t]])]
        if len(codes) != len(offsets):
            raise RuntimeError(f"the compiled kernel takes {len(offsets)} parameters, its signature gives {len(codes)}")
        layout, at = "<", 0
        for code, offset in zip(codes, offsets):
            if offset < at:
                raise RuntimeError(f"kernel parameter offsets overlap: {offsets}")
            layout += "x" * (offset - at) + code
            at = offset + struct.calcsize("<" + code)
        self._struct = struct.Struct(layout)
        self.size = self._struct.size
        self._itemsizes = [as_dtype(t.dtype).itemsize if isinstance(t, types.Array) else None for t in flat]
        # What changes from launch to launch of one layout: an array's address (its fifth member) and an int64
        # scalar, written as 8-byte words (the driver aligns them so), and the other scalars, compared.
        starts = [0] + list(itertools.accumulate(sizes))[:-1]
        words = [(offsets[at + 4] if itemsize is not None else offsets[at], i, itemsize is not None)
                 for i, (at, t, itemsize) in enumerate(zip(starts, flat, self._itemsizes))
                 if itemsize is not None or t == types.int64]
        if any(offset % 8 for offset, _, _ in words):
            raise RuntimeError(f"kernel parameter offsets are not 8-byte aligned: {offsets}")
        self._words = [(offset // 8, i, is_array) for offset, i, is_array in words]
        self._compared = [i for i, (t, itemsize) in enumerate(zip(flat, self._itemsizes))
                          if itemsize is None and t != types.int64]
        self._local = threading.local()

    def _values(self, flat):
        """The parameter values of a launch's flattened arguments: array arguments are `_arrays.Operand`s (viewed
        as the kernel's dtype), scalars numbers."""
        values = []
        for a, itemsize in zip(flat, self._itemsizes):
            if itemsize is None:
                values.append(a)
            else:
                values += (0, 0, math.prod(a.shape), itemsize, a.ptr, *a.shape, *a.strides)
        return values

    def _slot(self):
        """This thread's buffer, made once: the driver copies the buffer when the launch is issued, and a buffer
        shared between threads could change under another thread's launch (ctypes lets go of the GIL while
        the driver runs). ``(buffer, size, extra, address of extra, the buffer as 8-byte words)``."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            words = (ctypes.c_int64 * (-(-self.size // 8)))()
            buffer, size = (ctypes.c_char * self.size).from_buffer(words), ctypes.c_size_t(self.size)
            extra = (ctypes.c_void_p * 5)(_BUFFER_POINTER, ctypes.addressof(buffer), _BUFFER_SIZE,
                                          ctypes.addressof(size), _END)
            slot = self._local.slot = (buffer, size, extra, ctypes.addressof(extra), words)
        return slot

    def pack(self, args, layout=None):
        """Pack a launch's arguments (array arguments `_arrays.Operand`s, scalars numbers, a tuple argument a tuple
        of those) into this thread's buffer; returns `_slot`'s tuple, whose ``extra`` array cuLaunchKernel takes.

        ``layout``: a dict the caller keeps for one layout of the arguments (every array's shape and strides
        the same at every launch, as `call_cache` remembers a call's layout), or None. The first launch keeps
        its packed bytes there; a later one with the same scalars (other than int64 ones) copies them and writes
        only the arrays' addresses and the int64 scalars (a forward launch's pack took 5.8 microseconds against
        9.0 on the H100's host when it still packed every value, `.bench/hostsplit.py`)."""
        flat = []
        flat_values(args, flat)
        slot = self._slot()
        if layout is not None:
            compared = tuple([flat[i] for i in self._compared])
            kept = layout.get(self)
            if kept is not None and kept[1] == compared:
                ctypes.memmove(slot[0], kept[0], self.size)
                words = slot[4]
                for at, i, is_array in self._words:
                    words[at] = flat[i].ptr if is_array else flat[i]
                return slot
        self._struct.pack_into(slot[0], 0, *self._values(flat))
        if layout is not None:
            layout[self] = (bytes(slot[0]), compared)
        return slot


@functools.lru_cache(maxsize=None)
def _driver():
    from cuda.bindings import driver

    return driver


def launch(function, grid, threads, smem_bytes, stream_handle, packer, args, layout=None):
    """Launch CUfunction/CUkernel ``function`` (a cuda.bindings handle) on ``grid`` blocks (an int or a tuple of up
    to 3) of ``threads`` threads with ``smem_bytes`` of dynamic shared memory on the stream ``stream_handle``
    (0: the default stream); ``layout`` as `Packer.pack` takes it."""
    driver = _driver()
    extra = packer.pack(args, layout)[3]
    gx, gy, gz = (grid, 1, 1) if type(grid) is int else tuple(grid) + (1,) * (3 - len(grid))
    err, = driver.cuLaunchKernel(function, gx, gy, gz, threads, 1, 1, smem_bytes, stream_handle, 0, extra)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"cuLaunchKernel failed: {name.decode() if name else err}")
