"""Is there a CUDA GPU? Asked through the driver library directly, so numba is not imported yet.

The answer decides whether a process may use the real device or must set NUMBA_ENABLE_CUDASIM before
numba is first imported (the simulator cannot be switched on afterwards).
"""

import ctypes
import os


def gpu_count():
    """Number of CUDA devices the driver reports; 0 without a driver or a device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def simulator_enabled():
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
