"""The CUDA simulator's thread blocks under `kernels.intrinsics.simulated_blocks`: syncthreads' semantics kept,
failures raised, and a block's manager asleep while its threads work."""

import time
import warnings

import numpy as np
import pytest

import numbaflash
from numbaflash.kernels.intrinsics import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's block manager")

if SIMULATOR:
    from numba import cuda

    from numbaflash.kernels.intrinsics import simulated_blocks


def test_the_simulator_runs_blocks_with_the_waiting_manager():
    from numba.cuda.simulator import kernel

    assert kernel.BlockManager is simulated_blocks.WaitingBlockManager


def test_syncthreads_releases_the_threads_still_running():
    """Threads that returned early do not hold the others at syncthreads (as the simulator's own manager and the
    hardware do); each barrier releases only once every running thread reached it."""

    @cuda.jit
    def kernel(out, early):
        t = cuda.threadIdx.x
        if t < early:
            return
        out[0, t] = 1
        cuda.syncthreads()
        out[1, t] = np.sum(out[0, early:])  # every running thread wrote row 0 before any reads it
        cuda.syncthreads()
        out[2, t] = cuda.syncthreads_count(t % 2)

    threads, early = 40, 5
    out = np.zeros((3, threads), np.int64)
    kernel[2, threads](out, early)
    running = threads - early
    assert (out[0, early:] == 1).all() and (out[:, :early] == 0).all()
    assert (out[1, early:] == running).all(), out[1]
    assert (out[2, early:] == sum(t % 2 for t in range(early, threads))).all(), out[2]


def test_a_failing_thread_raises_while_the_others_wait():
    """The first exception of a thread is raised from the launch, with the failing thread named, and the threads
    waiting at syncthreads are released (the launch does not hang)."""

    @cuda.jit
    def kernel(out):
        t = cuda.threadIdx.x
        if t == 3:
            out[100] = 1  # out of bounds
        cuda.syncthreads()
        out[t] = 1

    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\]"):
        kernel[1, 8](np.zeros(8, np.int64))


def test_the_manager_sleeps_while_a_thread_works():
    """A block whose thread works for 0.3 s while the others wait at syncthreads costs the launching thread almost
    no CPU: the simulator's own manager polled the threads for the whole time, taking the interpreter from the
    threads that work (the kernel tests ran 2-4x slower)."""

    @cuda.jit
    def kernel(out):
        if cuda.threadIdx.x == 0:
            time.sleep(0.3)
        cuda.syncthreads()
        out[cuda.threadIdx.x] = 1

    out = np.zeros(32, np.int64)
    start, wall = time.thread_time(), time.perf_counter()
    kernel[1, 32](out)
    cpu, wall = time.thread_time() - start, time.perf_counter() - wall
    assert (out == 1).all()
    assert wall >= 0.3 and cpu < 0.1, (cpu, wall)


def test_a_block_takes_its_launchs_floating_point_error_handling():
    """NumPy's error handling is per thread and a new thread starts from the defaults (warn on an invalid result): a
    simulated thread takes the launching thread's ``np.errstate`` instead."""

    @cuda.jit
    def kernel(out, x):
        out[cuda.threadIdx.x] = x[0] - x[0]

    out, x = np.zeros(4), np.array([np.inf])
    with np.errstate(invalid="raise"), pytest.raises(FloatingPointError):
        kernel[1, 4](out, x)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel[1, 4](out, x)
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numbaflash_kernels_warn_of_nothing_the_gpu_computes(dtype):
    """Rows that see no key (a window, and the tiles' rows past seqlen_q) subtract a -inf maximum from itself until
    a key shows: NaN, which no comparison passes, on the GPU and in NumPy alike, but NumPy warns. A call warns of
    nothing, forward and backward, whatever the caller's error handling (the warnings filter is the process's, so
    it reaches the simulated threads)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, n, 2, 16)).astype(dtype) for n in (7, 5, 5))
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = numbaflash.attention(q, k, v, window_size=(0, 0), return_lse=True)
        numbaflash.attention_backward(np.ones_like(out), q, k, v, out, lse, window_size=(0, 0))
    assert np.isneginf(lse[0, :, :2]).all() and np.isfinite(lse[0, :, 2:]).all()
