"""Run every kernel over a grid of small shapes, masks and dtypes; meant to run under compute-sanitizer.

    python scripts/sanitize.py --check     # runs memcheck, racecheck and synccheck over this script
                                           # and reports the error count of each

Without --check it just runs the grid once (what each sanitizer tool executes).
"""

import argparse
import os
import re
import subprocess
import sys

# memcheck also counts CUDA API calls that return an error. The CUDA Python bindings look up driver entry
# points with cuGetProcAddress_v2, which answers CUDA_ERROR_INVALID_VALUE for those a driver lacks: on
# the H200 every one of memcheck's 34 reports was that lookup, none a kernel's memory access. So memcheck
# runs without API-error reports and counts the kernels' memory errors only.
TOOLS = {"memcheck": ["--report-api-errors", "no"], "racecheck": [], "synccheck": []}


def grid():
    import cupy
    import numpy as np

    import numbaflash
    from numbaflash import tiling

    rng = np.random.default_rng(0)
    hopper = cupy.cuda.Device().compute_capability == "90"
    # Odd lengths, GQA, a partial last tile, every mask; few head-dim buckets keep compiles few (each
    # sanitizer tool reruns the process). float16 runs the tensor-core kernels both ways (on Hopper the
    # wgmma forward at head dims 40 and 64, the mma.sync forward at 24), float32 the CUDA-core kernels
    # both ways: every kernel family.
    shapes = [(2, 33, 70, 4, 2, 40), (1, 70, 33, 2, 1, 64), (1, 45, 45, 2, 2, 24)]
    masks = [dict(), dict(causal=True), dict(window_size=(5, 3))]
    for dtype in ("float16", "float32"):
        atomic = dtype == "float16" and hopper  # deterministic=False's atomic dQ runs on Hopper's 16-bit kernels
        for b, nq, nk, h, hk, d in shapes:
            for mask in masks:
                q, k, v, dout = operands(rng, dtype, (b, nq, h, d), (b, nk, hk, d))
                both_ways(q, k, v, dout, atomic, **mask)
                if dtype == "float16" and d == 64 and hopper:
                    # The two ping-pong consumers that the user's per-score functions run at headdim 64, softcap
                    # alone's tiles, and headdim 256's v5.
                    plan = tiling.make_plan(b, h, hk, nq, nk, d, dtype, tiles=tiling.WGMMA_USER_FUNCTION_TILES[64])
                    numbaflash.attention(q, k, v, plan=plan, **mask)
                    # softcap alone: part of ex2 on the FMA pipe; no LSE asked for, so at 64 the row sums' ones in
                    # shared memory too (`wgmma.row_sums`), as for ALiBi below
                    numbaflash.attention(q, k, v, softcap=5.0, **mask)
                    # ALiBi alone: v5's column operands in shared memory (`wgmma.alibi_columns`), its key tiles
                    # from beside each block's diagonal (`key_tiles.tile_order`)
                    numbaflash.attention(q, k, v, alibi_slopes=cupy.full((h,), 0.5, np.float32), **mask)
                    numbaflash.attention(*(cupy.concatenate([x] * 4, axis=-1) for x in (q, k, v)), **mask)
                    # softcap alone at headdim 128: three consumers over four 80-key tiles, the last one partial;
                    # and each key tile's S issued a tile ahead (`WgmmaTiles.scores_ahead`, with ``tiles=``) over
                    # four 96-key tiles, the last's second S from a stage no copy writes any more
                    q2, k2, v2, _ = operands(rng, dtype, (b, nq, h, 128), (b, 300, hk, 128))
                    numbaflash.attention(q2, k2, v2, softcap=5.0, **mask)
                    ahead = numbaflash.plan(q2, k2, v2, softcap=5.0, tiles=tiling.WgmmaTiles(
                        128, 96, 2, producer=True, tma=True, scores_ahead=True), **mask)
                    numbaflash.attention(q2, k2, v2, softcap=5.0, plan=ahead, **mask)
        # Every modification at once, the mask through a block mask (the kernels' tile tables) on one shape:
        # the user's functions read mod_args only at visible, in-bounds indices.
        b, nq, nk, h, hk, d = shapes[0]
        q, k, v, dout = operands(rng, dtype, (b, nq, h, d), (b, nk, hk, d))
        doc_q, doc_k = (cupy.asarray(np.sort(rng.integers(0, 3, (b, n))).astype(np.int32)) for n in (nq, nk))
        temperature = cupy.asarray(rng.uniform(0.5, 2, h).astype(np.float32))
        modifications = dict(softcap=5.0, alibi_slopes=cupy.full((h,), 0.25, np.float32), score_mod=tempered,
                             score_mod_grad=tempered_grad, mod_args=(doc_q, doc_k, temperature),
                             block_mask=numbaflash.block_mask(same_document, b, None, nq, nk,
                                                              mod_args=(doc_q, doc_k, temperature)))
        # both passes' tile tables, and on Hopper the atomic dQ's key pass with its table
        both_ways(q, k, v, dout, atomic, **modifications)
        # The built-in modifications and a block mask without the user's per-score functions: at headdim 64, one
        # consumer and two blocks per multiprocessor both ways (`tiling.WGMMA_BLOCK_SPARSE_TILES`; the forward
        # above runs two consumers), the dK/dV pass reading the block mask's transposed bits.
        built_in = dict(softcap=5.0, alibi_slopes=modifications["alibi_slopes"], mod_args=modifications["mod_args"],
                        block_mask=modifications["block_mask"], causal=True)
        both_ways(q, k, v, dout, False, **built_in)
        # A score_mod without a mask_mod under a window that hides every key from the first 35 of 70 rows: the
        # tensor-core dK/dV passes call it on every score of a crossed tile at a visible pair's indices
        # (`masks.visible_pair`), and it reads its mod_args there.
        b, nq, nk, h, hk, d = shapes[1]
        q, k, v, dout = operands(rng, dtype, (b, nq, h, d), (b, nk, hk, d))
        both_ways(q, k, v, dout, atomic, score_mod=tempered, score_mod_grad=tempered_grad,
                  mod_args=modifications["mod_args"], window_size=(3, 2))
        # Packed sequences (varlen), causal, head dims 40 and 64 (on Hopper v5 both ways, whose producers zero
        # the rows past a sequence in its last tiles): one with no queries, one with no keys, one shorter than
        # a tile; a block reads and writes its own sequence's rows only.
        seqlens_q, seqlens_k = [70, 0, 5, 33, 9], [40, 7, 0, 70, 3]
        cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (seqlens_q, seqlens_k))
        for d in (40, 64):
            q, k, v, dout = operands(rng, dtype, (sum(seqlens_q), 4, d), (sum(seqlens_k), 2, d))
            lengths = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
            out, lse = numbaflash.attention_varlen(q, k, v, *lengths, causal=True, return_lse=True)
            numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, *lengths, causal=True)
    cupy.cuda.Device().synchronize()


def operands(rng, dtype, q_shape, kv_shape):
    """q, k, v and dout of standard normal values on the GPU: q and dout of ``q_shape``, k and v of ``kv_shape``."""
    import cupy

    return (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in (q_shape, kv_shape, kv_shape, q_shape))


def both_ways(q, k, v, dout, atomic, **options):
    """The forward, the deterministic backward from its LSE and, with ``atomic``, deterministic=False's atomic dQ."""
    import numbaflash

    out, lse = numbaflash.attention(q, k, v, return_lse=True, **options)
    numbaflash.attention_backward(dout, q, k, v, out, lse, **options)
    if atomic:
        numbaflash.attention_backward(dout, q, k, v, out, lse, deterministic=False, plan=atomic_plan(q, k), **options)


def atomic_plan(q, k):
    """deterministic=False's atomic dQ, which runs with v5's tiles asked for (no plan picks it by itself)."""
    from numbaflash import tiling

    (b, nq, h, d), (_, nk, hk, _) = q.shape, k.shape
    return tiling.make_plan(b, h, hk, nq, nk, d, str(q.dtype), backward=True, deterministic=False,
                            tiles=tiling.WGMMA_BACKWARD_TILES[64])


def same_document(b, h, q_idx, kv_idx, doc_q, doc_k, temperature):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def tempered(score, b, h, q_idx, kv_idx, doc_q, doc_k, temperature):
    return score * temperature[h]


def tempered_grad(score, b, h, q_idx, kv_idx, doc_q, doc_k, temperature):
    return temperature[h]


def check(log_dir):
    """Run each tool over `grid`; the tool's whole report goes to ``log_dir``, its findings to stdout."""
    failures = 0
    for tool, options in TOOLS.items():
        run = subprocess.run(["compute-sanitizer", "--tool", tool, *options, sys.executable, __file__],
                             capture_output=True, text=True)
        report = run.stdout + run.stderr
        if log_dir:
            with open(os.path.join(log_dir, f"sanitize_{tool}.log"), "w") as f:
                f.write(report)
        # memcheck and synccheck end with "ERROR SUMMARY: n errors", racecheck with
        # "RACECHECK SUMMARY: n hazards displayed (e errors, w warnings)".
        counts = re.findall(r"ERROR SUMMARY: (\d+) errors?$|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error",
                            report, re.MULTILINE)
        errors = int(next(x for x in counts[0] if x)) if counts else -1
        print(f"compute-sanitizer --tool {tool}: {'no summary' if errors < 0 else f'{errors} errors'} "
              f"(exit {run.returncode})")
        if errors != 0 or run.returncode != 0:
            failures += 1
            findings = [line for line in report.splitlines() if line.startswith("=========")]
            print("\n".join(findings[:60]))
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--log-dir", default=os.environ.get("OUT"), help="where each tool's whole report goes")
    args = parser.parse_args()
    if args.check:
        sys.exit(1 if check(args.log_dir) else 0)
    grid()
