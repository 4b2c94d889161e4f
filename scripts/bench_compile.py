"""What a new process waits for before its first call with the user's functions: compiling, or the disk cache (GPU).

Each variant runs twice in a fresh process of its own against an empty `disk_cache` directory: the first call's
forward and backward compile every kernel they launch and store it, the second process loads them. Printed per
variant: seconds of the first forward and of the first backward in each process, and the entries stored.

    python scripts/bench_compile.py
    python scripts/bench_compile.py --headdim 128 --seqlen 4096

Variants: a score_mod (a relative-position bias read from a ``mod_args`` table), a dense mask_mod (documents from a
``mod_args`` array of ids) and the same documents as a block mask; all causal, float16.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

VARIANTS = ("score_mod", "mask_mod", "block mask")

_CALL = textwrap.dedent("""
    import sys, time, cupy, numbaflash
    variant, seqlen, headdim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    DOCUMENTS = 8

    def relative_bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, min(q_idx - kv_idx, table.shape[1] - 1)]

    def relative_bias_grad(score, b, h, q_idx, kv_idx, table):
        return 1.0

    def same_document(b, h, q_idx, kv_idx, docs):
        return docs[q_idx] == docs[kv_idx]

    q, k, v, dout = (cupy.random.standard_normal((1, seqlen, 16, headdim), dtype=cupy.float32).astype(cupy.float16)
                     for _ in range(4))
    docs = cupy.repeat(cupy.arange(DOCUMENTS, dtype=cupy.int32), seqlen // DOCUMENTS)
    if variant == "score_mod":
        options = dict(score_mod=relative_bias, score_mod_grad=relative_bias_grad,
                       mod_args=(cupy.linspace(0, -4, 16 * 256, dtype=cupy.float32).reshape(16, 256),))
    elif variant == "mask_mod":
        options = dict(mask_mod=same_document, mod_args=(docs,))
    else:
        bm = numbaflash.block_mask(same_document, None, None, seqlen, seqlen, mod_args=(cupy.asnumpy(docs),))
        options = dict(block_mask=bm, mod_args=(docs,))
    times = []
    for call in (lambda: numbaflash.attention(q, k, v, causal=True, return_lse=True, **options),
                 lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True, **options)):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        result = call()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            out, lse = result
    print(*times)
""")


def first_calls(variant, seqlen, headdim, cache):
    """Seconds of a fresh process's first forward and first backward with ``variant``, the cache at ``cache``."""
    env = {**os.environ, "NUMBAFLASH_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", _CALL, variant, str(seqlen), str(headdim)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stderr}")
    return tuple(map(float, done.stdout.split()[-2:]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--headdim", type=int, default=64)
    args = parser.parse_args()
    if args.seqlen % 8:
        parser.error("--seqlen must be a multiple of 8 (the documents' length)")
    print(f"first calls of a new process, causal, float16, 16 heads, N = {args.seqlen}, headdim {args.headdim}: "
          "forward + backward seconds")
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            cold = first_calls(variant, args.seqlen, args.headdim, cache)
            entries = sum(f.endswith(".cubin") for _, _, names in os.walk(cache) for f in names)
            warm = first_calls(variant, args.seqlen, args.headdim, cache)
        print(f"{variant:>10}: compiling {cold[0]:6.2f} + {cold[1]:6.2f} s, from the cache {warm[0]:5.2f} + "
              f"{warm[1]:5.2f} s ({entries} kernels stored)")


if __name__ == "__main__":
    main()
