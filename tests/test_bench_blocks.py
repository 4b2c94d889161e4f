"""`scripts/bench_blocks.py` turns a grid's time into a block slot's and fits a block's fixed cost, and refuses bad
arguments before any GPU work (no GPU needed)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_blocks  # noqa: E402


def test_a_block_slot_is_the_grids_time_shared_by_its_blocks():
    # one wave on every slot: each slot was busy the whole time, whether one or two blocks share a multiprocessor
    assert bench_blocks.block_slot_us(1.0, 132, 132, 1) == pytest.approx(1000.0)
    assert bench_blocks.block_slot_us(1.0, 264, 132, 2) == pytest.approx(1000.0)
    # ten waves: a tenth each
    assert bench_blocks.block_slot_us(2.5, 1320, 132, 1) == pytest.approx(250.0)


@pytest.mark.parametrize("fixed,per_tile", [(6.8, 1.18), (0.0, 2.0), (12.5, 0.25)])
def test_the_fit_recovers_a_blocks_fixed_cost_and_a_tiles(fixed, per_tile):
    points = [(n, fixed + per_tile * n) for n in (1, 2, 4, 8)]
    assert bench_blocks.fixed_and_per_tile(points) == pytest.approx((fixed, per_tile))


@pytest.mark.parametrize("argv,message", [
    (["--counts", "0", "4"], "key tiles a block from 1 to 64"),
    (["--counts", "4", "128"], "key tiles a block from 1 to 64"),
    (["--counts", "1", "16", "--fit-tiles", "8"], "at least two counts"),
    (["WgmmaTiles(128, 80, 3)"], "block_m = 64 x warpgroups"),
])
def test_bad_arguments_end_the_run_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_blocks.main(argv)
    assert message in capsys.readouterr().err
