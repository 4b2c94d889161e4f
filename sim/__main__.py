"""``python -m sim``: IO report tables for a grid of N, d and M, and the figures.

Example (the README's report)::

    python -m sim --seqlen 8192 --headdim 128 --sram-kib 192 --out reports
"""

import argparse
import itertools
import os
import sys
import time

from . import ALGORITHMS, SramOverflow, count_io, plots
from .report import describe, per_tensor, table


class Progress:
    """A one-line progress bar on stderr for sweeps that take more than a moment."""

    def __init__(self, total, label):
        self.total, self.label, self.done, self.start = total, label, 0, time.time()

    def step(self, what=""):
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        elapsed = time.time() - self.start
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.1f}s {what:<40}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _bounded(kind, low, what):
    """An argparse type: ``kind`` (int or float) of at least ``low``; a bad value is a usage error."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


POSITIVE_INT = _bounded(int, 1, "an integer >= 1")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=POSITIVE_INT, nargs="+", default=[8192], help="N values (queries = keys)")
    parser.add_argument("--headdim", type=POSITIVE_INT, nargs="+", default=[128], help="d values")
    parser.add_argument("--sram-kib", type=_bounded(float, 1 / 1024, "a size of at least 1/1024 KiB"), nargs="+",
                        default=[192], help="SRAM sizes M in KiB")
    parser.add_argument("--dtype-bytes", type=POSITIVE_INT, default=2, help="bytes per element (2: fp16/bf16)")
    parser.add_argument("--batch", type=POSITIVE_INT, default=1)
    parser.add_argument("--nheads", type=POSITIVE_INT, default=1)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=_bounded(int, -1, "an integer >= -1 (-1: unbounded)"), nargs=2,
                        default=(-1, -1), metavar=("LEFT", "RIGHT"))
    parser.add_argument("--out", default="reports", help="folder for the figures")
    parser.add_argument("--no-figures", action="store_true")
    parser.add_argument("--per-tensor", action="store_true", help="also print each tensor's reads and writes")
    return parser.parse_args(argv)


def _count(args, n, d, kib, algorithm, backward, **kw):
    return count_io(n, d, sram_bytes=int(kib * 1024), algorithm=algorithm, batch=args.batch, nheads=args.nheads,
                    causal=args.causal, window_size=tuple(args.window), backward=backward,
                    dtype_bytes=args.dtype_bytes, **kw)  # values checked where count_io's budget allows


def _tables(args):
    grid = list(itertools.product(args.seqlen, args.headdim, args.sram_kib))
    for n, d, kib in grid:
        runs = [(alg, bwd, {}) for bwd in (False, True) for alg in ALGORITHMS]
        runs.append(("flash2", True, {"dq": "separate"}))
        progress = Progress(len(runs), f"N={n} d={d} M={kib:g} KiB")
        reports = []
        for alg, bwd, kw in runs:
            try:
                reports.append(_count(args, n, d, kib, alg, bwd, **kw))
            except SramOverflow as err:
                print(f"\n{alg} {'backward' if bwd else 'forward'}: {err}", file=sys.stderr)
            progress.step(f"{alg} {'bwd' if bwd else 'fwd'}")
        if not reports:
            raise ValueError(f"nothing could be counted at N={n} d={d} M={kib:g} KiB: every schedule overflows "
                             "that SRAM (see above); give a larger --sram-kib")
        print(f"\n{describe(reports[0])}  [{reports[0].checked}]")
        print(table(reports))
        if args.per_tensor:
            for r in reports:
                print(per_tensor(r))


def _counted(args, d, points, title, label):
    """{algorithm: [Report, ...]}: every algorithm counted (no arithmetic) at each ``(N, SRAM KiB)`` of ``points``,
    with the command line's batch, heads, dtype and mask; ``label(N, KiB)`` names a point in the progress line."""
    progress = Progress(len(points) * len(ALGORITHMS), title)
    counted = {alg: [] for alg in ALGORITHMS}
    for n, kib in points:
        for alg in ALGORITHMS:
            counted[alg].append(count_io(n, d, sram_bytes=int(kib * 1024), algorithm=alg, dtype_bytes=args.dtype_bytes,
                                         batch=args.batch, nheads=args.nheads, causal=args.causal,
                                         window_size=tuple(args.window), compute=False))
            progress.step(f"{label(n, kib)} {alg}")
    return counted


def _figures(args):
    os.makedirs(args.out, exist_ok=True)
    d, kib = args.headdim[0], args.sram_kib[0]
    # One N given: it and the four powers of two below it (at least 16), so the sweep shows the trend.
    n = args.seqlen[0]
    seqlens = sorted(args.seqlen) if len(args.seqlen) > 1 else sorted(
        {n} | {2**k for k in range(max(4, n.bit_length() - 5), n.bit_length()) if 2**k < n})
    by_n = _counted(args, d, [(n, kib) for n in seqlens], "traffic vs N", lambda n, _: f"N={n}")
    plots.traffic_vs_seqlen(by_n, os.path.join(args.out, "traffic_vs_seqlen.png"))

    n = max(args.seqlen)
    sizes = sorted({2.0**k for k in range(5, 11)} | set(args.sram_kib))
    by_m = _counted(args, d, [(n, size) for size in sizes], "traffic vs M", lambda _, size: f"M={size:g} KiB")
    plots.traffic_vs_sram(by_m, os.path.join(args.out, "traffic_vs_sram.png"))

    # A heat map is readable with tens of blocks a side; the causal panel shows the skipped tiles.
    heat_n = min(n, 4096)
    masks = [("as requested", dict(causal=args.causal, window_size=tuple(args.window)))]
    if not args.causal:
        masks.append(("causal", dict(causal=True)))
    panels = [(title, count_io(heat_n, d, sram_bytes=int(kib * 1024), algorithm="flash2", batch=args.batch,
                               nheads=args.nheads, dtype_bytes=args.dtype_bytes, compute=False, **mask))
              for title, mask in masks]
    plots.tile_heatmap(panels, os.path.join(args.out, "tile_heatmap.png"))
    print(f"\nfigures written to {args.out}/: traffic_vs_seqlen.png, traffic_vs_sram.png, tile_heatmap.png")


def main(argv=None):
    args = _parse(argv)
    try:
        _tables(args)
        if not args.no_figures:
            _figures(args)
    except (ValueError, TypeError) as err:  # a combination of arguments no schedule can run: say so, no traceback
        print(f"python -m sim: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
