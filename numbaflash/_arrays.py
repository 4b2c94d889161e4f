"""Arrays at the public boundary: what callers pass, what kernels receive, what callers get back.

Accepted: CuPy arrays, torch CUDA tensors, any object with ``__cuda_array_interface__`` or (through
CuPy) ``__dlpack__``, and NumPy arrays when the CUDA simulator is on. Kernels receive the caller's
memory with its strides, zero-copy (`numbaflash.kernels.compiled` passes it); outputs are allocated by
the same library as ``q`` on the same device, and kernels run on that library's current stream.
"""

import functools
from dataclasses import dataclass

import numpy as np

from .kernels.elements import kernel_dtype
from .kernels.intrinsics import SIMULATOR


@dataclass
class Operand:
    """One array argument, described without touching its data."""

    obj: object  # the caller's array; for a GPU `batch_operand`, the packed array its shape and strides view
    kind: str  # "numpy", "cupy", "torch" or "cai"
    shape: tuple
    strides: tuple  # bytes
    dtype: str
    device: int  # -1 on the host
    ptr: int

    def vector_aligned(self, count):
        """Whether ``count`` consecutive head-dim elements come in one aligned load of at most 16 bytes."""
        return vector_aligned(self.shape, self.strides, kernel_dtype(self.dtype).itemsize, self.ptr, count)

    def kernel_view(self, dtype):
        """The simulator's array for a kernel argument of NumPy ``dtype``: the same memory and strides,
        reinterpreted (float16 and bfloat16 as uint16 bits where a kernel takes them so). The simulator's
        device array wraps the view as is: no copy, outputs written in place (passing the bare array
        would copy it, and refuse it if strided)."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(self.obj.view(dtype) if self.obj.dtype != dtype else self.obj)


def vector_aligned(shape, strides, itemsize, address, count):
    """Whether an array (``strides`` in bytes, first element at ``address``) can be staged ``count`` head-dim
    elements at a time: the head dim contiguous and a multiple of ``count``, every row aligned to the
    vector (at most 16 bytes). The kernels' vector staging and `sim.hardware` both ask this."""
    align = min(16, count * itemsize)
    return (shape[-1] % count == 0 and strides[-1] == itemsize and address % align == 0
            and all(s % align == 0 for s in strides[:-1]))


@dataclass(frozen=True)
class Stream:
    """A CUDA stream by handle (0: the device's default stream) on device ordinal ``device``, as cuda.core's
    launch takes it."""

    handle: int
    device: int

    def __cuda_stream__(self):
        return (0, self.handle)


@functools.lru_cache(maxsize=None)  # asked for every operand of every call
def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def _torch_dtype(dtype):
    """A torch dtype's name and bytes, worked out once: `describe` asked each tensor for both (element_size(),
    str(dtype)), two of its seven calls into torch."""
    import torch

    return _dtype_name(dtype), torch.empty(0, dtype=dtype).element_size()


@functools.lru_cache(maxsize=None)  # a dictionary lookup per operand instead of string splitting
def library(cls):
    """The top-level module of an array type ("torch", "cupy", "numpy", ...)."""
    return cls.__module__.split(".")[0]


def is_device_array(x):
    """Whether ``x`` is one of the GPU array kinds `describe` accepts (without touching the driver)."""
    return (library(type(x)) in ("torch", "cupy") or hasattr(x, "__cuda_array_interface__")
            or hasattr(x, "__dlpack__"))


def describe(x, name):
    """An `Operand` for a user array; TypeError for anything numbaflash cannot read."""
    module = library(type(x))
    if module == "torch":
        device = x.get_device()  # -1 off the GPU; one call where is_cuda and then get_device were two
        if device < 0:
            raise TypeError(f"{name} is a torch tensor on {x.device}: numbaflash runs on CUDA tensors")
        if SIMULATOR:
            raise _on_the_simulator(x, name)
        dtype, itemsize = _torch_dtype(x.dtype)
        return Operand(x, "torch", tuple(x.shape), tuple([s * itemsize for s in x.stride()]), dtype, device,
                       x.data_ptr())
    if isinstance(x, np.ndarray):
        if not SIMULATOR:
            raise TypeError(
                f"{name} is a NumPy array, which lives in host memory: pass CuPy arrays or torch CUDA tensors "
                "(or set NUMBA_ENABLE_CUDASIM=1 before importing numba to run on the CUDA simulator)")
        return Operand(x, "numpy", x.shape, x.strides, _dtype_name(x.dtype), -1, x.ctypes.data)
    if SIMULATOR and is_device_array(x):
        raise _on_the_simulator(x, name)
    if module == "cupy":
        return Operand(x, "cupy", x.shape, x.strides, _dtype_name(x.dtype), x.device.id, x.data.ptr)
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides") or tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize
                                              for i in range(len(shape)))
        return Operand(x, "cai", shape, tuple(strides), _dtype_name(dtype), _device_of(cai["data"][0]), cai["data"][0])
    if hasattr(x, "__dlpack__"):
        try:
            import cupy
        except ImportError:
            raise TypeError(f"{name} offers only DLPack; install CuPy (numbaflash[cuda12] or [cuda13]) to pass it") from None
        return describe(cupy.from_dlpack(x), name)
    host = ", a NumPy array (on the CUDA simulator)" if SIMULATOR else ""
    raise TypeError(f"{name} must be a CuPy array, a torch CUDA tensor{host}, or expose __cuda_array_interface__ "
                    f"or __dlpack__; got {type(x).__module__}.{type(x).__name__}")


def _on_the_simulator(x, name):
    """The TypeError for a GPU array on the simulator: its kernels read no device memory, and no driver says whose
    a pointer is."""
    return TypeError(f"{name} is a GPU array, but the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs on NumPy arrays: "
                     f"pass NumPy arrays; got {type(x).__module__}.{type(x).__name__}")


def _device_of(ptr):
    """The ordinal of the GPU that owns device pointer ``ptr`` (CUDA's unified addressing knows it)."""
    from numba.cuda.cudadrv.driver import binding, driver

    attribute = binding.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(driver.cuPointerGetAttribute(attribute, ptr))


def single_head_view(op, name):
    """A 2-D (seqlen, headdim) operand as a (1, seqlen, 1, headdim) view of the same memory."""
    x = op.obj[None, :, None, :]
    return describe(x, name)


class _Interface:
    """An object that offers only a ``__cuda_array_interface__`` (`batch_view` of such an array)."""

    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


def batch_view(x, batch):
    """``x`` (any kind `describe` takes) as ``(batch, *x.shape)`` with a batch stride of 0: every batch index
    sees all of ``x``, without a copy, writable (the kernels of a varlen call narrow it per sequence)."""
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, (batch,) + x.shape, (0,) + x.strides)
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return x.unsqueeze(0).expand(batch, *x.shape)
    if module == "cupy":
        import cupy

        return cupy.lib.stride_tricks.as_strided(x, (batch,) + x.shape, (0,) + x.strides)
    op = describe(x, "array")
    interface = dict(x.__cuda_array_interface__, shape=(batch,) + op.shape, strides=(0,) + op.strides)
    return _Interface(interface)


def batch_operand(op, batch):
    """`batch_view` of an Operand, as an Operand: on the GPU its shape and strides with the batch axis before them,
    the same memory, without asking the array's library for a view and describing that (a torch tensor's expand
    and `describe` took a varlen call's host path about 15 us an operand); the simulator's kernels take the
    NumPy view itself (`Operand.kernel_view`)."""
    if op.kind == "numpy":
        return describe(batch_view(op.obj, batch), "array")
    return Operand(op.obj, op.kind, (batch,) + op.shape, (0,) + op.strides, op.dtype, op.device, op.ptr)


def to_host(op):
    """A NumPy copy of a small operand (a varlen call's cu_seqlens, which the boundary checks on the host)."""
    if op.kind == "numpy":
        return np.array(op.obj)
    if op.kind == "torch":
        return op.obj.detach().cpu().numpy()
    if op.kind == "cupy":
        return op.obj.get()
    from numba import cuda

    return cuda.as_cuda_array(op.obj).copy_to_host()


def empty(like, shape, dtype):
    """An uninitialized array of ``dtype`` ("float32", "bfloat16", ...) of the same kind and device as ``like``."""
    return _allocate(like, shape, dtype, "empty")


def output(like, shape, dtype, name):
    """`empty`, as an `Operand`. A torch tensor just made is contiguous: its layout is computed here instead
    of asked of torch, whose every attribute costs the host path a microsecond or so (`describe` took 12 us a
    tensor on the H100's host, .bench/hostprof.py)."""
    x = empty(like, shape, dtype)
    if like.kind != "torch":
        return describe(x, name)
    itemsize, strides = x.element_size(), []
    for n in reversed(shape):
        strides.append(itemsize)
        itemsize *= n
    return Operand(x, "torch", tuple(shape), tuple(reversed(strides)), dtype, like.device, x.data_ptr())


def zeros(like, shape, dtype):
    """`empty`, filled with zeros (on the GPU by the library's fill, on its current stream)."""
    return _allocate(like, shape, dtype, "zeros")


def _allocate(like, shape, dtype, how):
    """``how`` ("empty" or "zeros") of NumPy, torch or CuPy, the library of ``like``, on its device."""
    if like.kind == "numpy":
        return getattr(np, how)(shape, dtype=_numpy_dtype(dtype))
    if like.kind == "torch":
        import torch

        # The tensor's own new_empty/new_zeros: 8.7-9.2 microseconds where torch.empty with a device took 10.9
        # (H100 host, .bench/hostsplit.py); always contiguous, unlike empty_like.
        return getattr(like.obj, "new_" + how)(shape, dtype=getattr(torch, dtype))
    try:
        import cupy
    except ImportError:
        from numba import cuda

        with cuda.gpus[like.device]:
            if how == "zeros":
                return cuda.to_device(np.zeros(shape, dtype=_numpy_dtype(dtype)))
            return cuda.device_array(shape, dtype=_numpy_dtype(dtype))
    with cupy.cuda.Device(like.device):
        return getattr(cupy, how)(shape, dtype=_numpy_dtype(dtype))


def from_host(like, array):
    """NumPy ``array`` as an array of the kind and device of ``like`` (a copy on the GPU)."""
    if like.kind == "numpy":
        return describe(array, "table")
    if like.kind == "torch":
        import torch

        return describe(torch.from_numpy(array).to(like.obj.device), "table")
    import cupy

    with cupy.cuda.Device(like.device):
        return describe(cupy.asarray(array), "table")


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def stream_of(op):
    """The `Stream` to launch on: the caller library's current stream on ``op``'s device."""
    if op.kind == "numpy":
        return Stream(0, -1)
    if op.kind == "torch":
        import torch

        # torch's raw handle (what Triton launches on) costs a tenth of building the Stream object.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        ptr = raw(op.device) if raw is not None else torch.cuda.current_stream(op.obj.device).cuda_stream
    elif op.kind == "cupy":
        import cupy

        with cupy.cuda.Device(op.device):
            ptr = cupy.cuda.get_current_stream().ptr
    else:
        ptr = op.obj.__cuda_array_interface__.get("stream") or 0
        ptr = 0 if ptr in (1, 2) else ptr  # 1 and 2 name the legacy and per-thread default streams
    return Stream(ptr, op.device)


__all__ = ["Operand", "batch_view", "describe", "empty", "from_host", "is_device_array", "library", "output",
           "single_head_view", "stream_of", "to_host", "zeros"]
