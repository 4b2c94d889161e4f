"""Compile each kernel specialization once, and launch it with its plan's resources.

A specialization is (kernel builder, padded head dim, tiles, storage dtype, `mods.Mods`); its sizes are compile-time
constants, so each one is a separate compile, kept for the life of the process and, on a GPU, on disk
(`disk_cache`, the user's functions keyed by `function_keys`): a new process loads the cubin instead of compiling.

Launches on the GPU pack the kernel's parameters into one buffer and call the driver's cuLaunchKernel
(`parameters`), as numba's dispatcher does after it has typed and wrapped every argument: that wrapping
(a numba device array per operand, context checks per argument) cost about 200 microseconds per forward
call on the H200, a fifth of the whole call at N = 2048, and cuda.core's ``launch``, which converts each
parameter on its own, 25-37 per launch on the H100's host. On the simulator the dispatcher launches, on
views of the operands.
"""

import functools

import numba
import numba_cuda
import numpy as np
from numba import cuda, types
from numba.np.numpy_support import as_dtype

from . import disk_cache, function_keys, parameters
from ..mods import NONE
from .intrinsics import SIMULATOR

STATIC_SMEM_LIMIT = 48 * 1024  # bytes a kernel may use before its dynamic limit is raised


@functools.lru_cache(maxsize=None)
def kernel(build, D, tiles, storage, threads, mods=NONE):
    """The `Kernel` for ``build(D, tiles, storage, mods)``, compiled for blocks of ``threads`` threads.

    Blocks of more than 256 threads get launch bounds, which cap ptxas at 65536 / threads registers so
    the block can launch at all. Smaller blocks get none: under a bound of 256 the H200's JIT capped
    kernels at 128 registers and spilled (8 to 32 bytes of local memory); ptxas's own limit of 255
    registers already lets a 256-thread block launch. A builder with a ``min_blocks(tiles)`` function also bounds
    the blocks per multiprocessor from below where it gives a number (`wgmma.ws_backward` and `wgmma.ws_forward` say
    why), and so do tiles of two blocks per
    multiprocessor (`tiling.WgmmaTiles.blocks_per_sm`), which caps the registers at entry to half.
    """
    fn, signature = build(D, tiles, storage, mods)
    launch_bounds = None
    if tiles.blocks_per_sm > 1 and not SIMULATOR:
        launch_bounds = (threads, tiles.blocks_per_sm)
    elif threads > 256 and not SIMULATOR:
        least = build.min_blocks(tiles) if hasattr(build, "min_blocks") else None
        launch_bounds = (threads, least) if least else threads
    # The user's functions enter the key by what Numba compiles of them (`function_keys`); one whose values no key
    # can see into leaves its kernels out of the disk cache.
    functions, _ = function_keys.mods_key(mods)
    specialization = None if functions is None else (build.__module__, build.__qualname__, D, repr(tiles), storage,
                                                     launch_bounds, mods.softcap, mods.alibi, mods.packed,
                                                     mods.block_sparse, mods.arg_types, functions)
    return Kernel(fn, signature, launch_bounds, specialization)


def _simulator_view(t, a):
    if isinstance(t, types.BaseTuple):
        return tuple(_simulator_view(member, x) for member, x in zip(t, a))
    return a.kernel_view(as_dtype(t.dtype)) if isinstance(t, types.Array) else a


class Kernel:
    """One specialization: `launch`, and numba's ``dispatcher`` (compiled when first asked for: on a GPU a
    launch loads the kernel from the disk cache when it can, and compiles only on a miss)."""

    def __init__(self, fn, signature, launch_bounds, specialization):
        self._fn = fn
        self._launch_bounds = launch_bounds
        self._specialization = specialization
        self.signature = signature
        # device ordinal -> (cuda.bindings CUkernel handle, with its dynamic shared memory raised; `parameters.Packer`)
        self._functions = {}

    def launch(self, grid, threads, smem_bytes, stream, *args, layout=None):
        """Run on ``grid`` blocks of ``threads`` threads with ``smem_bytes`` of dynamic shared memory, on
        ``stream`` (an `_arrays.Stream`); array arguments are `_arrays.Operand`s (viewed as the kernel's
        dtype: float16 and bfloat16 as uint16 bits where it takes them so), scalars numbers, a tuple
        argument a tuple of those. ``layout``: a dict kept for one layout of the arguments, where a launch
        keeps its packed values for the next (`parameters.Packer.pack`)."""
        if SIMULATOR:
            views = [_simulator_view(t, a) for t, a in zip(self.signature, args)]
            # NumPy's scalars warn where the GPU's IEEE arithmetic is silent: the online softmax subtracts a row's
            # -inf maximum from itself until the row sees a key (NaN, which no comparison passes, on both)
            with np.errstate(all="ignore"):
                self.dispatcher[grid, threads, 0, smem_bytes](*views)
            return
        function, packer = self._function(stream.device, smem_bytes)
        parameters.launch(function, grid, threads, smem_bytes, stream.handle, packer, args, layout)

    @functools.cached_property
    def dispatcher(self):
        if SIMULATOR:
            return cuda.jit(self.signature)(self._fn)
        return cuda.jit(self.signature, launch_bounds=self._launch_bounds)(self._fn)

    def cufunc(self):
        """numba's CUfunction of this kernel on the current device (its resources are ``.attrs``)."""
        return self._library().get_cufunc()

    def _library(self):
        return next(iter(self.dispatcher.overloads.values()))._codelibrary

    def cache_entry(self):
        """This specialization's `disk_cache` key on the current GPU."""
        from numba.cuda.cudadrv import driver, nvvm

        cc = cuda.get_current_device().compute_capability
        versions = (numba.__version__, numba_cuda.__version__, nvvm.NVVM().get_version(), driver.driver.get_version())
        return disk_cache.key(self._specialization + (cc, versions))

    def _load_or_compile(self):
        """The CUfunction from the disk cache, else compiled (and stored, unless it has no cache key)."""
        if self._specialization is None:
            return self._library().get_cufunc()
        entry = self.cache_entry()
        stored = disk_cache.load(entry)
        if stored is not None:
            entry_name, cubin = stored
            try:
                from cuda.core import ObjectCode

                image = ObjectCode.from_cubin(cubin)
                return cuda.current_context().create_module_image(image).get_function(entry_name)
            except Exception:  # a cubin the driver rejects is rebuilt, whatever the driver's complaint
                disk_cache.remove(entry)
        library = self._library()
        disk_cache.store(entry, library._entry_name, bytes(library.get_cubin().code))  # a cuda.core ObjectCode
        return library.get_cufunc()

    def _function(self, device, smem_bytes):
        # One entry per device: a specialization's shared memory is fixed by its head dim and tiles.
        if device not in self._functions:
            from numba.cuda.cudadrv.driver import binding, driver

            cufunc = self._load_or_compile()
            if smem_bytes > STATIC_SMEM_LIMIT:
                # Shared memory past 48 KiB must be requested per function and device (cudaFuncSetAttribute).
                attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.cuKernelSetAttribute(attribute, smem_bytes, cufunc.handle, device)
            kernel = cufunc.kernel  # cuda.core's
            offsets = [offset for offset, _ in kernel.arguments_info]
            self._functions[device] = (kernel.handle, parameters.Packer(self.signature, offsets))
        return self._functions[device]
