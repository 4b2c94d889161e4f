"""Compile each kernel specialization once per process, and launch it with its plan's resources.

A specialization is (kernel builder, padded head dim, tiles, storage dtype); its sizes are compile-time
constants, so each one is a separate compile, cached here for the life of the process.
"""

import functools

from numba import cuda

from .intrinsics import SIMULATOR

STATIC_SMEM_LIMIT = 48 * 1024  # bytes a kernel may use before its dynamic limit is raised


@functools.lru_cache(maxsize=None)
def kernel(build, D, tiles, storage, threads):
    """The compiled kernel ``build(D, tiles, storage)`` returns, for blocks of ``threads`` threads.

    Blocks of more than 256 threads get launch bounds, which cap ptxas at 65536 / threads registers so
    the block can launch at all. Smaller blocks get none: under a bound of 256 the H200's JIT capped
    kernels at 128 registers and spilled (8 to 32 bytes of local memory); ptxas's own limit of 255
    registers already lets a 256-thread block launch.
    """
    fn, signature = build(D, tiles, storage)
    if SIMULATOR:
        return cuda.jit(signature)(fn)
    return cuda.jit(signature, launch_bounds=threads if threads > 256 else None)(fn)


_raised = set()


def _allow_dynamic_smem(dispatcher, nbytes):
    """Shared memory past 48 KiB must be requested per function and device (cudaFuncSetAttribute)."""
    from numba.cuda.cudadrv.driver import binding, driver

    device = cuda.get_current_device().id
    key = (id(dispatcher), device, nbytes)
    if key in _raised:
        return
    for compiled in dispatcher.overloads.values():
        cufunc = compiled._codelibrary.get_cufunc()
        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attribute, nbytes, cufunc.handle, device)
    _raised.add(key)


def launch(compiled, grid, threads, smem_bytes, stream, *args):
    if not SIMULATOR and smem_bytes > STATIC_SMEM_LIMIT:
        _allow_dynamic_smem(compiled, smem_bytes)
    compiled[grid, threads, stream, smem_bytes](*args)
