"""Benchmark packed variable-length batches (`numbaflash.attention_varlen`) against padded batches (GPU).

For each head dim, causal and not (float16, 16 heads), in one run:

* equal lengths, 16 sequences of 1024: varlen against `numbaflash.attention` on the (16, 1024) batch, the
  same work: what packing itself costs (narrowing per block, the cu_seqlens check on the host);
* mixed lengths, 64 sequences of 32 to 1024 tokens (seed 0): varlen against `numbaflash.attention` on the
  batch padded to the longest, the issue's target (varlen at least as fast), and torch SDPA flash on
  that padded batch for scale (it attends over the padding too: it has no per-sequence lengths).

Forward and backward; each reported as the padded (or batch) time over varlen's: above 1, varlen is faster.
Every varlen call is first checked against `numbaflash.attention` on each of its first two sequences.

    python scripts/bench_varlen.py --out DIR
    python scripts/bench_varlen.py --split      # where packing's cost goes, at equal lengths

``--split`` times varlen against the same batch as 16 x 1024 and 2 x 8192 tokens: on the GPU (events), with
cu_seqlens read to the host on every call (as for CuPy arrays) and once (a torch tensor's copy is kept until
torch writes to it), and the host's own time per call (from an idle GPU).
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import NHEADS, sdpa_call, sdpa_only, time_ms  # noqa: E402


def problems(seed=0):
    rng = np.random.default_rng(seed)
    return {"equal, 16 x 1024": [1024] * 16, "mixed, 64 of 32-1024": [int(n) for n in rng.integers(32, 1025, 64)]}


def check_first_sequences(torch, q, k, v, cu, causal, out):
    """Max difference of varlen's output on sequences 0 and 1 from `numbaflash.attention` on each alone."""
    import numbaflash

    worst = 0.0
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = numbaflash.attention(q[None, rows], k[None, rows], v[None, rows], causal=causal)
        worst = max(worst, float((alone[0].float() - out[rows].float()).abs().max()))
    return worst


def run(headdim, causal, name, lengths):
    import torch

    import numbaflash

    gen = torch.Generator(device="cuda").manual_seed(0)
    total, longest, batch = sum(lengths), max(lengths), len(lengths)
    q, k, v, dout = (torch.randn(total, NHEADS, headdim, device="cuda", dtype=torch.float16, generator=gen)
                     for _ in range(4))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    padded = [torch.zeros(batch, longest, NHEADS, headdim, device="cuda", dtype=torch.float16) for _ in range(4)]
    for b, n in enumerate(lengths):
        for x, p in zip((q, k, v, dout), padded):
            p[b, :n] = x[int(cu[b]):int(cu[b]) + n]
    pq, pk, pv, pdout = padded
    out, lse = numbaflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
    row = dict(headdim=headdim, causal=causal, problem=name, sequences=batch, tokens=total, padded_tokens=batch * longest,
               max_error_first_sequences=check_first_sequences(torch, q, k, v, cu, causal, out))
    pout, plse = numbaflash.attention(pq, pk, pv, causal=causal, return_lse=True)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in padded[:3])
    calls = {
        "forward": (lambda: numbaflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal),
                    lambda: numbaflash.attention(pq, pk, pv, causal=causal),
                    lambda: sdpa_call(qt, kt, vt, causal)),
        "backward": (lambda: numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest,
                                                                  causal=causal),
                     lambda: numbaflash.attention_backward(pdout, pq, pk, pv, pout, plse, causal=causal),
                     lambda: torch.autograd.grad(sdpa_call(*(x.requires_grad_() for x in (qt, kt, vt)), causal),
                                                 (qt, kt, vt), pdout.transpose(1, 2))),
    }
    for key, (varlen, padded_call, flash) in calls.items():
        row[f"{key}_varlen_ms"] = time_ms(varlen)
        row[f"{key}_padded_ms"] = time_ms(padded_call)
        with sdpa_only("flash"):
            row[f"{key}_sdpa_flash_padded_ms"] = time_ms(flash)
        row[f"{key}_padded_over_varlen"] = row[f"{key}_padded_ms"] / row[f"{key}_varlen_ms"]
        row[f"{key}_sdpa_flash_padded_over_varlen"] = row[f"{key}_sdpa_flash_padded_ms"] / row[f"{key}_varlen_ms"]
    return row


def host_ms(torch, fn, repeats=20):
    """Median wall time of ``fn`` started on an idle GPU: the host's own cost of a call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def split(headdims):
    import torch

    import numbaflash

    for headdim in headdims:
        for causal in (False, True):
            for batch, seqlen in ((16, 1024), (2, 8192)):
                q, k, v = (torch.randn(batch * seqlen, NHEADS, headdim, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32, device="cuda")
                q4, k4, v4 = (x.view(batch, seqlen, NHEADS, headdim) for x in (q, k, v))
                same = lambda: numbaflash.attention(q4, k4, v4, causal=causal)
                packed = lambda: numbaflash.attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=causal)
                t_same, t_packed = time_ms(same), time_ms(packed)
                h_same, h_packed = host_ms(torch, same), host_ms(torch, packed)
                copied = lambda: numbaflash.attention_varlen(q, k, v, cu.clone(), cu.clone(), seqlen, seqlen,
                                                             causal=causal)  # a new tensor: copied every call
                t_copied = time_ms(copied)
                print(f"d={headdim} {'causal' if causal else 'full'} {batch} x {seqlen}: batch/varlen "
                      f"{t_same / t_packed:.2f}, copying cu_seqlens every call {t_same / t_copied:.2f}; host ms per "
                      f"call: varlen {h_packed:.3f}, batch {h_same:.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out", default=".")
    parser.add_argument("--split", action="store_true", help="where packing's cost goes, at equal lengths")
    args = parser.parse_args()
    import torch

    print(f"device: {torch.cuda.get_device_name()}")
    if args.split:
        split(args.headdims)
        return
    rows = []
    for headdim in args.headdims:
        for causal in (False, True):
            for name, lengths in problems().items():
                row = run(headdim, causal, name, lengths)
                rows.append(row)
                print(f"d={headdim:<4} {'causal' if causal else 'full':<7} {name:<22} error {row['max_error_first_sequences']:.1e}"
                      + "".join(f"  {key}: padded/varlen {row[f'{key}_padded_over_varlen']:.2f}, sdpa flash padded/varlen "
                                f"{row[f'{key}_sdpa_flash_padded_over_varlen']:.2f} ({row[f'{key}_varlen_ms']:.3f} ms)"
                                for key in ("forward", "backward")), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_varlen.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
