"""`python -m bench.program`: the program-speed figures cover every stack and add up."""

from __future__ import annotations

from bench import program
from tools import stackfile


def test_measure_reports_every_stack_with_ratios(tmp_path):
    result = program.measure(repeat=1)
    assert set(result["stacks"]) == set(stackfile.stacks())
    for s in result["stacks"].values():
        assert s["resources"] > 50 and s["manifests"] >= 10
        assert s["ratio_vs_baseline"] == s["median_s"] / result["baseline_median_s"]
        assert s["cold_render_s"] > 0
    text = program.table(result)
    assert all(name in text for name in result["stacks"])
