"""make conformance, bounded: generated bodies through every path of ours answer as plain vLLM
serving the same model answers (bench/conformance.py). make test-long runs it on a stack of
its own; `make conformance` runs the full count."""

from __future__ import annotations

import pytest

from bench import conformance

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.own_stack]
# At least 300 bodies (the target for a run inside make test-long).
BODIES = 300


def test_every_path_answers_as_plain_vllm(tmp_path):
    args = conformance.parse_args(["--bodies", str(BODIES), "--out", str(tmp_path / "report.json")])
    report = conformance.run(args)
    lines = [f"[{f.path}] {f.endpoint} {f.shrunk or f.body}: {f.diffs[:3]}" for f in report.findings[:10]]
    lines += [f"deviation {d}" for d in report.deviations if not d["ok"]]
    assert report.differences == 0, report.line() + "\n" + "\n".join(lines)
    assert report.bodies >= BODIES and all(report.compared[p] > 0 for p in conformance.PATHS)
