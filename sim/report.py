"""Text tables of `count_io` reports: standard vs FlashAttention-1 vs FlashAttention-2, side by side."""

from .formulas import asymptotic


def _human(n):
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def describe(report):
    """One line naming the problem and the SRAM budget a group of reports shares."""
    p = report.problem
    heads = f"heads={p.nheads}" + (f"/{p.nheads_kv}kv" if p.nheads_kv != p.nheads else "")
    mask = []
    if p.right == 0 and p.left < 0:
        mask.append("causal")
    elif (p.left, p.right) != (-1, -1):
        mask.append(f"window=({p.left},{p.right})")
    return (f"N_q={p.seqlen_q} N_k={p.seqlen_k} d={p.headdim} batch={p.batch} {heads} {' '.join(mask)}".rstrip()
            + f" | SRAM M={report.sram_elems} elements ({_bytes(report.sram_elems * report.dtype_bytes)}, "
              f"{report.dtype_bytes} B/element)")


def table(reports):
    """A fixed-width table: one row per report, with its counts and its ratio to both formulas."""
    header = ("algorithm", "pass", "B_r x B_c", "reads", "writes", "total", "bytes", "= closed form",
              "/ (4N^2+4Nd)", "/ (N^2d^2/M)")
    rows = []
    for r in reports:
        _, standard_value = asymptotic("standard", r.problem, r.sram_elems)
        _, flash_value = asymptotic("flash2", r.problem, r.sram_elems)
        name = r.algorithm + (f" ({r.dq} dQ)" if r.dq else "")
        rows.append((
            name, r.direction, f"{r.blocks.rows} x {r.blocks.cols}", _human(r.reads), _human(r.writes), _human(r.total),
            _bytes(r.total_bytes), "yes" if r.matches_prediction else f"NO ({_human(r.predicted['total'])})",
            f"{r.total / standard_value:.3f}", f"{r.total / flash_value:.2f}",
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line("-" * w for w in widths)] + [line(row) for row in rows])


def per_tensor(report):
    """Reads and writes of each tensor for one report, against its closed form."""
    lines = [f"{report.algorithm} {report.direction}: per tensor (reads / writes, elements)"]
    for name, counts in report.per_tensor.items():
        want = report.predicted["per_tensor"].get(name, {"reads": 0, "writes": 0})
        ok = "" if counts == want else f"   predicted {want['reads']} / {want['writes']}"
        lines.append(f"  {name:>4}: {counts['reads']:>14,} / {counts['writes']:>14,}{ok}")
    if report.uncharged:
        shown = ", ".join(f"{k} {v:,}" for k, v in sorted(report.uncharged.items()))
        lines.append(f"  GEMM operand re-reads served on chip (not charged): {shown}")
    return "\n".join(lines)
