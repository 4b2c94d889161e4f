"""Benchmark the score and mask modifications against the same call without them (GPU).

For each head dim and sequence length (float16, or --dtype bfloat16; 16 heads, batch x seqlen = 16384), in one
run: the plain kernel, softcap, ALiBi, both, a per-head temperature as a score_mod, a mask_mod equal to causal (dense,
and through a block mask) against the built-in causal, and 8 equal documents (causal inside each,
through a block mask) against dense causal attention; forward and backward; each reported as its time
over the plain (or built-in causal) kernel's, with torch SDPA flash's time for scale (dense, causal
for the masked rows: the speedup of a document mask shows as a ratio above 1). Every modified call is first
checked against the float64 reference on one head of one batch element (flash-attn's rule is the
tests' job; this guards the timings against a kernel that computes something else).

    python scripts/bench_mods.py --out DIR         # head dims 64 and 128, N = 4096 and 16384
    python scripts/bench_mods.py --seqlens 2048 --headdims 64
    python scripts/bench_mods.py --timing stream   # calls back to back, as bench.py --timing stream
    python scripts/bench_mods.py --flex            # also torch's FlexAttention, plain and with softcap
    python scripts/bench_mods.py --dtype bfloat16  # where softcap takes its bound as every row's maximum
    python scripts/bench_mods.py --rounds 3        # each variant thrice, right after its base: median ratios, ranges
    python scripts/bench_mods.py --deterministic no  # backwards as deterministic=False plans them (softcap: atomic dQ)
    python scripts/bench_mods.py --jobs 8          # 8 processes compile at once and take turns on the GPU
    python scripts/bench_mods.py --variants ALiBi  # only these variants, with the bases they are timed against

One pass times each variant once, at one moment of the GPU's clock and power state: the same kernels' ratios moved
by 5-10% between runs (H100, docs/modifications.md). ``--rounds`` times every variant once a round, each time right
after its base kernel, the rounds starting at successive variants, and reports the median of those ratios with their
range.

A process compiles each variant's kernels before it times any (from an empty disk cache, one process timing the
backward at headdim 64 ran out of an 8-minute limit: H100, 2026-11-28). ``--jobs N`` shares the variants among N
processes (each also runs the bases its variants are timed against), which compile at the same time, wait for one
another, and time one at a time, holding a file lock: ``--jobs 7 --timing stream --passes forward backward --headdims
64 128 --seqlens 16384 --rounds 3`` took 4.6 minutes from an empty cache on the H100's 16 cores, 4.4 on the H200's. A
variant's ratio is to its base timed in its own process.

With --flex the same run times torch's FlexAttention (compiled Triton kernels) without and with softcap as a
score_mod: its softcap's cost over its own plain kernel is the yardstick for numbaflash's.

Writes bench_mods.json under --out.
"""

import argparse
import collections
import contextlib
import fcntl
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import NHEADS, TOKENS, flops, sdpa_call, sdpa_only, time_ms  # noqa: E402


def tempered(score, b, h, q_idx, kv_idx, temperature):
    return score * temperature[h]


def tempered_grad(score, b, h, q_idx, kv_idx, temperature):
    return temperature[h]


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def same_document_causal(b, h, q_idx, kv_idx, doc):
    return doc[0, q_idx] == doc[0, kv_idx] and kv_idx <= q_idx


def block_masks(torch, seqlen, documents=8):
    """(name, options, over) rows of the block-mask comparison: a mask_mod equal to causal through a block
    mask against the built-in causal, and ``documents`` equal documents, causal inside each, against dense
    causal attention over the whole sequence."""
    import numbaflash

    causal = numbaflash.block_mask(causal_mask, None, None, seqlen, seqlen)
    doc = (torch.arange(seqlen, device="cuda", dtype=torch.int32) // (seqlen // documents))[None]
    documents_mask = numbaflash.block_mask(same_document_causal, None, None, seqlen, seqlen, mod_args=(doc,))
    return [("causal (block mask)", dict(block_mask=causal), "causal (built-in)"),
            (f"{documents} documents (block mask)", dict(block_mask=documents_mask, mod_args=(doc,)), "causal (built-in)")]


def variants(torch, nheads):
    slopes = torch.tensor([2 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda", dtype=torch.float32)
    temperature = torch.linspace(0.5, 1.5, nheads, device="cuda", dtype=torch.float32)
    return {
        "plain": dict(),
        "softcap 30": dict(softcap=30.0),
        "ALiBi": dict(alibi_slopes=slopes),
        "softcap + ALiBi": dict(softcap=30.0, alibi_slopes=slopes),
        "score_mod temperature": dict(score_mod=tempered, score_mod_grad=tempered_grad, mod_args=(temperature,)),
        "causal (built-in)": dict(causal=True),
        "causal (mask_mod)": dict(mask_mod=causal_mask),
    }


BASES = ("plain", "causal (built-in)")  # what the other variants are timed against
# Every row `variants` and `block_masks` list, in their order (`--variants` takes these)
NAMES = ("plain", "softcap 30", "ALiBi", "softcap + ALiBi", "score_mod temperature", "causal (built-in)",
         "causal (mask_mod)", "causal (block mask)", "8 documents (block mask)")


def bases(listed):
    """Each ``(name, options, over)`` entry's base: ``over`` if given, else the built-in causal for a causal variant
    and the plain kernel for the others."""
    return {name: over or ("causal (built-in)" if "causal" in name else "plain") for name, _, over in listed}


def chosen(listed, base_of, names):
    """``listed``'s entries named in ``names`` (all for None) and the bases those are timed against, in the listed
    order: a run of a few variants compiles and times nothing else."""
    if names is None:
        return listed
    keep = set(names) | {base_of[name] for name in names}
    return [entry for entry in listed if entry[0] in keep]


def share_of(listed, base_of, share):
    """``listed``'s entries that worker ``index`` of ``count`` (``share``) times: every ``count``-th variant that is no
    base, from the ``index``-th, and the bases those are timed against (none if it has no variant)."""
    index, count = share
    mine = [name for name, _, _ in listed if name not in BASES][index::count]
    keep = set(mine) | {base_of[name] for name in mine}
    return [entry for entry in listed if entry[0] in keep]


@contextlib.contextmanager
def gpu_turn(lock_path, share):
    """For ``--jobs``' worker ``share`` (index, count): wait until every worker has compiled and run its calls once (a
    file each beside ``lock_path``), so that none runs a kernel while another times, then hold the exclusive file
    lock ``lock_path`` while the caller times. Nothing without a lock (one process)."""
    if lock_path is None:
        yield
        return
    index, count = share
    open(f"{lock_path}.{index}.ready", "w").close()
    while not all(os.path.exists(f"{lock_path}.{i}.ready") for i in range(count)):
        time.sleep(0.5)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def check_one_head(torch, q, k, v, options):
    """Max error of batch 0, head 0 against the float64 reference (the slopes and tables are per head: head 0's)."""
    import numbaflash
    from numbaflash import reference

    if "block_mask" in options:  # made for the whole problem: checked through the dense mask_mod instead
        options = {**{k: v for k, v in options.items() if k != "block_mask"}, "mask_mod": options["block_mask"].mask_mod}
    one = {key: (value[:1] if key == "alibi_slopes" else tuple(a[:1] for a in value) if key == "mod_args" else value)
           for key, value in options.items()}
    host = {key: (value.cpu().numpy() if key == "alibi_slopes" else tuple(a.cpu().numpy() for a in value)
                  if key == "mod_args" else value) for key, value in one.items()}
    q1, k1, v1 = (x[:1, :, :1] for x in (q, k, v))
    got = numbaflash.attention(q1, k1, v1, **one)
    want, _ = reference.attention_forward(*(x.float().cpu().numpy() for x in (q1, k1, v1)), **host)
    return float(np.abs(got.float().cpu().numpy() - want).max())


def flex_rows(torch, q, k, v, dout, passes, row_of):
    """FlexAttention's plain and softcap rows, timed as numbaflash's are (softcap over its own plain kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # (batch, nheads, seqlen, headdim)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    rows = []
    for name, score_mod in (("FlexAttention plain", None), ("FlexAttention softcap 30", softcap)):
        row = row_of(name)
        for backward in passes:
            if backward:
                leaves = tuple(x.detach().requires_grad_() for x in (qt, kt, vt))
                out = flex(*leaves, score_mod=score_mod)
                fn = lambda: torch.autograd.grad(out, leaves, dout.transpose(1, 2), retain_graph=True)
            else:
                fn = lambda: flex(qt, kt, vt, score_mod=score_mod)
            row[f"{'backward' if backward else 'forward'}_ms"] = time_ms(fn)
        rows.append(row)
    return rows


Prepared = collections.namedtuple("Prepared", "operands listed base_of ours sdpa rows passes rounds with_flex")


def prepare(headdim, seqlen, passes, with_flex=False, dtype="float16", rounds=1, deterministic=True, share=(0, 1),
            names=None):
    """The calls of one head dim and sequence length, each run once, for `timed` (a `Prepared`; None where worker
    ``share``, (index, count) of ``--jobs``, has no variant of its `share_of`). With ``rounds`` > 1 each variant is
    timed once a round, the rounds starting at successive variants, right after its base (the plain kernel, or the
    built-in causal): its ratio is the median of the rounds' ratios of neighbours, with their range.
    ``deterministic``: the backwards'. ``names``: the variants to time (`chosen`), None for all."""
    import torch

    import numbaflash

    batch = max(1, TOKENS // seqlen)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, NHEADS, headdim, device="cuda", dtype=getattr(torch, dtype),
                                 generator=gen) for _ in range(4))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    listed = [(name, options, None) for name, options in variants(torch, NHEADS).items()] + block_masks(torch, seqlen)
    assert tuple(name for name, _, _ in listed) == NAMES, "NAMES lists every variant"
    base_of = bases(listed)
    order = {name: i for i, (name, _, _) in enumerate(listed)}
    listed = share_of(chosen(listed, base_of, names), base_of, share)
    if not listed:
        return None
    # Every variant's kernels compiled, loaded and run once before any is timed. Without it the built-in causal
    # forward at headdim 64 took 1.35-1.44 ms in a process's first pass over the variants (four processes) and
    # 1.25 in a second pass, against 1.18-1.25 in other scripts; with it 1.23-1.26 (H100, fp16, N = 16384). The
    # cause is not known: its kernel is the plain one's, loaded before, and warming up after a first call did not
    # help.
    ours, sdpa, rows = {}, {}, []
    for name, options, _ in listed:
        causal = options.get("causal", False) or "mask_mod" in options or "block_mask" in options
        row = dict(headdim=headdim, seqlen=seqlen, batch=batch, dtype=dtype, variant=name, causal=causal,
                   over=base_of[name], deterministic=deterministic, order=order[name])
        if seqlen <= 4096:
            row["max_error_one_head"] = check_one_head(torch, q, k, v, options)
        rows.append(row)
        out, lse = numbaflash.attention(q, k, v, return_lse=True, **options)  # the backward's; `ours` runs without
        for backward in passes:
            if backward:
                ours[name, backward] = functools.partial(numbaflash.attention_backward, dout, q, k, v, out, lse,
                                                         deterministic=deterministic, **options)
                sdpa[name, backward] = functools.partial(_sdpa_backward, torch, qt, kt, vt, dout, causal)
            else:
                ours[name, backward] = functools.partial(numbaflash.attention, q, k, v, **options)
                sdpa[name, backward] = functools.partial(sdpa_call, qt, kt, vt, causal)
            ours[name, backward]()  # the kernels timed below (without the LSE some plans take others: `tiling`)
    torch.cuda.synchronize()
    return Prepared((q, k, v, dout), listed, base_of, ours, sdpa, rows, passes, rounds, with_flex and share[0] == 0)


def timed(prepared):
    """The rows of a `prepare`'s calls, timed (and FlexAttention's after them, if asked for); [] for None."""
    if prepared is None:
        return []
    import torch

    (q, k, v, dout), listed, base_of, ours, sdpa, rows, passes, rounds, with_flex = prepared
    batch, seqlen, _, headdim = q.shape
    times, ratios = {key: [] for key in ours}, {key: [] for key in ours}
    for r in range(rounds):
        for name, _, _ in listed[r % len(listed):] + listed[:r % len(listed)]:
            for backward in passes:
                key, base = (name, backward), (base_of[name], backward)
                paired = rounds > 1 and base != key
                if paired:
                    times[base].append(time_ms(ours[base]))
                times[key].append(time_ms(ours[key]))
                if paired:
                    ratios[key].append(times[key][-1] / times[base][-1])
    for row in rows:
        name = row["variant"]
        for backward in passes:
            key = "backward" if backward else "forward"
            ms = statistics.median(times[name, backward])
            each = ratios[name, backward] or [ms / statistics.median(times[base_of[name], backward])]
            row[f"{key}_ms"] = ms
            row[f"{key}_tflops"] = flops(batch, NHEADS, seqlen, headdim, row["causal"], backward) / ms / 1e9
            row[f"{key}_over_plain"] = statistics.median(each)
            row[f"{key}_over_plain_range"] = [min(each), max(each)]
            with sdpa_only("flash"):
                row[f"{key}_sdpa_flash_ms"] = time_ms(sdpa[name, backward])
            row[f"{key}_over_sdpa_flash"] = row[f"{key}_sdpa_flash_ms"] / ms
    if with_flex:
        flex = flex_rows(torch, q, k, v, dout, passes,
                         lambda name: dict(headdim=headdim, seqlen=seqlen, batch=batch, variant=name))
        for row in flex:
            for key in ("forward", "backward"):
                if f"{key}_ms" in row:
                    row[f"{key}_over_plain"] = row[f"{key}_ms"] / flex[0][f"{key}_ms"]  # over FlexAttention plain
        rows += flex
    return rows


def _sdpa_backward(torch, qt, kt, vt, dout, causal):
    leaves = tuple(x.requires_grad_() for x in (qt, kt, vt))
    return torch.autograd.grad(sdpa_call(*leaves, causal), leaves, dout.transpose(1, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    parser.add_argument("--timing", choices=["call", "stream"], default="call",
                        help="each call alone (its host time included), or calls back to back (bench.py's --timing)")
    parser.add_argument("--flex", action="store_true", help="also time torch's FlexAttention, plain and with softcap")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant this many times, each right after its base: median ratios, ranges")
    parser.add_argument("--deterministic", choices=["yes", "no"], default="yes",
                        help="the backwards' deterministic argument (no: softcap's plan runs the atomic dQ at 64)")
    parser.add_argument("--variants", nargs="+", choices=NAMES, default=None, metavar="NAME",
                        help="time only these variants (and their bases); one of: " + ", ".join(map(repr, NAMES)))
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes that compile at the same time and take turns to time (see above)")
    parser.add_argument("--share", type=int, nargs=2, default=(0, 1), metavar=("INDEX", "COUNT"),
                        help=argparse.SUPPRESS)  # a --jobs worker's
    parser.add_argument("--lock", default=None, help=argparse.SUPPRESS)  # the --jobs workers' GPU lock
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs takes a positive number of processes; got {args.jobs}")
    if args.variants is not None and set(args.variants) <= set(BASES):
        parser.error(f"--variants needs a variant other than the bases {BASES}, which the others are timed against; "
                     f"got {args.variants}")
    if not 0 <= args.share[0] < args.share[1]:
        parser.error(f"--share takes INDEX COUNT with 0 <= INDEX < COUNT; got {args.share}")
    if args.jobs > 1:
        rows = _from_workers(args, sys.argv[1:])
    else:
        import torch

        import bench

        bench.TIMING = args.timing
        print(f"device: {torch.cuda.get_device_name()}, {args.dtype}, deterministic={args.deterministic}", flush=True)
        share = tuple(args.share)
        steps = [prepare(headdim, seqlen, [p == "backward" for p in args.passes], args.flex, args.dtype, args.rounds,
                         args.deterministic == "yes", share, args.variants)
                 for headdim in args.headdims for seqlen in args.seqlens]
        rows = []
        with gpu_turn(args.lock, share):
            for step in steps:
                for row in timed(step):
                    rows.append(row)
                    if args.lock is None:
                        print(describe(row, args.rounds), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mods.json"), "w") as f:
        json.dump(rows, f, indent=1)


def describe(row, rounds):
    """One printed line of a row."""
    cells = [f"d={row['headdim']:<4} N={row['seqlen']:<6} {row['variant']:<22}"]
    for key in ("forward", "backward"):
        if f"{key}_sdpa_flash_ms" in row:
            low, high = row[f"{key}_over_plain_range"]
            spread = f" ({low:.3f}-{high:.3f})" if rounds > 1 else ""
            cells.append(f"{key} {row[f'{key}_tflops']:6.1f} TFLOP/s x{row[f'{key}_over_plain']:.3f}{spread} "
                         f"of {row['over']}, {row[f'{key}_over_sdpa_flash']:.2f}x SDPA flash")
        elif f"{key}_ms" in row:  # FlexAttention's rows, over its own plain kernel
            cells.append(f"{key} {row[f'{key}_ms']:.3f} ms x{row[f'{key}_over_plain']:.3f} of its plain")
    if "max_error_one_head" in row:
        cells.append(f"err {row['max_error_one_head']:.1e}")
    return " | ".join(cells)


def _from_workers(args, argv):
    """``--jobs``: the rows of ``args.jobs`` worker processes of this script, run with this one's arguments ``argv``
    (the options appended after them override theirs), each variant's from the worker that ran it (a base's from the
    first that did), printed in the order one process prints them."""
    with tempfile.TemporaryDirectory() as scratch:
        lock = os.path.join(scratch, "gpu.lock")
        common = [sys.executable, os.path.abspath(__file__), *argv, "--jobs", "1", "--lock", lock]
        workers = []
        for index in range(args.jobs):
            out = os.path.join(scratch, str(index))
            log = open(os.path.join(scratch, f"{index}.log"), "w")
            workers.append((subprocess.Popen(common + ["--share", str(index), str(args.jobs), "--out", out],
                                             stdout=log, stderr=subprocess.STDOUT), out, log))
        # Polled together: a worker that fails leaves the others waiting for it at `gpu_turn`, so they are stopped.
        failed = None
        try:
            while failed is None:
                codes = [process.poll() for process, _, _ in workers]  # every one polled, none passed over
                failed = next((worker for worker, code in zip(workers, codes) if code not in (None, 0)), None)
                if None not in codes:
                    break
                time.sleep(1)
        finally:  # an interrupted parent, too, leaves no worker behind
            for process, _, log in workers:
                if process.poll() is None:
                    process.kill()
                process.wait()
                log.close()
        if failed is not None:
            process, out, log = failed
            with open(log.name) as f:
                raise SystemExit(f"worker {out} failed ({process.returncode}):\n{f.read()[-4000:]}")
        rows, seen = [], set()
        for _, out, _ in workers:
            with open(os.path.join(out, "bench_mods.json")) as f:
                for row in json.load(f):
                    key = (row["headdim"], row["seqlen"], row["variant"])
                    if key not in seen:
                        seen.add(key)
                        rows.append(row)
    rows.sort(key=lambda row: (args.headdims.index(row["headdim"]), args.seqlens.index(row["seqlen"]),
                               row.get("order", len(rows))))
    import torch

    print(f"device: {torch.cuda.get_device_name()}, {args.dtype}, deterministic={args.deterministic}, "
          f"{args.jobs} processes", flush=True)
    for row in rows:
        print(describe(row, args.rounds), flush=True)
    return rows


if __name__ == "__main__":
    main()
