"""make bench-data-plane's arithmetic, on a small synthetic run (no Ray started): medians over
rounds, each plane's ratio to the ray-proxy run of the same round, the runs left out, the
order of the stacks. REP is also the page's test input (tests/bench/test_report.py)."""

from __future__ import annotations

import json

import pytest

from bench import cpu, data_plane
from bench.data_plane import BASELINE, Spread, paired, summary

REQUESTS, TOKENS = 10, 500


def _cpu(ms: dict[str, float]) -> dict:
    """bench.cpu's figures for hops that spent `ms` CPU-ms per request each."""
    return cpu.figures(cpu.Tally(cpu_s={k: v * REQUESTS / 1000 for k, v in ms.items()}), REQUESTS, TOKENS)


def _run(rnd: int, plane: str, ms: dict[str, float], ttft: float) -> dict:
    app = {
        "1": {"ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 5.0, "output_tok_s": 100.0, "cpu": _cpu(ms)},
        "16": {"ttft_p50_ms": 4 * ttft, "tpot_p50_ms": 9.0, "output_tok_s": 400.0, "cpu": _cpu(ms)},
        "all": {"cpu": _cpu(ms)},
    }
    return {"round": rnd, "data_plane": plane, "apps": {"disaggregated": app, "aggregated": app}}


ENGINE = {"engine_decode": 100.0}
RUNS = [
    _run(0, "ray-proxy", {"serve_proxy": 20.0, "ingress": 40.0, **ENGINE}, ttft=80.0),
    _run(0, "grpc", {"serve_proxy": 20.0, "ingress": 30.0, **ENGINE}, ttft=72.0),
    _run(0, "haproxy", {"serve_proxy": 1.0, "haproxy": 1.0, "ingress": 12.0, **ENGINE}, ttft=60.0),
    _run(1, "grpc", {"serve_proxy": 22.0, "ingress": 33.0, **ENGINE}, ttft=70.0),
    _run(1, "haproxy", {"serve_proxy": 1.0, "haproxy": 1.4, "ingress": 13.0, **ENGINE}, ttft=55.0),
    _run(1, "ray-proxy", {"serve_proxy": 22.0, "ingress": 44.0, **ENGINE}, ttft=100.0),
]
REP = {
    "date": "2026-12-02 01:00 UTC",
    "data_planes": ["ray-proxy", "grpc", "haproxy"],
    "workload": {"levels": {"1": 24, "16": 64}, "rounds": 2},
    "machine": {"cpus": 2, "load_average_at_end": [3.0, 3.0, 3.0]},
    "runs": RUNS,
    "wall_s": 1800.0,
}


def test_medians_over_rounds_and_ratios_to_the_ray_proxy_run_of_the_same_round():
    value, ratio = paired(RUNS, "haproxy", data_plane.cpu_getter("disaggregated", "ingress"))
    assert (value.median, value.lo, value.hi) == pytest.approx((12.5, 12.0, 13.0))
    # Round 0: 12 / 40; round 1: 13 / 44 (not 13 / 40: each round beside its own baseline).
    assert ratio.median == pytest.approx((12 / 40 + 13 / 44) / 2)
    assert (ratio.lo, ratio.hi) == pytest.approx((13 / 44, 12 / 40))
    base, base_ratio = paired(RUNS, BASELINE, data_plane.cpu_getter("disaggregated", "ingress"))
    assert base.median == pytest.approx(42.0) and base_ratio.median == pytest.approx(1.0)


def test_the_front_door_sums_proxy_actor_haproxy_and_ingress():
    value, ratio = paired(RUNS, "haproxy", data_plane.cpu_getter("aggregated", "front_door"))
    assert (value.lo, value.hi) == pytest.approx((1 + 1 + 12, 1 + 1.4 + 13))
    assert ratio.median == pytest.approx(((14 / 60) + (15.4 / 66)) / 2)


def test_a_failed_run_is_left_out_and_a_round_without_its_baseline_has_no_ratio():
    runs = [*RUNS[:2], {"round": 0, "data_plane": "haproxy", "error": "RuntimeError: did not become ready"}]
    runs += [r for r in RUNS[3:] if r["data_plane"] != "ray-proxy"]
    value, ratio = paired(runs, "haproxy", data_plane.latency_getter("aggregated", "1", "ttft_p50_ms"))
    assert (value.median, value.lo, value.hi) == (55.0, 55.0, 55.0)
    assert ratio.median is None  # round 1's ray-proxy run is missing
    value, ratio = paired(runs, "grpc", data_plane.latency_getter("aggregated", "1", "ttft_p50_ms"))
    assert value.median == pytest.approx(71.0) and ratio.median == pytest.approx(72 / 80)


def test_spread_text():
    assert Spread.of([]).text() == "-"
    assert Spread.of([2.0]).text(2) == "2.00"
    assert Spread.of([3.0, 1.0, 2.0]).text() == "2.0 (1.0–3.0)"


def test_the_stacks_rotate_from_round_to_round():
    assert data_plane.plan(("a", "b", "c"), 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]


def test_summary_tables_row_by_hop_and_by_level():
    summ = summary(REP)
    rows = data_plane.cpu_rows(summ, "disaggregated")
    assert rows[0] == [
        "disaggregated: CPU-ms per request",
        "ray-proxy",
        "grpc",
        "÷ ray-proxy",
        "haproxy",
        "÷ ray-proxy",
    ]
    by_label = {r[0]: r[1:] for r in rows[1:]}
    assert by_label[cpu.CLASSES["haproxy"]] == ["-", "-", "-", "1.2 (1.0–1.4)", "-"]
    assert by_label[cpu.CLASSES["ingress"]][:3] == ["42.0 (40.0–44.0)", "31.5 (30.0–33.0)", "0.75"]
    assert "engine total" in by_label and "front door (proxy actor, HAProxy, ingress)" in by_label
    lat = {r[0]: r[1:] for r in data_plane.latency_rows(summ)[1:]}
    # TTFT p50 at c1: ray-proxy 80 / 100, haproxy 60 / 55 -> ratios 0.75 and 0.55.
    assert lat["aggregated c1 TTFT p50 ms"][-1] == "0.65 (0.55–0.75)"
    assert lat["disaggregated c16 output tok/s"][0] == "400.0"
    text = data_plane.format_text(REP)
    assert "HAProxy (Serve's HTTP front in haproxy mode)" in text


def test_the_command_runs_every_plane_each_round_and_keeps_going_past_a_failed_stack(monkeypatch, tmp_path, capsys):
    from local import tiny_model

    by_key = {(r["round"], r["data_plane"]): r for r in RUNS}
    started: list[tuple[int, str]] = []

    def one_stack(plane, rnd, args, model_dir, log, say):
        started.append((rnd, plane))
        if (rnd, plane) == (1, "grpc"):
            raise RuntimeError("`python -m local` did not become ready")
        return {"apps": by_key[(rnd, plane)]["apps"], "errors_sample": {}}

    monkeypatch.setattr(data_plane, "one_stack", one_stack)
    monkeypatch.setattr(tiny_model, "ensure_tiny_model", lambda: tmp_path)
    out = tmp_path / "data-plane.json"
    assert data_plane.main(["--out", str(out)]) == 0
    assert started == data_plane.plan(data_plane.DATA_PLANES, 2)
    rep = json.loads(out.read_text())
    assert [("error" in r) for r in rep["runs"]] == [False, False, False, True, False, False]
    assert rep["ray_env"]["haproxy"]["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    printed = capsys.readouterr().out
    assert "Failed runs (left out): grpc round 2" in printed
    assert "HAProxy (Serve's HTTP front in haproxy mode)" in printed


# --- each plane's stack, dry (tests/bench/dry_run.py: built as Serve builds it, no Ray) -------
@pytest.mark.parametrize("plane", data_plane.DATA_PLANES)
def test_each_planes_stack_builds_with_its_rays_switches(plane):
    from serving.spec.base import DataPlane
    from tests.bench import dry_run

    stack = dry_run.plan(data_plane.stack_options(plane))
    assert stack.ray_env.items() >= DataPlane(plane).ray_env.items()
    built = dry_run.build(stack.config)
    assert set(built) == {"llm", "llm-aggregated"}
    assert {c["args"]["mode"] for c in stack.config["applications"]} == set(data_plane.TARGETS)
    # One engine per role: every deployment's replica count is fixed (min == max).
    assert all(r.min == r.max for deps in built.values() for r in deps.values())


def test_the_record_of_a_run_builds_before_any_stack(tmp_path):
    args = data_plane.parse_args(["--out", str(tmp_path / "dp.json")])
    rep = data_plane.record(args, [], 0.0)
    assert list(rep["ray_env"]) == list(data_plane.DATA_PLANES)
    json.dumps(rep)
