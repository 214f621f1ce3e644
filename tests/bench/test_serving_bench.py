"""make bench's level runner (bench/serving_bench.py run_level), shared with make
bench-data-plane: the rounds, the rotation of targets, the seeds and the pooling, on a stand-in
load and a stand-in CPU meter (no Ray, no vLLM)."""

from __future__ import annotations

import contextlib

import pytest

from bench.serving_bench import cpu_counts, parse_levels, run_level
from bench.stats import RequestResult


class Meter:
    """What run_level asks of bench.cpu.Meter: a context around each batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, str, str | None]] = []

    @contextlib.contextmanager
    def batch(self, target: str, level: str, app: str | None):
        self.batches.append((target, level, app))
        yield


def test_run_level_splits_rotates_seeds_and_pools():
    sent: list[tuple[str, int, int, int]] = []

    def send(t: str, n: int, conc: int, seed: int):
        sent.append((t, n, conc, seed))
        return [RequestResult(ok=True, ttft_s=0.01, output_tokens=4)] * n, 0.5

    meter = Meter()
    said: list[str] = []
    lv = run_level(
        send, ("a", "b", "c"), 4, 5, rounds=2, seed=100, meter=meter, apps={"a": "app-a"}, shift=1, say=said.append
    )
    # 5 requests over 2 rounds: 3 then 2; round r starts (r + shift) along the targets.
    assert sent == [
        ("b", 3, 4, 4100),
        ("c", 3, 4, 4100),
        ("a", 3, 4, 4100),
        ("c", 2, 4, 4101),
        ("a", 2, 4, 4101),
        ("b", 2, 4, 4101),
    ]
    assert {t: len(r) for t, r in lv.results.items()} == {"a": 5, "b": 5, "c": 5}
    assert lv.duration_s == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0})
    assert lv.window[0] <= lv.window[1]
    # Each batch is metered for its target, with the Serve app name (None: not a Ray app).
    assert meter.batches[:3] == [("b", "4", None), ("c", "4", None), ("a", "4", "app-a")]
    assert said == ["concurrency 4: round 1/2 done (b -> c -> a)", "concurrency 4: round 2/2 done (c -> a -> b)"]


def test_levels_and_cpu_counts():
    assert parse_levels("1:24,16:64") == {1: 24, 16: 64}
    summaries = {
        "aggregated": {1: {"completed": 24, "output_tokens": 1300}, 16: {"completed": None, "output_tokens": None}}
    }
    assert cpu_counts(summaries) == {"aggregated": {"1": (24, 1300), "16": (0, 0)}}


# --- the stacks, dry (tests/bench/dry_run.py: built as Serve builds them, no Ray) -------------
def test_the_three_targets_stack_holds_both_apps_with_the_roles_the_figures_read():
    from bench.observe import roles
    from bench.serving_bench import BENCH_ENV, TARGETS, stack_options
    from bench.stats import kv_backends
    from local.config import app_urls
    from serving.spec import INGRESS_DEPLOYMENT
    from tests.bench import dry_run

    stack = dry_run.plan(stack_options())
    built = dry_run.build(stack.config)
    # run_targets: a and b are the stack's apps by mode, c is vLLM's own server.
    apps = {c["args"]["mode"]: c["name"] for c in stack.config["applications"]}
    assert [*apps, "vllm"] == list(TARGETS) and set(app_urls(stack.config, 8000)) == set(apps)
    served = dry_run.served(built, INGRESS_DEPLOYMENT)
    assert roles(served[apps["disaggregated"]]) == (INGRESS_DEPLOYMENT, "Decode:tiny-llama", "Prefill:tiny-llama")
    assert roles(served[apps["aggregated"]])[::2] == (INGRESS_DEPLOYMENT, None)
    # One engine per role, as plain vLLM runs one: no replica started within a level.
    assert {dep: (r.min, r.max) for dep, r in built[apps["disaggregated"]].items() if "tiny-llama" in dep} == {
        "Decode:tiny-llama": (1, 1),
        "Prefill:tiny-llama": (1, 1),
    }
    assert kv_backends(stack.config)  # labels the KV figures
    assert stack_options()["extra_env"] == BENCH_ENV  # Serve's tracing, for the hop breakdown


# --- tracing at a prod stack's rate; the traced pass ---------------------------------------------
def test_the_bench_traces_at_the_rate_the_prod_stack_renders():
    from bench.serving_bench import BENCH_ENV, PROD_TRACE_SAMPLE_RATE, parse_args
    from infra import config
    from infra.k8s.tracing import SERVE_EXPORTER_ENV, SERVE_RATIO_ENV, export_for
    from tools import stackfile

    values, secrets, _ = stackfile.read_as_deployed("prod")
    cfg = config.load(values, secret_keys=secrets, source="stacks/Pulumi.prod.yaml")
    export = export_for(cfg.observability.tracing, cfg.environment.value)
    assert export is not None and export.sample_rate == PROD_TRACE_SAMPLE_RATE < 1.0
    # The same string the prod Ray pods get for Serve's ratio.
    assert BENCH_ENV[SERVE_RATIO_ENV] == repr(export.sample_rate)
    # Serve's tracing is all the bench adds to Ray's environment: any other Ray setting would
    # measure a stack the prod pods are not (a 1 s metrics export cost the idle stack 8-9 points
    # of a core).
    assert set(BENCH_ENV) == {SERVE_RATIO_ENV, SERVE_EXPORTER_ENV}
    args = parse_args([])
    assert not args.traced_pass and args.idle_s > 0
    assert parse_args(["--traced-pass", "--idle-s", "5"]).traced_pass


def test_the_traced_pass_stack_traces_every_request_and_builds():
    from bench.serving_bench import EVERY_REQUEST, stack_options
    from infra.k8s.tracing import SERVE_RATIO_ENV
    from tests.bench import dry_run

    options = stack_options(EVERY_REQUEST)
    assert options["extra_env"][SERVE_RATIO_ENV] == "1.0"
    built = dry_run.build(dry_run.plan(options).config)
    assert len(built) == 2  # both apps, as the prod-rate pass


def test_the_reports_per_token_part_from_both_passes():
    from bench import cpu
    from bench.serving_bench import TARGETS, Measured, per_token_report

    def measured(rate: float, decode_cpu_s: float) -> Measured:
        ok = [RequestResult(ok=True, ttft_s=0.01, output_tokens=50)] * 2  # 100 tokens per target
        tallies = {
            "disaggregated": {"1": cpu.Tally(cpu_s={"pd_orchestration": decode_cpu_s}, wall_s=1.0)},
            "aggregated": {"1": cpu.Tally(cpu_s={"aggregated_server": 0.05}, wall_s=1.0)},
            "vllm": {"1": cpu.Tally(cpu_s={"vllm_api_server": 0.1}, wall_s=1.0)},
        }
        return Measured(
            results={t: {1: ok} for t in TARGETS},
            durations={t: {1: 1.0} for t in TARGETS},
            windows={},
            snaps=[],
            metric_urls=[],
            spans=[],
            apps={},
            served={},
            idle={},
            tallies=tallies,
            backend="UCX",
            sample_rate=rate,
            idle_hops={"disaggregated": {"pd_orchestration": 0.01}},
        )

    out = per_token_report(measured(0.01, 0.11), measured(1.0, 0.13), idle_s=25.0)
    assert out["tracing"]["sample_rate"] == 0.01 and out["tracing"]["traced_pass_rate"] == 1.0
    # 0.11 CPU-s - 0.01 x 1 s idle = 0.10 over 100 tokens: 1,000 CPU-ms per 1,000 tokens; plain
    # vLLM's server 0.1 CPU-s -> 1,000 too: 1.0x.
    dec = out["per_token"]["disaggregated"]["hops"]["pd_orchestration"]
    assert dec["net_ms_per_1k_tokens"] == pytest.approx(1000.0)
    assert dec["net_vs_vllm_api_server"] == pytest.approx(1.0)
    # The traced pass spent 0.02 CPU-s more there: +200 CPU-ms per 1,000 tokens.
    assert out["tracing_cost"]["disaggregated"]["ms_per_1k_tokens"]["pd_orchestration"] == pytest.approx(200.0)
    assert "tracing_cost" not in per_token_report(measured(0.01, 0.11), None, idle_s=25.0)
