"""`python -m bench.program`: the program-speed figures cover every stack and add up.

The clock is replaced (`_timed`, `_cold`), so the ratios are checked against figures worked
out by hand here, not against the code's own arithmetic; the renders themselves still run.
"""

from __future__ import annotations

import math

from bench import program
from tools import stackfile


def test_measure_reports_every_stack_with_ratios(monkeypatch):
    calls: list[str] = []

    def timed(fn, repeat):
        fn()  # the program still runs once under mocks
        calls.append("baseline" if not calls else "stack")
        # medians: 10 ms for the baseline program, 50 ms for each stack
        return [0.010, 0.030, 0.009] if calls[-1] == "baseline" else [0.050, 0.040, 0.060]

    def cold(cmd):
        return 2.0 if "-c" in cmd else 3.0  # the SDK import alone; a whole `tools.render` run

    monkeypatch.setattr(program, "_timed", timed)
    monkeypatch.setattr(program, "_cold", cold)
    result = program.measure(repeat=3)
    assert set(result["stacks"]) == set(stackfile.stacks())
    assert math.isclose(result["baseline_median_s"], 0.010)
    for s in result["stacks"].values():
        assert s["resources"] > 50 and s["manifests"] >= 10
        assert math.isclose(s["median_s"], 0.050) and math.isclose(s["min_s"], 0.040)
        assert math.isclose(s["ratio_vs_baseline"], 5.0)  # 50 ms / 10 ms
        assert math.isclose(s["cold_ratio_vs_import"], 1.5)  # 3.0 s / 2.0 s
    text = program.table(result)
    assert all(name in text for name in result["stacks"])
    assert "5.0" in text and "1.50" in text
