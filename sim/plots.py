"""Figures of `sim` counts (needs the ``plot`` extra, matplotlib).

* `traffic_vs_seqlen`: HBM traffic against N on log-log axes, with 4N^2 + 4Nd and N^2 d^2 / M drawn.
* `traffic_vs_sram`: traffic against the SRAM size M, the block-size sweep of the paper's Figure 2.
* `tile_heatmap`: elements moved by each (query block, key block) step of one schedule.
"""

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLE = {"standard": ("tab:red", "o"), "flash1": ("tab:blue", "s"), "flash2": ("tab:green", "^")}


def _setting(p):
    """The problem's batch, heads and mask, for a title."""
    heads = f"{p.nheads} heads" + (f" ({p.nheads_kv} kv)" if p.nheads_kv != p.nheads else "")
    if (p.left, p.right) == (-1, -1):
        mask = "no mask"
    elif p.right == 0 and p.left == -1:
        mask = "causal"
    else:
        mask = f"window ({p.left}, {p.right})"
    return f"batch {p.batch}, {heads}, {mask}"


def _integer_ticks(ax, values):
    """Ticks at the swept values, labelled as integers (log axes would print 2^k or 10^k)."""
    ax.set_xticks(values)
    ax.set_xticklabels([f"{v:g}" for v in values])
    ax.minorticks_off()


def _save_log_log(plt, fig, ax, path, swept, xlabel, title):
    """A traffic figure's axes (log 2 over the ``swept`` values, log traffic), labels and legend, written to ``path``."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _integer_ticks(ax, swept)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("HBM traffic (elements)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def traffic_vs_seqlen(sweep, path):
    """``sweep``: {algorithm: [Report, ...]} over increasing N with one d and M."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    first = next(iter(sweep.values()))
    n = np.array([r.problem.seqlen_q for r in first], dtype=float)
    d, M, heads = first[0].problem.headdim, first[0].sram_elems, first[0].problem.batch * first[0].problem.nheads
    for alg, reports in sweep.items():
        color, marker = STYLE[alg]
        ax.plot(n, [r.total for r in reports], marker=marker, color=color, label=f"{alg} (counted)")
    # The formulas as lines over an octave either side, so that even one N shows them.
    line = np.geomspace(n.min() / 2, n.max() * 2, 64)
    ax.plot(line, heads * (4 * line**2 + 4 * line * d), "k--", label=r"$4N^2 + 4Nd$")
    ax.plot(line, heads * line**2 * d**2 / M, "k:", label=r"$N^2 d^2 / M$")
    _save_log_log(plt, fig, ax, path, n, "sequence length N",
                  f"Forward HBM traffic, d = {d}, M = {M} elements\n{_setting(first[0].problem)}")


def traffic_vs_sram(sweep, path):
    """``sweep``: {algorithm: [Report, ...]} over increasing M with one N and d."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    first = next(iter(sweep.values()))
    p = first[0].problem
    for alg, reports in sweep.items():
        color, marker = STYLE[alg]
        kib = [r.sram_elems * r.dtype_bytes / 1024 for r in reports]
        ax.plot(kib, [r.total for r in reports], marker=marker, color=color, label=alg)
        if alg == "flash2":
            for x, r in zip(kib, reports):
                ax.annotate(f"{r.blocks.rows}", (x, r.total), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7, color=color)
    _save_log_log(plt, fig, ax, path, kib, f"SRAM M (KiB at {first[0].dtype_bytes} B/element); labels: "
                  "FlashAttention-2's B_r",
                  f"Forward traffic vs SRAM size, N = {p.seqlen_q}, d = {p.headdim}\n{_setting(p)}")


def _tile_grid(report):
    """Elements moved per (i, j) step of batch 0, head 0; last column: each query block's own traffic."""
    first = [s for s in report.tiles if s.get("b", 0) == 0 and s.get("h", 0) == 0 and "i" in s]
    inner = [s for s in first if "j" in s]
    n_i = max(s["i"] for s in first) + 1
    n_j = max(s["j"] for s in inner) + 1
    grid = np.full((n_i, n_j + 1), np.nan)
    for s in first:
        cell = (s["i"], s["j"] if "j" in s else n_j)
        grid[cell] = np.nansum([grid[cell], sum(s["reads"].values()) + sum(s["writes"].values())])
    return grid


def tile_heatmap(reports, path):
    """One panel per report (a query-block-outer schedule such as FlashAttention-2's forward)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 5.5), squeeze=False)
    for ax, (title, report) in zip(axes[0], reports):
        grid = _tile_grid(report)
        image = ax.imshow(grid, cmap="viridis", aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="elements moved in the step (blank: tile skipped)")
        ax.axvline(grid.shape[1] - 1.5, color="white", lw=2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"key block j (B_c = {report.blocks.cols}); last column: Q_i in, O_i and LSE_i out")
        ax.set_ylabel(f"query block i (B_r = {report.blocks.rows})")
        p = report.problem
        ax.set_title(f"{report.algorithm} {report.direction}, {title}\nN = {p.seqlen_q}, d = {p.headdim}, "
                     f"{_setting(p)}; one (batch, kv head) group's steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
