"""Benchmark numbaflash against torch SDPA (flash, cuDNN, mem-efficient) and naive CuPy attention (GPU).

Every case is checked for correctness before it is timed (flash-attn's rule against a float64
reference of one head), timed with CUDA events after warm-up (median of the repeats), and reported as
TFLOP/s with ratios to each baseline. FLOPs: 4 * batch * nheads * seqlen^2 * headdim for the forward
(halved when causal), 2.5x that for the backward; and the fraction of the GPU's matrix-product peak that
numbaflash reaches (torch's 8192^3 product in the same dtype, measured in the same run). Also the peak
extra GPU memory of one call.

    python scripts/bench.py                       # the full grid: fp16, bf16, fp32; d 64, 128; N 512..16384
    python scripts/bench.py --quick               # a few cases
    python scripts/bench.py --memory-demo         # N = 131072, d = 128, one head: numbaflash vs naive
    python scripts/bench.py --tilings             # each kernel's candidate tilings, side by side
    python scripts/bench.py --memory              # also the peak extra memory of each forward call
    python scripts/bench.py --timing stream       # calls timed back to back (host time hidden), not alone

Writes bench.json and bench_tflops.png under --out.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

TOKENS = 16384  # batch * seqlen: the batch shrinks as the sequence grows, so every case fills the GPU
NHEADS = 16


def _torch():
    import torch

    return torch


def flops(batch, nheads, seqlen, headdim, causal, backward=False):
    f = 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    return 2.5 * f if backward else f


# How a call is timed: "call", each call alone on an idle GPU (its host time before the kernel included, as one
# call pays it); "stream", STREAM_CALLS calls enqueued back to back, each timed as their mean (as
# triton.testing.do_bench times: a call's host time hides under the previous call's kernels).
TIMING = "call"
STREAM_CALLS = 10


def time_ms(fn, warmup=2, repeats=7, warm_ms=100.0):
    """Median milliseconds of one call (`TIMING` says how a call is timed), after ``warmup`` calls and at
    least ``warm_ms`` of calls; short calls get more repeats (about 20 ms of them)."""
    torch = _torch()
    start = time.perf_counter()
    done = 0
    while done < warmup or (time.perf_counter() - start) * 1e3 < warm_ms:
        fn()
        torch.cuda.synchronize()
        done += 1
    per_call = (time.perf_counter() - start) * 1e3 / done
    repeats = max(repeats, min(50, int(20 / per_call)))  # about 20 ms of timed calls, up to 50 of them
    return events_ms(fn, STREAM_CALLS if TIMING == "stream" else 1, repeats)


def events_ms(fn, calls, repeats):
    """Median over ``repeats`` timings of milliseconds per call, each timing ``calls`` calls issued back to back
    between two CUDA events."""
    torch = _torch()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def peak_extra_bytes(fn):
    """Peak bytes allocated during ``fn`` beyond what was allocated before it (torch and CuPy pools)."""
    torch = _torch()
    import cupy

    class Peak(cupy.cuda.MemoryHook):
        name = "peak"

        def __init__(self):
            self.now = self.peak = 0

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.now += mem_size
            self.peak = max(self.peak, self.now)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.now -= mem_size

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    hook = Peak()
    with hook:
        result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before + hook.peak


_PEAKS = {}


def matmul_peak(dtype):
    """TFLOP/s of torch's 8192 x 8192 x 8192 matrix product in ``dtype`` on random data, measured once per
    run: the ceiling of the tensor cores (float16, bfloat16) or of the CUDA cores (float32, TF32 off, and
    float64) that the attention kernels' products run under."""
    torch = _torch()
    if dtype not in _PEAKS:
        torch.backends.cuda.matmul.allow_tf32 = False
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
        _PEAKS[dtype] = 2 * 8192**3 / time_ms(lambda: a @ b, warmup=3, repeats=10) / 1e9
    return _PEAKS[dtype]


def sdpa_only(backend):
    """A context in which SDPA runs only ``backend``: entered around a timing, not inside the timed call, where
    ``sdpa_kernel``'s own cost (about 30 microseconds, `bench_host.py`) would count as SDPA's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend])


def sdpa(backend):
    """SDPA on (batch, nheads, seqlen, headdim) operands with only ``backend``; time it under `sdpa_only`."""
    torch = _torch()

    def run(q, k, v, causal):
        with sdpa_only(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def sdpa_call(q, k, v, causal):
    """SDPA with the backends the surrounding `sdpa_only` allows: what a timing calls."""
    return _torch().nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def naive_cupy(q, k, v, causal):
    """Standard attention in CuPy: S and P materialized. q, k, v: (batch, nheads, seqlen, headdim) CuPy."""
    import cupy

    s = cupy.matmul(q, k.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = cupy.where(cupy.tri(n, dtype=bool), s, -cupy.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cupy.matmul(p.astype(q.dtype), v)


def check(dtype, q, k, v, dout, causal, out, grads):
    """flash-attn's rule on batch 0, head 0: numbaflash's max error <= 2x SDPA-math's in the same dtype."""
    torch = _torch()
    q64, k64, v64, do64 = (x[:1, :, :1].double().transpose(1, 2) for x in (q, k, v, dout))
    for x in (q64, k64, v64):
        x.requires_grad_(True)
    want = sdpa("math")(q64, k64, v64, causal)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), do64)
    q1, k1, v1 = (x[:1, :, :1].transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    naive = sdpa("math")(q1, k1, v1, causal)
    naive_grads = torch.autograd.grad(naive, (q1, k1, v1), dout[:1, :, :1].transpose(1, 2))
    rows = []
    pairs = [(out[:1, :, :1].transpose(1, 2), naive, want)]
    if grads is not None:
        pairs += [(g[:1, :, :1].transpose(1, 2), n, w) for g, n, w in zip(grads, naive_grads, want_grads)]
    eps = float(torch.finfo(getattr(torch, dtype)).eps)
    for got, nv, w in pairs:
        err = (got.double() - w).abs().max().item()
        ref = (nv.double() - w).abs().max().item()
        rows.append((err, ref, err <= 2 * ref + eps * w.abs().max().item()))
    return rows


def run_case(dtype, headdim, seqlen, causal, backward, tilings=None, memory=False, deterministic=True):
    torch = _torch()
    import cupy

    import numbaflash
    from numbaflash import tiling

    started = time.perf_counter()
    batch = max(1, TOKENS // seqlen)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, NHEADS, headdim, device="cuda", dtype=tdtype, generator=gen)
                     for _ in range(4))
    result = dict(dtype=dtype, headdim=headdim, seqlen=seqlen, causal=causal, batch=batch, nheads=NHEADS,
                  pass_="backward" if backward else "forward")
    total = flops(batch, NHEADS, seqlen, headdim, causal, backward)

    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = (numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
             if backward else None)
    result["check"] = [(e, r, ok) for e, r, ok in check(dtype, q, k, v, dout, causal, out, grads)]
    result["correct"] = all(ok for _, _, ok in result["check"])
    if backward:
        fn = lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    else:
        fn = lambda: numbaflash.attention(q, k, v, causal=causal)
    result["numbaflash"] = total / time_ms(fn) / 1e9
    result["matmul_peak"] = matmul_peak(dtype)
    plan = numbaflash.plan(q, k, v, causal=causal, backward=backward, deterministic=deterministic)
    result["plan"] = plan.kernel + ("" if plan.dq_strategy == "separate" or not backward else f" ({plan.dq_strategy} dQ)")
    if tilings:
        tensor_cores = (tiling.MmaTiles, tiling.WgmmaTiles)
        planned = isinstance(numbaflash.plan(q, k, v, causal=causal, backward=backward).tiles, tensor_cores)
        for tiles in (t for t in tilings if isinstance(t, tensor_cores) == planned):
            if backward and tiles.block_m != tiles.block_n and not (isinstance(tiles, tiling.WgmmaTiles)
                                                                    and tiles.producer):
                continue  # the backward's two passes share one square block, except v5's (`tiling`)
            try:
                p = tiling.make_plan(batch, NHEADS, NHEADS, seqlen, seqlen, headdim, dtype, backward=backward,
                                     tiles=tiles)
                if backward:
                    variant = lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, plan=p)
                else:
                    variant = lambda: numbaflash.attention(q, k, v, causal=causal, plan=p)
                result[f"tiles {tiles}"] = total / time_ms(variant) / 1e9
            except Exception as err:  # a tiling that does not fit this device is reported, not fatal
                print(f"  tiling {tiles}: {type(err).__name__}: {err}", file=sys.stderr)

    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))  # SDPA's layout
    for backend in ("flash", "cudnn", "efficient"):
        try:
            if backward:
                qg, kg, vg = (x.detach().requires_grad_(True) for x in (qt, kt, vt))
                o = sdpa(backend)(qg, kg, vg, causal)
                ms = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dot, retain_graph=True))
            else:
                with sdpa_only(backend):
                    ms = time_ms(lambda: sdpa_call(qt, kt, vt, causal))
            result[f"sdpa_{backend}"] = total / ms / 1e9
        except RuntimeError as err:  # backend does not run this dtype or shape
            result[f"sdpa_{backend}"] = None
            print(f"  sdpa {backend} {dtype} d={headdim} N={seqlen}: {str(err).splitlines()[0][:100]}", file=sys.stderr)
    if not backward:
        try:
            qc, kc, vc = (cupy.from_dlpack(x) for x in (qt, kt, vt))
            result["naive_cupy"] = total / time_ms(lambda: naive_cupy(qc, kc, vc, causal), repeats=3) / 1e9
            if memory:
                result["naive_peak_bytes"] = peak_extra_bytes(lambda: naive_cupy(qc, kc, vc, causal))
        except (cupy.cuda.memory.OutOfMemoryError, TypeError, ValueError, RuntimeError) as err:
            # Out of memory, or a dtype this CuPy cannot take from torch (bfloat16 through DLPack).
            result["naive_cupy"] = None
            print(f"  naive CuPy {dtype} d={headdim} N={seqlen}: {type(err).__name__}: {str(err)[:100]}", file=sys.stderr)
        if memory:
            result["numbaflash_peak_bytes"] = peak_extra_bytes(lambda: numbaflash.attention(q, k, v, causal=causal))
        cupy.get_default_memory_pool().free_all_blocks()
    result["seconds"] = time.perf_counter() - started
    return result


def memory_demo():
    """N = 131072, d = 128, one head, fp16: numbaflash runs; naive attention needs its 2 x N^2 score matrices."""
    torch = _torch()
    import cupy

    import numbaflash

    n, d = 131072, 128
    q, k, v = (torch.randn(1, n, 1, d, device="cuda", dtype=torch.float16) for _ in range(3))
    extra = peak_extra_bytes(lambda: numbaflash.attention(q, k, v, causal=True))
    ms = time_ms(lambda: numbaflash.attention(q, k, v, causal=True), warmup=1, repeats=3)
    print(f"numbaflash, N={n}, d={d}, 1 head, fp16, causal: {ms:.0f} ms, "
          f"{flops(1, 1, n, d, True) / ms / 1e9:.1f} TFLOP/s, peak extra memory {extra / 2**20:.1f} MiB "
          f"(out {n * d * 2 / 2**20:.0f} MiB + lse {n * 4 / 2**20:.1f} MiB)")
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(q)
    extra = peak_extra_bytes(lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True))
    ms = time_ms(lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True), warmup=1, repeats=3)
    print(f"numbaflash backward, same shape: {ms:.0f} ms, {flops(1, 1, n, d, True, backward=True) / ms / 1e9:.1f} "
          f"TFLOP/s, peak extra memory {extra / 2**20:.1f} MiB (dq, dk, dv {3 * n * d * 2 / 2**20:.0f} MiB "
          f"+ D {n * 4 / 2**20:.1f} MiB)")
    qc, kc, vc = (cupy.from_dlpack(x.transpose(1, 2)) for x in (q, k, v))
    try:
        naive_cupy(qc, kc, vc, True)
        print("naive CuPy attention ran (this GPU holds its N x N matrices)")
    except cupy.cuda.memory.OutOfMemoryError as err:
        print(f"naive CuPy attention: out of memory allocating its score matrix "
              f"({n * n * 2 / 2**30:.0f} GiB per N x N fp16 matrix): {str(err)[:120]}")


def table(results):
    cols = ["numbaflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive_cupy"]
    lines = [f"{'pass':<8} {'dtype':<8} {'d':>3} {'N':>6} {'causal':<6} {'ok':<3} "
             + " ".join(f"{c:>14}" for c in cols) + "   nf/flash  nf/eff   nf/naive  of matmul peak"]
    for r in results:
        cells = [f"{r.get(c):14.1f}" if r.get(c) else f"{'-':>14}" for c in cols]
        ratio = lambda other: f"{r['numbaflash'] / r[other]:8.2f}" if r.get(other) else f"{'-':>8}"
        lines.append(f"{r['pass_']:<8} {r['dtype']:<8} {r['headdim']:>3} {r['seqlen']:>6} {str(r['causal']):<6} "
                     f"{'yes' if r['correct'] else 'NO':<3} " + " ".join(cells)
                     + f" {ratio('sdpa_flash')} {ratio('sdpa_efficient')} {ratio('naive_cupy')}"
                     + f" {ratio('matmul_peak'):>15}")
    return ("TFLOP/s (median of CUDA-event timings); of matmul peak: numbaflash over torch's 8192^3 product in the "
            "same dtype, same run\n" + "\n".join(lines))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["pass_"], r["dtype"], r["headdim"], r["causal"]) for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 4), squeeze=False)
    for ax, key in zip(axes[0], groups):
        rows = [r for r in results if (r["pass_"], r["dtype"], r["headdim"], r["causal"]) == key]
        for col in ("numbaflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive_cupy"):
            pts = [(r["seqlen"], r[col]) for r in rows if r.get(col)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=col)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} {key[1]} d={key[2]}{' causal' if key[3] else ''}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    parser.add_argument("--quick", action="store_true", help="N = 4096 only")
    parser.add_argument("--tilings", action="store_true", help="also time each kernel's candidate tilings")
    parser.add_argument("--memory-demo", action="store_true")
    parser.add_argument("--memory", action="store_true", help="measure the peak extra memory of forward calls")
    parser.add_argument("--deterministic", choices=["yes", "no"], default="yes",
                        help="the backward's deterministic argument (no: atomic dQ where the plan has it)")
    parser.add_argument("--timing", choices=["call", "stream"], default="call",
                        help="each call alone on an idle GPU (host time included), or calls back to back")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    global TIMING
    TIMING = args.timing
    if args.memory_demo:
        memory_demo()
        return
    seqlens = [4096] if args.quick else args.seqlens
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    candidates = tiling_candidates() if args.tilings else None
    results = []
    for backward in [p == "backward" for p in args.passes]:
        for dtype in args.dtypes:
            for d in args.headdims:
                for n in seqlens:
                    for causal in causals:
                        results.append(run_case(dtype, d, n, causal, backward, candidates, args.memory,
                                                args.deterministic == "yes"))
                        print(table(results[-1:]).splitlines()[-1], f"({results[-1]['seconds']:.0f} s)", flush=True)
                        variants = {k[6:]: round(v, 1) for k, v in results[-1].items() if k.startswith("tiles ")}
                        if variants:
                            print("   tilings:", variants, flush=True)
                        save(results, args.out)  # after every case: a run cut short still leaves its numbers
    print()
    print(table(results))
    plot(results, os.path.join(args.out, "bench_tflops.png"))


def save(results, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def tiling_candidates():
    """Tilings worth comparing (`numbaflash.tiling` explains the fields); the backward takes the square ones
    and v5's."""
    from numbaflash.tiling import MmaTiles, Tiles, WgmmaTiles

    return [WgmmaTiles(128, 64, 2, producer=True, tma=True), WgmmaTiles(128, 64, 2), WgmmaTiles(128, 96, 2),
            WgmmaTiles(128, 112, 2), WgmmaTiles(128, 128, 2), WgmmaTiles(192, 64, 3), WgmmaTiles(64, 128, 1),
            Tiles(64, 64, 4, 4), Tiles(64, 32, 4, 2), Tiles(128, 64, 4, 4), Tiles(32, 32, 2, 2),
            MmaTiles(64, 64, 4), MmaTiles(128, 128, 8), MmaTiles(32, 32, 2), MmaTiles(128, 64, 4, 2),
            MmaTiles(128, 32, 4, 2), MmaTiles(256, 64, 8, 2), MmaTiles(256, 32, 8, 2)]


if __name__ == "__main__":
    main()
