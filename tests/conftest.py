"""Test modes: the CUDA simulator on tiny shapes (CI), or a real GPU at real sizes (``pytest -m gpu``).

Numba fixes the simulator choice at import, so it is made here, before any test module imports numba:

* ``pytest -m gpu`` on a machine with a GPU: real device; tests marked ``gpu`` run with the large
  hypothesis profile.
* anything else: NUMBA_ENABLE_CUDASIM=1; tests marked ``gpu`` are skipped, the rest run on the
  simulator with the small CI profile.
"""

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numbaflash._device import gpu_count  # noqa: E402  (needs no numba)

QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=QUIET)
settings.register_profile("gpu", max_examples=100, deadline=None, print_blob=True, suppress_health_check=QUIET)
# For a GPU run on a device-time budget: pytest -m gpu --hypothesis-profile gpu-quick
settings.register_profile("gpu-quick", max_examples=20, deadline=None, print_blob=True, suppress_health_check=QUIET)

GPU_RUN = False


def pytest_configure(config):
    global GPU_RUN
    config.addinivalue_line("markers", "gpu: runs on a real CUDA GPU at real sizes (pytest -m gpu)")
    markexpr = config.getoption("markexpr") or ""
    GPU_RUN = "gpu" in markexpr and "not gpu" not in markexpr and gpu_count() > 0
    if not GPU_RUN:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("gpu" if GPU_RUN else "ci")


def pytest_collection_modifyitems(config, items):
    reason = ("needs a CUDA GPU: run `pytest -m gpu` on a machine with one" if gpu_count() == 0
              else "real-GPU test: run `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not GPU_RUN:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=[pytest.param("simulator"), pytest.param("gpu", marks=pytest.mark.gpu)])
def mode(request):
    """Runs a test in both modes: on the simulator in CI, and again on hardware under ``pytest -m gpu``."""
    if (request.param == "gpu") != GPU_RUN:
        pytest.skip("runs in the other mode")
    return request.param


@pytest.fixture
def arrays(mode):
    """(to_device, to_host): NumPy arrays stay on the host under the simulator, go to CuPy on a GPU."""
    if mode == "simulator":
        return (lambda x: x), np.asarray
    import cupy

    return cupy.asarray, cupy.asnumpy


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty disk cache for one test (`numbaflash.kernels.disk_cache`)."""
    from numbaflash.kernels import disk_cache

    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def poisoned(monkeypatch):
    """Every output numbaflash allocates starts as NaN, so an element a kernel never writes fails."""
    from numbaflash import _arrays

    real_empty = _arrays.empty

    def empty(like, shape, dtype):
        out = real_empty(like, shape, dtype)
        out[...] = float("nan")
        return out

    monkeypatch.setattr(_arrays, "empty", empty)
