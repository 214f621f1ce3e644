"""The benchmark plots: a PNG next to the JSON, drawn from the per-request samples."""

from __future__ import annotations

import json
import struct

from bench import plots
from bench.stats import RequestResult, percentile, samples, summarize


def _report() -> dict:
    def results(base: float) -> list[RequestResult]:
        return [
            RequestResult(ok=True, ttft_s=base * (1 + i / 10), latency_s=base * 10 + i / 10, output_tokens=20)
            for i in range(30)
        ] + [RequestResult(ok=False, error="HTTP 503")]

    targets = {"disaggregated": 0.2, "aggregated": 0.1, "vllm": 0.03}
    return {
        "workload": {"requests_total": 186},
        "machine": {"cpus": 2},
        "samples": {t: {"1": samples(results(b)), "4": samples(results(2 * b))} for t, b in targets.items()},
    }


def test_serving_png_is_written_next_to_the_json(tmp_path):
    report = _report()
    (tmp_path / "serving.json").write_text(json.dumps(report))
    assert plots.main([str(tmp_path / "serving.json")]) == 0
    png = (tmp_path / "serving.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 600 and height > 400
    assert len(png) > 20_000  # axes, curves and labels, not an empty canvas


def test_samples_are_the_figures_the_summary_reports():
    res = [RequestResult(ok=True, ttft_s=0.1 * i, latency_s=1 + 0.2 * i, output_tokens=11) for i in range(1, 40)]
    res.append(RequestResult(ok=False, error="timeout"))
    s, summary = samples(res), summarize(res, 10.0)
    assert len(s["ttft_s"]) == summary["completed"] == 39
    assert round(percentile(s["tpot_s"], 50) * 1000, 6) == round(summary["tpot_p50_ms"], 6)
