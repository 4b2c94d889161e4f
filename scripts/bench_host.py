"""Where a short call's time goes: the host before the kernel starts, against torch SDPA flash (GPU).

Two measurements, in one run:

* host microseconds per call on tiny inputs (1 x 128 x 1 x 64, float16, causal), where the GPU waits on the
  host: `numbaflash.attention`, `numbaflash.attention_backward`, SDPA flash's forward inside ``sdpa_kernel``
  entered per call (whose context costs the call time of its own: `bench.py` enters it once around a
  timing since this release) and SDPA with torch's default backend choice, each called back to back and
  timed on the host clock;
* at one problem (default: batch x N = 16384, N = 2048, 16 heads, headdim 64, causal), each call timed
  alone (`bench.time_ms`: the host time before the kernel included, as a single call pays it) and 20 calls
  back to back (the host hidden behind the kernels before them: the kernel's own time), numbaflash and
  SDPA flash, forward; their ratio in each mode shows how much of the gap is the host.

    python scripts/bench_host.py
    python scripts/bench_host.py --seqlen 4096 --headdim 128 --no-causal

Host times vary by half from one machine to the next and from minute to minute on one: compare only the
numbers of one run.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import NHEADS, TOKENS, events_ms, sdpa, sdpa_call, sdpa_only, time_ms  # noqa: E402


def host_us(fn, calls=3000):
    """Microseconds per call of ``fn`` called back to back (its kernels are tiny: the GPU waits on the host)."""
    import torch

    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def back_to_back_ms(fn, calls=20, repeats=5):
    """Median milliseconds per call of ``calls`` calls issued back to back (events around them)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return events_ms(fn, calls, repeats)


def main():
    import torch

    import numbaflash

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)

    q, k, v, do = (torch.randn(1, 128, 1, 64, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flash = sdpa("flash")
    print(f"{torch.cuda.get_device_name()}, {args.dtype}")
    print("host microseconds per call (1 x 128 x 1 x 64, causal):")
    for name, fn in (("numbaflash forward", lambda: numbaflash.attention(q, k, v, causal=True)),
                     ("numbaflash backward", lambda: numbaflash.attention_backward(do, q, k, v, out, lse, causal=True)),
                     ("SDPA flash forward", lambda: flash(qt, kt, vt, True)),
                     ("SDPA, default backend", lambda: torch.nn.functional.scaled_dot_product_attention(
                         qt, kt, vt, is_causal=True))):
        print(f"  {name:22s} {host_us(fn):7.1f}", flush=True)

    batch, n, d = max(1, TOKENS // args.seqlen), args.seqlen, args.headdim
    q, k, v = (torch.randn(batch, n, NHEADS, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    ours, theirs = (lambda: numbaflash.attention(q, k, v, causal=args.causal)), (lambda: sdpa_call(qt, kt, vt, args.causal))
    with sdpa_only("flash"):
        single = (time_ms(ours), time_ms(theirs))
        loop = (back_to_back_ms(ours), back_to_back_ms(theirs))
    print(f"forward {batch} x {n} x {NHEADS} x {d}, causal={args.causal}: ms per call, numbaflash / SDPA flash")
    print(f"  one call alone (host included)   {single[0]:.4f} / {single[1]:.4f}  ({single[1] / single[0]:.2f}x SDPA flash)")
    print(f"  20 back to back (kernels alone)  {loop[0]:.4f} / {loop[1]:.4f}  ({loop[1] / loop[0]:.2f}x SDPA flash)")


if __name__ == "__main__":
    main()
