"""Where kernels run (a GPU, or Numba's CUDA simulator) and how a Python function becomes a device function.

``device_function(fn)`` makes a plain Python function callable from kernels and from other device
functions: registered with numba as a CUDA overload of itself on a GPU, left as is under the simulator
(where kernels are Python too). Either way it returns ``fn``, which stays callable from Python. NVVM
inlines these functions, and a register array a kernel passes in is then indexed by constants and
stays in registers (ptxas reports no local memory). Inlining them at the Numba IR level instead
re-typed every copy: 25-45 s to compile one kernel instead of 3.
"""

from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_function(fn):
    if not SIMULATOR:
        from numba.cuda.extending import register_jitable

        register_jitable(inline="never")(fn)
    return fn
