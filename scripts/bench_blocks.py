"""What a forward block costs beyond its key tiles (GPU): its plan's blocks, or candidates', over 1 to 64 tiles a block.

Short sequences, packed documents and block masks give each query block few key tiles, so a block's fixed cost (its
launch, the first copies' latency, the pipeline's fill and drain, the stores of O) decides their speed. Here each
blocking runs non-causal forwards of 16384 query rows (16 heads) against ``tiles x block_n`` keys, so that every
block visits the same number of key tiles. A grid's time becomes microseconds per block slot (the time x the
multiprocessors x blocks a multiprocessor / the grid's blocks), and a line fitted over the counts up to
``--fit-tiles`` gives a block's cost beyond its tiles (the intercept) and a tile's (the slope).

    python scripts/bench_blocks.py --headdim 64
    python scripts/bench_blocks.py --headdim 64 "WgmmaTiles(64, 128, 1, producer=True, tma=True, blocks_per_sm=2)"

A candidate is written as for `bench_tiles` (a `numbaflash.tiling` constructor with literal arguments).
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import bench_tiles  # noqa: E402

ROWS = 16384  # query rows a call: batch 1, so the grid's blocks are ROWS / block_m a head


def block_slot_us(ms, blocks, multiprocessors, blocks_per_sm):
    """Microseconds of one block slot: a grid of ``blocks`` that took ``ms`` on ``multiprocessors`` running
    ``blocks_per_sm`` at a time keeps each of its slots busy that long (waves' tails included)."""
    return ms * 1e3 * multiprocessors * blocks_per_sm / blocks


def fixed_and_per_tile(points):
    """``(fixed, per_tile)``: the least-squares line through ``points``, (key tiles a block, microseconds a block slot)
    pairs: a block's cost beyond its tiles and one tile's."""
    tiles, us = np.asarray(points, dtype=np.float64).T
    per_tile, fixed = np.polyfit(tiles, us, 1)
    return float(fixed), float(per_tile)


def ladder(headdim, dtype, tiles, counts):
    """[(key tiles a block, milliseconds, blocks in the grid)] of ``tiles`` (None: the plan's), and the plan's tiles."""
    import torch

    import numbaflash

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, ROWS, bench.NHEADS, headdim, device="cuda", dtype=getattr(torch, dtype), generator=gen)
    planned = numbaflash.plan(q, q, q, tiles=tiles).tiles
    keys = torch.randn(2, 1, max(counts) * planned.block_n, bench.NHEADS, headdim, device="cuda", dtype=q.dtype,
                       generator=gen)
    rows = []
    for count in counts:
        k, v = (keys[i, :, :count * planned.block_n] for i in range(2))
        plan = numbaflash.plan(q, k, v, tiles=planned)
        rows.append((count, bench.time_ms(lambda: numbaflash.attention(q, k, v, plan=plan)),
                     math.prod(plan.launches[0].grid)))
    return rows, planned


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tiles", nargs="*", help="candidates, e.g. 'WgmmaTiles(64, 128, 1, producer=True, tma=True)'")
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="key tiles a block, 1 to 64")
    parser.add_argument("--fit-tiles", type=int, default=8, help="fit the line over the counts up to this")
    parser.add_argument("--timing", choices=["call", "stream"], default="stream", help="as bench.py's --timing")
    args = parser.parse_args(argv)
    args.counts = sorted(set(args.counts))
    if min(args.counts) < 1 or max(args.counts) > 64:
        parser.error("--counts: key tiles a block from 1 to 64")
    if sum(c <= args.fit_tiles for c in args.counts) < 2:
        parser.error("--fit-tiles: the line needs at least two counts at or below it")
    try:
        candidates = [None] + [bench_tiles.parse_tiles(spec) for spec in args.tiles]
    except ValueError as error:
        parser.error(str(error))
    import torch

    bench.TIMING = args.timing
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"forward, d = {args.headdim}, {args.dtype}, {ROWS} query rows, {bench.NHEADS} heads, "
          f"{torch.cuda.get_device_name()}: microseconds per block slot")
    for tiles in candidates:
        rows, planned = ladder(args.headdim, args.dtype, tiles, args.counts)
        name = "plan" if tiles is None else "candidate"
        print(f"  {name}: {planned}")
        points = []
        for count, ms, blocks in rows:
            us = block_slot_us(ms, blocks, multiprocessors, planned.blocks_per_sm)
            points.append((count, us))
            print(f"    {count:3d} tiles a block, {blocks} blocks: {ms * 1e3:9.1f} us, {us:7.2f} us a block slot")
        fixed, per_tile = fixed_and_per_tile([p for p in points if p[0] <= args.fit_tiles])
        print(f"    fit over 1-{args.fit_tiles} tiles: {fixed:.2f} us a block beyond its tiles, {per_tile:.2f} a tile")


if __name__ == "__main__":
    main()
