"""compute-sanitizer finds no memory error, race or barrier misuse in any kernel (GPU only)."""

import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.gpu
def test_memcheck_racecheck_synccheck_report_zero_errors():
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on the PATH")
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "sanitize.py")
    run = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:]
