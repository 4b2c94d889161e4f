"""`scripts/bench_tiles.py` reads candidate tiles without evaluating anything, and times each candidate right after
its base in rounds that rotate (no GPU needed)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_tiles  # noqa: E402
from numbaflash import tiling  # noqa: E402


def test_candidates_are_tiling_constructors_with_literal_arguments():
    assert bench_tiles.parse_tiles("WgmmaTiles(192, 80, 3, producer=True, tma=True)") == tiling.WgmmaTiles(
        192, 80, 3, producer=True, tma=True)
    assert bench_tiles.parse_tiles(" MmaTiles(128, 64, 4, 2) ") == tiling.MmaTiles(128, 64, 4, 2)
    for spec, message in (("WgmmaTiles(192, 80", "is not Python"),
                          ("__import__('os').getcwd()", "write one of Tiles, MmaTiles, WgmmaTiles"),
                          ("tiling.WgmmaTiles(64, 16, 1)", "write one of"),
                          ("WgmmaTiles(64, 16, 1, producer=print)", "arguments must be literals"),
                          ("WgmmaTiles(128, 80, 3)", "block_m = 64 x warpgroups"),
                          ("WgmmaTiles(64, 16, 1, sideways=True)", "unexpected keyword")):
        with pytest.raises(ValueError, match=message) as refused:
            bench_tiles.parse_tiles(spec)
        assert repr(spec) in str(refused.value)


def test_bad_candidates_end_the_run_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit):
        bench_tiles.main(["--variant", "softcap 30", "WgmmaTiles(128, 80, 3)"])
    assert "block_m = 64 x warpgroups" in capsys.readouterr().err


def test_each_entry_is_timed_once_a_round_right_after_its_base_and_rounds_rotate():
    orders = bench_tiles.round_orders(["plan", "a", "b"], 4)
    assert orders == [["plan", "a", "b"], ["a", "b", "plan"], ["b", "plan", "a"], ["plan", "a", "b"]]
    timed, clock = [], iter(range(1, 100))
    calls = {name: name for name in ("plain", "plan", "a", "b")}

    def time_ms(call):
        timed.append(call)
        return float(next(clock))

    ratios = bench_tiles.over_base(calls, "plain", 3, time_ms)
    assert timed[::2] == ["plain"] * 9 and timed[1::2] == sum(bench_tiles.round_orders(["plan", "a", "b"], 3), [])
    assert ratios["plan"][0] == 2.0 and ratios["a"][0] == 4.0 / 3.0 and all(len(r) == 3 for r in ratios.values())
