"""Run every kernel over a grid of small shapes, masks and dtypes; meant to run under compute-sanitizer.

    python scripts/sanitize.py --check     # runs memcheck, racecheck and synccheck over this script
                                           # and reports the error count of each

Without --check it just runs the grid once (what each sanitizer tool executes).
"""

import argparse
import re
import subprocess
import sys

TOOLS = ("memcheck", "racecheck", "synccheck")


def grid():
    import cupy
    import numpy as np

    import numbaflash
    from numbaflash.kernels.elements import STORAGE

    rng = np.random.default_rng(0)
    shapes = [(2, 33, 70, 4, 2, 40), (1, 70, 33, 2, 1, 64), (1, 17, 17, 1, 1, 128)]
    masks = [dict(), dict(causal=True), dict(window_size=(5, 3))]
    for dtype in STORAGE:
        np_dtype = np.dtype("float32") if dtype == "bfloat16" else np.dtype(dtype)
        for b, nq, nk, h, hk, d in shapes:
            for mask in masks:
                arrays = [rng.standard_normal(s).astype(np_dtype) for s in
                          ((b, nq, h, d), (b, nk, hk, d), (b, nk, hk, d), (b, nq, h, d))]
                if dtype == "bfloat16":
                    import ml_dtypes

                    arrays = [x.astype(ml_dtypes.bfloat16) for x in arrays]
                q, k, v, dout = (cupy.asarray(x) for x in arrays)
                out, lse = numbaflash.attention(q, k, v, return_lse=True, **mask)
                numbaflash.attention_backward(dout, q, k, v, out, lse, **mask)
    cupy.cuda.Device().synchronize()


def check():
    failures = 0
    for tool in TOOLS:
        run = subprocess.run(["compute-sanitizer", "--tool", tool, sys.executable, __file__],
                             capture_output=True, text=True)
        summary = re.findall(r"ERROR SUMMARY: (\d+) error", run.stdout + run.stderr)
        errors = int(summary[-1]) if summary else -1
        print(f"compute-sanitizer --tool {tool}: {'no summary' if errors < 0 else f'{errors} errors'} "
              f"(exit {run.returncode})")
        if errors != 0 or run.returncode != 0:
            failures += 1
            print((run.stdout + run.stderr)[-3000:])
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    if parser.parse_args().check:
        sys.exit(1 if check() else 0)
    grid()
