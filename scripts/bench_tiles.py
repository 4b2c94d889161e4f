"""Time one of bench_mods' variants on candidate tiles against the tiles its plan picks (GPU).

The ladder of tilings for one call: a variant as `bench_mods` names it (plain, softcap 30, ALiBi, 8 documents (block
mask), ...) at one head dim, dtype and sequence length (16 heads, batch x seqlen = 16384), run on its plan's tiles and
on each candidate's (`numbaflash.plan(..., tiles=...)`: the same call's plan on other blocks). Each is timed right
after the variant's base (the plain kernel, or the built-in causal), in rounds that start at successive entries, and
reported as the median and range of its time over its base's. Forward calls take no LSE, as `bench_mods` times them;
each candidate's results are first compared with the plan's.

    python scripts/bench_tiles.py --variant "softcap 30" --headdim 128 \\
        "WgmmaTiles(192, 80, 3, producer=True, tma=True)" \\
        "WgmmaTiles(128, 96, 2, producer=True, tma=True, scores_ahead=True)"
    python scripts/bench_tiles.py --variant "8 documents (block mask)" --headdim 64 \\
        "WgmmaTiles(64, 128, 1, producer=True, tma=True, blocks_per_sm=2, row_sums=True)"
    python scripts/bench_tiles.py --variant ALiBi --headdim 64 --backward "WgmmaTiles(128, 64, 2, producer=True, tma=True)"

A candidate is written as its `numbaflash.tiling` constructor (Tiles, MmaTiles or WgmmaTiles) with literal arguments;
`numbaflash.tiling` says what each field does and which tiles each plan takes and why.
"""

import argparse
import ast
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import bench_mods  # noqa: E402

TILE_CLASSES = ("Tiles", "MmaTiles", "WgmmaTiles")


def parse_tiles(spec):
    """The tiles ``spec`` writes, ``WgmmaTiles(192, 80, 3, producer=True, tma=True)`` say: one of `TILE_CLASSES`
    called with literal arguments (nothing is evaluated). ValueError naming ``spec`` otherwise."""
    from numbaflash import tiling

    try:
        call = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"tiles {spec!r} is not Python: {error.msg}") from None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in TILE_CLASSES):
        raise ValueError(f"tiles {spec!r}: write one of {', '.join(TILE_CLASSES)}(...), as numbaflash.tiling has them")
    try:
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:
        raise ValueError(f"tiles {spec!r}: its arguments must be literals (numbers, True, False)") from None
    try:
        return getattr(tiling, call.func.id)(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"tiles {spec!r}: {error}") from None


def round_orders(names, rounds):
    """The order of ``names`` in each of ``rounds`` rounds: round r starts at entry r (mod len), so that no entry is
    always timed first or last."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def over_base(calls, base, rounds, time_ms):
    """{name: [its time over ``base``'s, a round each]} for every call of ``calls`` (name -> function) but ``base``,
    each timed by ``time_ms`` right after ``base``."""
    ratios = {name: [] for name in calls if name != base}
    for order in round_orders(list(ratios), rounds):
        for name in order:
            base_ms = time_ms(calls[base])
            ratios[name].append(time_ms(calls[name]) / base_ms)
    return ratios


def prepare(args, candidates):
    """(calls, base name, each candidate's largest difference from the plan's results): the variant's base, its
    plan and each candidate, on one set of operands."""
    import torch

    import numbaflash

    batch, dtype = max(1, bench.TOKENS // args.seqlen), getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, args.seqlen, bench.NHEADS, args.headdim, device="cuda", dtype=dtype,
                                 generator=gen) for _ in range(4))
    listed = [(name, options, None) for name, options in bench_mods.variants(torch, bench.NHEADS).items()]
    listed += bench_mods.block_masks(torch, args.seqlen)
    options_of = {name: options for name, options, _ in listed}
    base = bench_mods.bases(listed)[args.variant]

    def run(name, plan=None):
        options = options_of[name]
        if not args.backward:
            return lambda: numbaflash.attention(q, k, v, plan=plan, **options)
        out, lse = numbaflash.attention(q, k, v, return_lse=True, **options)
        return lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, plan=plan, **options)

    calls = {base: run(base), "plan": run(args.variant)}
    planned, differences = calls["plan"](), {}
    for spec, tiles in candidates:
        plan = numbaflash.plan(q, k, v, backward=args.backward, tiles=tiles, **options_of[args.variant])
        calls[spec] = run(args.variant, plan)
        got = calls[spec]()
        pairs = zip(got, planned) if args.backward else [(got, planned)]  # dq, dk, dv; or out
        differences[spec] = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    torch.cuda.synchronize()
    return calls, base, differences


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tiles", nargs="*", help="candidates, e.g. 'WgmmaTiles(192, 80, 3, producer=True, tma=True)'")
    parser.add_argument("--variant", default="plain", choices=bench_mods.NAMES)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--backward", action="store_true", help="time attention_backward instead of the forward")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timing", choices=["call", "stream"], default="stream", help="as bench.py's --timing")
    args = parser.parse_args(argv)
    try:
        candidates = [(spec, parse_tiles(spec)) for spec in args.tiles]
    except ValueError as error:
        parser.error(str(error))
    bench.TIMING = args.timing
    calls, base, differences = prepare(args, candidates)
    ratios = over_base(calls, base, args.rounds, bench.time_ms)
    print(f"{args.variant}, {'backward' if args.backward else 'forward'}, d = {args.headdim}, N = {args.seqlen}, "
          f"{args.dtype}: time over {base}'s, median (range) of {args.rounds} rounds")
    for name, each in ratios.items():
        differs = f"  max |results - plan's| {differences[name]:.2e}" if name in differences else ""
        print(f"  {name:70s} {statistics.median(each):.3f}x ({min(each):.3f}-{max(each):.3f}){differs}")


if __name__ == "__main__":
    main()
