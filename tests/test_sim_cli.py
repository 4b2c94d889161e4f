"""`python -m sim` prints the comparison table and writes the three figures."""

import pytest

from sim.__main__ import main


def test_report_table_and_figures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    main(["--seqlen", "128", "256", "--headdim", "16", "--sram-kib", "8", "--out", str(tmp_path), "--per-tensor"])
    out = capsys.readouterr().out
    for name in ("standard", "flash1", "flash2 (accumulate dQ)", "flash2 (separate dQ)"):
        assert name in out
    assert "NO (" not in out  # every count equals its closed form
    assert "values against the float64 reference" in out
    for figure in ("traffic_vs_seqlen.png", "traffic_vs_sram.png", "tile_heatmap.png"):
        assert (tmp_path / figure).stat().st_size > 10_000


@pytest.mark.parametrize("argv,message", [
    (["--seqlen", "0"], "'0' is not an integer >= 1"),
    (["--headdim", "1.5"], "'1.5' is not an integer >= 1"),
    (["--window", "-5", "0"], "'-5' is not an integer >= -1"),
    (["--sram-kib", "0"], "is not a size of at least"),
    (["--seqlen", "64", "--headdim", "16", "--sram-kib", "0.01", "--no-figures"], "nothing could be counted"),
])
def test_bad_values_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_figures_follow_the_arguments(tmp_path, monkeypatch):
    """Batch, heads and mask reach the counts and the titles; one N still sweeps up to it."""
    pytest.importorskip("matplotlib")
    from sim import plots
    from sim.problem import Problem

    assert plots._setting(Problem(64, 64, 16, 2, 4, 2, -1, 0)) == "batch 2, 4 heads (2 kv), causal"
    assert plots._setting(Problem(64, 64, 16, 1, 1, 1, 5, 3)) == "batch 1, 1 heads, window (5, 3)"
    swept = {}
    real = plots.traffic_vs_seqlen
    monkeypatch.setattr(plots, "traffic_vs_seqlen", lambda sweep, path: (swept.update(sweep), real(sweep, path)))
    main(["--seqlen", "100", "--headdim", "16", "--sram-kib", "8", "--batch", "2", "--nheads", "3", "--causal",
          "--out", str(tmp_path)])
    reports = swept["flash2"]
    assert [r.problem.seqlen_q for r in reports] == [16, 32, 64, 100]  # powers of two from 16, then N
    assert all((r.problem.batch, r.problem.nheads, r.problem.right) == (2, 3, 0) for r in reports)
