"""Hold `sim.hardware`'s predictions against Nsight Compute's counters (GPU host with `ncu`).

    python scripts/measure_io.py                  # the grid below, every kernel family, under ncu
    python scripts/measure_io.py --quick          # N = 1024 and 4096 only
    python scripts/measure_io.py --families mma   # one family

For every kernel a call launches it prints the global bytes `sim.hardware` predicts (loads, stores and
asynchronous copies, at 32-byte sectors) and the DRAM bytes after its L2 model, beside what `ncu`
counted, with their ratio; it writes measure_io.csv (every number and the raw counters) and
measure_io.png (predicted against measured) under --out.

The grid: forward and backward, causal and not, headdim 64 and 128, N = 1024, 4096 and 16384 with
batch x N = 16384 and 16 heads (the CUDA-core family at batch x N = 4096 and 4 heads, N <= 4096: its
fp32 kernels run 20x slower, and every kernel runs several times under ncu), one GQA case (16 query
heads on 4 kv heads), one odd case (N = 1000, headdim 40, causal) and one block mask (8 documents,
causal inside each, N = 4096, headdim 64) per family and direction; and v5's backward with
deterministic=False (its dK/dV kernel adds dQ with reductions, ``red.global.add``) at headdim 64 and
N = 4096: plain, causal and the block mask. Families: ``simt`` (float32, CUDA cores), ``mma``
(float16, mma.sync, on a Hopper GPU too) and ``wgmma`` (float16, the Hopper kernels).

Backward calls run on random ``out`` and finite ``lse``: the kernels' memory traffic does not depend on
the values, and no forward launch gets between ncu and the kernels measured.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOKENS = 16384
NHEADS = 16
FAMILIES = ("simt", "mma", "wgmma")
# ncu's counters of what `sim.hardware` predicts. cp.async's copies (LDGSTS) count among the LSU's global
# loads; bulk tensor copies (TMA) bypass the LSU and arrive as the TMA unit's reads from the crossbar.
COUNTERS = {
    "load": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "tma": "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum",
    "store": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "reduce": "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
}
SECTOR_COUNTERS = ("load", "store", "reduce")
# Kinds of bytes compared: what ncu counts together, and the `sim.hardware.KernelTraffic` fields it is held against.
KINDS = {"load": ("load_bytes", "copy_bytes"), "tma": ("tma_bytes",), "store": ("store_bytes",),
         "reduce": ("reduce_bytes",), "dram_read": ("dram_read_bytes",), "dram_write": ("dram_write_bytes",)}


def grid(families, quick):
    cases = []
    for family in families:
        seqlens = (1024, 4096) if family == "simt" or quick else (1024, 4096, 16384)
        tokens, nheads = (4096, 4) if family == "simt" else (TOKENS, NHEADS)
        for backward in (False, True):
            for headdim in (64, 128):
                for seqlen in seqlens:
                    for causal in (False, True):
                        cases.append(dict(family=family, backward=backward, headdim=headdim, seqlen=seqlen,
                                          causal=causal, batch=max(1, tokens // seqlen), nheads=nheads,
                                          nheads_kv=nheads))
            cases.append(dict(family=family, backward=backward, headdim=128, seqlen=4096, causal=False,
                              batch=max(1, tokens // 4096), nheads=nheads, nheads_kv=nheads // 4))
            # A partial last tile, a causal diagonal and a padded head dim whose 80-byte rows straddle sectors.
            cases.append(dict(family=family, backward=backward, headdim=40, seqlen=1000, causal=True,
                              batch=max(1, tokens // 1000), nheads=nheads, nheads_kv=nheads))
            cases.append(dict(family=family, backward=backward, headdim=64, seqlen=4096, causal=False,
                              batch=max(1, tokens // 4096), nheads=nheads, nheads_kv=nheads, documents=DOCUMENTS))
            if family == "wgmma" and backward:  # deterministic=False: v5's dK/dV kernel adds dQ with reductions
                for causal, documents in ((False, 0), (True, 0), (False, DOCUMENTS)):
                    cases.append(dict(family=family, backward=True, headdim=64, seqlen=4096, causal=causal,
                                      batch=tokens // 4096, nheads=nheads, nheads_kv=nheads, documents=documents,
                                      atomic_dq=True))
    # one set of columns for the CSV
    return [dict(case, documents=case.get("documents", 0), atomic_dq=case.get("atomic_dq", False)) for case in cases]


DOCUMENTS = 8


def documents_of(case):
    """``(doc, block mask)`` of a case with documents (equal ones, causal inside each; host ids), else None."""
    import numpy as np

    import numbaflash
    from bench_mods import same_document_causal

    if not case["documents"]:
        return None
    n = case["seqlen"]
    doc = (np.arange(n, dtype=np.int32) // (n // case["documents"]))[None]
    return doc, numbaflash.block_mask(same_document_causal, None, None, n, n, mod_args=(doc,))


def dtype_of(family):
    return "float32" if family == "simt" else "float16"


def plan_of(case):
    """The plan of a grid case: the family's own kernels, as the benchmarks run them (a block mask's call plans its
    own tiles, `tiling.WGMMA_BLOCK_SPARSE_TILES`)."""
    from numbaflash import tiling

    headdim, backward = case["headdim"], case["backward"]
    tiles = None
    if case["family"] == "mma":  # on a Hopper GPU the plans run wgmma
        bucket = tiling.mma_headdim_bucket(headdim)
        tiles = tiling.MMA_BACKWARD_TILES[bucket] if backward else tiling.MMA_TILES[bucket]
    if case["atomic_dq"]:  # no plan picks it by itself (`tiling.make_plan`'s deterministic)
        tiles = tiling.WGMMA_BACKWARD_TILES[headdim]
    plan = tiling.make_plan(case["batch"], case["nheads"], case["nheads_kv"], case["seqlen"], case["seqlen"], headdim,
                            dtype_of(case["family"]), backward=backward, tiles=tiles,
                            block_sparse=bool(case["documents"]), deterministic=not case["atomic_dq"])
    if case["atomic_dq"] and plan.dq_strategy != "atomic":
        raise SystemExit(f"{case}: the plan runs {plan.dq_strategy} dQ, not atomic")
    family = ("wgmma" if isinstance(plan.tiles, tiling.WgmmaTiles) else
              "mma" if isinstance(plan.tiles, tiling.MmaTiles) else "simt")
    if family != case["family"]:
        raise SystemExit(f"{case}: this GPU plans the {family} family, not {case['family']}")
    return plan


def worker(cases_path):
    """Run every case once (what ncu profiles); print nothing ncu could confuse with its own output."""
    import cupy

    import numbaflash

    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        plan = plan_of(case)
        dtype = dtype_of(case["family"])
        b, n, h, hk, d = case["batch"], case["seqlen"], case["nheads"], case["nheads_kv"], case["headdim"]
        q = cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype)
        k = cupy.random.standard_normal((b, n, hk, d), dtype=cupy.float32).astype(dtype)
        v = cupy.random.standard_normal((b, n, hk, d), dtype=cupy.float32).astype(dtype)
        documents = documents_of(case)
        options = dict(causal=case["causal"], plan=plan)
        if documents is not None:
            options.update(block_mask=documents[1], mod_args=(cupy.asarray(documents[0]),))
        if case["backward"]:
            out = cupy.random.standard_normal(q.shape, dtype=cupy.float32).astype(dtype)
            dout = cupy.random.standard_normal(q.shape, dtype=cupy.float32).astype(dtype)
            lse = cupy.full((b, h, n), float(n), dtype=cupy.float32)
            numbaflash.attention_backward(dout, q, k, v, out, lse, deterministic=not case["atomic_dq"], **options)
        else:
            numbaflash.attention(q, k, v, **options)
        cupy.cuda.Device().synchronize()


def measure(cases, workdir):
    """ncu over the worker: one dict of counters (bytes) per kernel launch, in launch order."""
    cases_path = os.path.join(workdir, "cases.json")
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    report = os.path.join(workdir, "measure_io")
    command = ["ncu", "--clock-control", "none", "-k", "regex:attention", "--metrics", ",".join(COUNTERS.values()),
               "-f", "-o", report, sys.executable, os.path.abspath(__file__), "--worker", cases_path]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"ncu failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    exported = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
                              capture_output=True, text=True, check=True).stdout
    rows = [r for r in csv.DictReader(exported.splitlines()) if r.get("ID", "").isdigit()]  # row 2 holds units
    launches = []
    for r in rows:
        values = {"ncu_kernel": r["Kernel Name"].split("[")[0]}
        for key, metric in COUNTERS.items():
            text = r.get(metric, "").replace(",", "")
            value = float(text) if text not in ("", "n/a") else None
            values[key] = None if value is None else value * (32 if key in SECTOR_COUNTERS else 1)
        launches.append(values)
    return launches


def compare(cases, launches):
    """Predicted and measured bytes of every kernel launch, by kind."""
    from sim import hardware

    gpu = hardware.Gpu.current()
    results, i = [], 0
    for case in cases:
        plan = plan_of(case)
        documents = documents_of(case)
        predicted = hardware.predict(plan, causal=case["causal"], gpu=gpu,
                                     block_mask=None if documents is None else documents[1])
        for traffic in predicted.kernels:
            if i >= len(launches):
                raise SystemExit(f"ncu reported {len(launches)} kernels; the grid launches more")
            got = launches[i]
            i += 1
            row = dict(case, kernel=traffic.kernel, ncu_kernel=got["ncu_kernel"][-40:])
            for kind, fields in KINDS.items():
                row["pred_" + kind] = sum(getattr(traffic, f) for f in fields)
                row["meas_" + kind] = got[kind]
            results.append(row)
    if i != len(launches):
        raise SystemExit(f"ncu reported {len(launches)} kernels; the grid launches {i}")
    return results


def _total(row, side, kinds):
    values = [row[f"{side}_{k}"] for k in kinds]
    return None if None in values else sum(values)


GLOBAL, DRAM = ("load", "tma", "store", "reduce"), ("dram_read", "dram_write")


def _ratio(pred, meas):
    if meas is None:
        return "n/a"
    if meas == 0:
        return "exact" if pred == 0 else "inf"
    return f"{pred / meas:.3f}"


def _mask(row):
    mask = f"{row['documents']} docs" if row["documents"] else "causal" if row["causal"] else "-"
    return mask + (" atomic" if row["atomic_dq"] else "")


def table(results):
    """The comparison, one line per kernel launch, in MB (10^6 bytes); ratio = predicted / measured."""
    lines = [f"{'family':6} {'pass':4} {'d':>3} {'N':>5} {'mask':13} {'heads':>5} {'kernel':26} "
             f"{'global pred':>11} {'ncu':>9} {'ratio':>6}  {'DRAM pred':>9} {'ncu':>9} {'ratio':>6}"]
    for r in results:
        g_pred, g_meas = _total(r, "pred", GLOBAL), _total(r, "meas", GLOBAL)
        d_pred, d_meas = _total(r, "pred", DRAM), _total(r, "meas", DRAM)
        mb = lambda x: "n/a" if x is None else f"{x / 1e6:.2f}"
        lines.append(f"{r['family']:6} {'bwd' if r['backward'] else 'fwd':4} {r['headdim']:>3} {r['seqlen']:>5} "
                     f"{_mask(r):13} {r['nheads']:>2}/{r['nheads_kv']:<2} {r['kernel']:26} "
                     f"{mb(g_pred):>11} {mb(g_meas):>9} {_ratio(g_pred, g_meas):>6}  "
                     f"{mb(d_pred):>9} {mb(d_meas):>9} {_ratio(d_pred, d_meas):>6}")
    return "\n".join(lines)


def summary(results):
    """The worst ratios: global bytes over the whole grid, DRAM bytes for N >= 4096 (the issue's targets)."""
    def worst(rows, kinds):
        ratios = [_total(r, "pred", kinds) / _total(r, "meas", kinds) for r in rows
                  if _total(r, "meas", kinds)]
        return (min(ratios), max(ratios)) if ratios else (None, None)

    g = worst(results, GLOBAL)
    d = worst([r for r in results if r["seqlen"] >= 4096], DRAM)
    return (f"global bytes, predicted / measured, every kernel: {g[0]:.4f} to {g[1]:.4f}\n"
            f"DRAM bytes, predicted / measured, N >= 4096: {d[0]:.3f} to {d[1]:.3f}")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (what, kinds) in zip(axes, (("global bytes (32-byte sectors)", GLOBAL), ("DRAM bytes", DRAM))):
        for family, marker in zip(FAMILIES, "os^"):
            pairs = [(_total(r, "meas", kinds), _total(r, "pred", kinds)) for r in results if r["family"] == family]
            pairs = [(m, p) for m, p in pairs if m and p]
            if pairs:
                ax.scatter(*zip(*pairs), marker=marker, label=family, alpha=0.7)
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], "k:", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="measured by ncu (bytes)", ylabel="predicted by sim.hardware (bytes)",
               title=what)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="N = 1024 and 4096 only")
    parser.add_argument("--out", default=".", help="folder for measure_io.csv and measure_io.png")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    cases = grid(args.families, args.quick)
    with tempfile.TemporaryDirectory() as workdir:
        launches = measure(cases, workdir)
    results = compare(cases, launches)
    print(table(results))
    print(summary(results))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "measure_io.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    plot(results, os.path.join(args.out, "measure_io.png"))


if __name__ == "__main__":
    main()
