"""``python -m numbaflash``: run attention forward and backward on this machine, check them against the
float64 reference, and show the plan and the IO report of that shape.

On a GPU it runs a realistic shape; without one it runs the same kernels on Numba's CUDA simulator at
a size that finishes in seconds (and says so).
"""

import argparse
import os
import time

from ._device import gpu_count, simulator_enabled


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m numbaflash", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seqlen", type=int)
    parser.add_argument("--nheads", type=int)
    parser.add_argument("--nheads-kv", type=int)
    parser.add_argument("--headdim", type=int)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--no-causal", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    on_gpu = gpu_count() > 0 and not simulator_enabled()
    if not on_gpu:
        # Must happen before numba is first imported; numbaflash imports it lazily for this reason.
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        print("No CUDA GPU here: running numbaflash's kernels on Numba's CUDA simulator, at a small size.\n")
    defaults = dict(batch=2, seqlen=2048, nheads=8, nheads_kv=2, headdim=128, dtype="float16") if on_gpu else \
        dict(batch=1, seqlen=48, nheads=2, nheads_kv=1, headdim=32, dtype="float32")
    opts = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    causal = not args.no_causal

    import numpy as np

    import numbaflash
    import sim
    import sim.report
    from numbaflash import reference

    b, n, h, hk, d, dtype = (opts[key] for key in ("batch", "seqlen", "nheads", "nheads_kv", "headdim", "dtype"))
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape) for shape in ((b, n, h, d), (b, n, hk, d), (b, n, hk, d), (b, n, h, d))]
    if dtype == "bfloat16":
        import ml_dtypes

        host = [x.astype(ml_dtypes.bfloat16) for x in host]
    else:
        host = [x.astype(np.dtype(dtype)) for x in host]
    if not on_gpu:
        to_device, to_host = (lambda x: x), np.asarray
    else:
        try:
            import cupy

            to_device, to_host = cupy.asarray, cupy.asnumpy
        except ImportError:  # numba's own device arrays (__cuda_array_interface__) serve every dtype but bf16
            if dtype == "bfloat16":
                raise SystemExit("bfloat16 arrays on the GPU need CuPy: pip install -e '.[cuda12]' (or [cuda13])")
            from numba import cuda

            to_device, to_host = cuda.to_device, (lambda x: x.copy_to_host() if hasattr(x, "copy_to_host") else x)
    q, k, v, dout = (to_device(x) for x in host)

    print(numbaflash.explain(q, k, v, causal=causal))
    start = time.perf_counter()
    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    first_call = time.perf_counter() - start

    # Batch 0, key/value head 0 and its group of query heads, against the float64 reference.
    group = h // hk
    qs = lambda x: np.asarray(x, dtype=np.float64)[:1, :, :group]
    kvs = lambda x: np.asarray(x, dtype=np.float64)[:1, :, :1]
    inputs = [qs(host[0]), kvs(host[1]), kvs(host[2])]
    want_out, want_lse = reference.attention_forward(*inputs, causal=causal)
    want_grads = reference.attention_backward(qs(host[3]), *inputs, causal=causal)
    got = [qs(to_host(out)), to_host(lse).astype(np.float64)[:1, :group], qs(to_host(dq)), kvs(to_host(dk)),
           kvs(to_host(dv))]
    print(f"\nbatch 0, kv head 0 with its {group} query heads, against the float64 reference: "
          "max |error| (largest |value|)")
    for name, x, want in zip(("out", "lse", "dq", "dk", "dv"), got, (want_out, want_lse) + want_grads):
        finite = np.isfinite(want)
        print(f"  {name:>3}: {np.abs(x[finite] - want[finite]).max():.2e}   ({np.abs(want[finite]).max():.2f})")
    print(f"first call, forward + backward, compilation included: {first_call:.1f} s")

    for backward in (False, True):
        plan = numbaflash.plan(q, k, v, causal=causal, backward=backward)
        counted = sim.count_io(n, d, plan=plan, batch=1, nheads=1, causal=causal, backward=backward,
                               compute=n <= 512)
        standard = sim.count_io(n, d, algorithm="standard", sram_bytes=plan.sram_bytes, dtype_bytes=plan.dtype_bytes,
                                causal=causal, backward=backward, compute=False)
        print(f"\nIO report, {'backward' if backward else 'forward'}, one head (sim counted the plan's schedule):")
        print(sim.report.table([counted, standard]))


if __name__ == "__main__":
    main()
