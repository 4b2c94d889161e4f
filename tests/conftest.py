"""Test modes: the CUDA simulator on tiny shapes (CI), or a real GPU at real sizes (``pytest -m gpu``).

Numba fixes the simulator choice at import, so it is made here, before any test module imports numba:

* ``pytest -m gpu`` on a machine with a GPU: real device; tests marked ``gpu`` run with the large
  hypothesis profile.
* anything else: NUMBA_ENABLE_CUDASIM=1; tests marked ``gpu`` are skipped, the rest run on the
  simulator with the small CI profile.
"""

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numbaflash._device import gpu_count  # noqa: E402  (needs no numba)

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "gpu", max_examples=150, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

GPU_RUN = False


def pytest_configure(config):
    global GPU_RUN
    config.addinivalue_line("markers", "gpu: runs on a real CUDA GPU at real sizes (pytest -m gpu)")
    markexpr = config.getoption("markexpr") or ""
    GPU_RUN = "gpu" in markexpr and "not gpu" not in markexpr and gpu_count() > 0
    if not GPU_RUN:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    settings.load_profile("gpu" if GPU_RUN else "ci")


def pytest_collection_modifyitems(config, items):
    reason = ("needs a CUDA GPU: run `pytest -m gpu` on a machine with one" if gpu_count() == 0
              else "real-GPU test: run `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not GPU_RUN:
            item.add_marker(pytest.mark.skip(reason=reason))
