"""`make bench-goodput` (bench/goodput.py) without Ray or vLLM: each target's stack built as Serve
builds it (tests/bench/dry_run.py), its engines' cores, the options, and the report from
hand-made figures (bench/goodput_report.py, and its section of docs/performance.md)."""

from __future__ import annotations

import contextlib
import http.server
import inspect
import json
import os
import threading
import time
from pathlib import Path

import pytest

from bench import cpu, report
from bench import goodput as gb
from bench import goodput_figures as gf
from bench import goodput_report as grep
from bench.goodput_figures import Request
from bench.goodput_load import PROMPT, STREAM
from local.engine_cpus import OMP_BIND_ENV
from local.ray_pd import RAY_PD_MODE
from tests.bench import dry_run

TEMPLATE = (Path(report.__file__).parent / "performance.md.in").read_text()
BINDS = {"prefill": "0", "decode": "1", "aggregated": "0-1"}


def _env_of(deployment) -> dict[str, str]:
    """The environment Serve starts a replica actor with (vLLM's processes inherit it)."""
    return ((deployment._replica_config.ray_actor_options or {}).get("runtime_env") or {}).get("env_vars") or {}


def _modules(deployment) -> set[str]:
    return {c.__module__ for c in inspect.getmro(deployment.func_or_class)}


# --- the stacks, dry ------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["aggregated", "disaggregated", RAY_PD_MODE])
def test_each_ray_target_is_its_app_alone_with_each_engine_bound_to_its_cores(target):
    stack = dry_run.plan(gb.stack_options(target))
    assert stack.argv[stack.argv.index("--mode") + 1] == target and "--fixed-replicas" in stack.argv
    (app,) = stack.config["applications"]
    deps = dry_run.deployments(stack.config)[app["name"]]
    engines = {name: d for name, d in deps.items() if "tiny-llama" in name}
    want = (
        {"Prefill:tiny-llama": BINDS["prefill"], "Decode:tiny-llama": BINDS["decode"]}
        if target != "aggregated"
        else {name: BINDS["aggregated"] for name in engines}
    )
    assert len(engines) == (1 if target == "aggregated" else 2)
    assert {name: _env_of(d).get(OMP_BIND_ENV) for name, d in engines.items()} == want
    assert {name: dry_run._replicas(d) for name, d in engines.items()} == {
        name: dry_run.Replicas(1, 1) for name in engines
    }  # one engine per role, as plain vLLM runs one


def test_ray_pd_deploys_rays_builder_on_the_same_engines_and_nothing_of_ours():
    ours = dry_run.plan(gb.stack_options("disaggregated"))
    theirs = dry_run.plan(gb.stack_options(RAY_PD_MODE))
    (app,) = theirs.config["applications"]
    assert app["import_path"] == "ray.serve.llm:build_pd_openai_app"
    mine = dry_run.deployments(ours.config)[ours.config["applications"][0]["name"]]
    built = dry_run.deployments(theirs.config)[app["name"]]
    # Every class each deployment is built from, and every class above it, is Ray's.
    assert {n: {m for m in _modules(d) if m.startswith("serving")} for n, d in built.items()} == {
        n: set() for n in built
    }
    assert any(m.startswith("serving") for d in mine.values() for m in _modules(d))  # ours is seen where it is
    assert {c.__name__ for d in built.values() for c in inspect.getmro(d.func_or_class)} >= {
        "OpenAiIngress",
        "PDDecodeServer",
        "PDPrefillServer",
    }
    # The same engines: each role's replica starts with the same environment and placement.
    for role in ("Prefill:tiny-llama", "Decode:tiny-llama"):
        assert _env_of(built[role]) == _env_of(mine[role])
        assert built[role]._replica_config.placement_group_bundles == mine[role]._replica_config.placement_group_bundles
    # Ray's nodes build Ray's own engine class: no variable of theirs names our code.
    assert not [v for v in theirs.ray_env.values() if v.startswith("serving.")]
    assert theirs.argv[-1] == "--no-auth"  # Ray's app checks no keys


def test_plain_vllm_runs_bound_as_the_aggregated_engine():
    from local.config import local_target

    env = gb.plain_vllm_env()
    assert env[OMP_BIND_ENV] == BINDS["aggregated"]
    assert {k: v for k, v in env.items() if k != OMP_BIND_ENV} == {
        k: v for k, v in local_target().engine_env.items() if k != OMP_BIND_ENV
    }


def test_the_options_and_the_threshold_pairs():
    args = gb.parse_args(["--rates", "0.5,2", "--duration-s", "30", "--targets", "vllm,ray-pd", "--itl-s", "0.2"])
    assert args.rates == (0.5, 2.0) and args.duration_s == 30.0 and args.targets == ["vllm", RAY_PD_MODE]
    # Every TTFT threshold with every ITL threshold, and the local SLO's pair whatever was asked.
    assert args.pairs == sorted({(t, 0.2) for t in gb.TTFT_THRESHOLDS} | {gb.REFERENCE})
    assert args.binds == BINDS and gb.parse_args([]).targets == list(gb.TARGETS)
    with pytest.raises(SystemExit):
        gb.parse_args(["--targets", "sglang"])
    assert gb._cores_text({0, 1, 3, 5, 6, 7}) == "0-1,3,5-7"


# --- the report, from hand-made figures -------------------------------------------------------------
def _window(ttft: float, gap: float, prompts: int = 2) -> dict:
    """A 10 s window's summary: two decode streams (chunks `gap` apart), `prompts` long prompts."""
    streams = [Request(STREAM, 0.0, True, ((ttft, 1), (ttft + gap, 3), (ttft + 2 * gap, 3))) for _ in range(2)]
    longs = [Request(PROMPT, 1.0, True, ((ttft * 2, 4),)) for _ in range(prompts)]
    return gf.summary([*streams, *longs], 10.0, [gb.REFERENCE])


def _run(windows: dict[str, dict], engine: str, busy: float) -> dict:
    tallies = {r: cpu.Tally(cpu_s={engine: busy * 10, "ingress": 1.0}, wall_s=10.0) for r in windows}
    return {
        "rates": windows,
        "tallies": tallies,
        "binding": {r: gf.binding(t, 0.5, BINDS, 2) for r, t in tallies.items()},
        "idle_cores": {"ingress": 0.01},
        "ready": "READY in 60s",
        "pinning": [
            {"class": engine, "title": "VLLM::Worker_TP0", "main_thread_cores": "1", "threads_by_cores": {"1": 3}}
        ],
    }


def _rep(runs: dict) -> dict:
    args = gb.parse_args(["--rates", "1,3", "--ttft-s", "0.5", "--itl-s", "0.1", "--no-profile"])
    return gb.record(args, gb.Workload(), runs, 0.0)


def test_the_report_names_the_rate_and_thresholds_where_pd_passes_aggregated():
    # Aggregated: fine at 1 prompt/s, its streams stalled by the prompts at 3 (200 ms chunks).
    agg = {"1": _window(0.2, 0.05), "3": _window(0.2, 0.2)}
    pd = {"1": _window(0.24, 0.05, prompts=1), "3": _window(0.24, 0.05)}
    rep = _rep({"aggregated": _run(agg, "engine_aggregated", 1.2), "disaggregated": _run(pd, "engine_decode", 0.5)})
    # At 1/s aggregated serves 4 good requests in 10 s, P/D 3; at 3/s aggregated only its long prompts.
    assert rep["targets"]["aggregated"]["3"]["goodput"]["0.5/0.1"]["req_s"] == pytest.approx(0.2)
    assert rep["crossing"]["pairs"]["0.5/0.1"]["passes_at"] == "3"
    text = grep.section(rep)
    assert "P/D's goodput passes aggregated's: from 3 prompts/s at TTFT <= 0.5 s, ITL <= 0.1 s." in text
    assert "Best ratio: 2.00x at 3 prompts/s, TTFT <= 0.5 s, ITL <= 0.1 s (target >= 1.3x: met)" in text
    assert "| our P/D's goodput ÷ our aggregated app's >= 1.3 at an ITL threshold | 2.00x (3/s" in text


def test_the_report_names_what_binds_where_pd_does_not_pass():
    agg = {"1": _window(0.2, 0.05), "3": _window(0.2, 0.05)}
    pd = {"1": _window(0.24, 0.05, prompts=1), "3": _window(0.24, 0.2)}
    rep = _rep({"aggregated": _run(agg, "engine_aggregated", 1.2), "disaggregated": _run(pd, "engine_decode", 0.95)})
    text = grep.section(rep)
    assert "P/D's goodput does not pass aggregated's at any measured rate and threshold pair." in text
    # Decode's one core at 95% binds the P/D app; the aggregated engine used 60% of its two.
    assert f"disaggregated at 3 prompts/s: {cpu.CLASSES['engine_decode']}: 95% of its 1 core(s)" in text
    assert "aggregated at 3 prompts/s: no core saturated (of their cores: aggregated engine 60%" in text
    # And the rate from which the plan picks P/D on the prod stack's GPUs for the measured mix.
    g = rep["gpu_crossing"]
    assert g["stack"] == "prod" and "On a GPU, `make plan`" in text
    # The pinning table holds each vLLM process against its role's cores.
    assert "| disaggregated | VLLM::Worker_TP0 | 1 | 1 | yes | 1: 3 |" in text


def test_docs_performance_md_carries_the_goodput_section_or_keeps_the_last():
    agg = {"1": _window(0.2, 0.05), "3": _window(0.2, 0.2)}
    pd = {"1": _window(0.24, 0.05, prompts=1), "3": _window(0.24, 0.05)}
    rep = _rep({"aggregated": _run(agg, "engine_aggregated", 1.2), "disaggregated": _run(pd, "engine_decode", 0.5)})
    page = report.render(None, None, TEMPLATE, goodput=rep)
    assert "{{" not in page and grep.section(rep) in page
    # Rendered again without the JSON, the page keeps the last run's section.
    assert grep.section(rep) in report.render(None, None, TEMPLATE, previous=page)
    assert "(run `make bench-goodput`)" in report.render(None, None, TEMPLATE)


# --- a whole run, against a stand-in server -------------------------------------------------------
class _StandIn(http.server.BaseHTTPRequestHandler):
    """Streams `max_tokens` events, one token each, 1 ms apart, as vLLM's completions do."""

    protocol_version = "HTTP/1.0"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            event = {"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_a_whole_run_against_a_stand_in_server_writes_the_json_and_the_tables(tmp_path, monkeypatch, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"

    @contextlib.contextmanager
    def stand_in(target, args, model_dir, say):
        yield gb.Up(url, {}, cpu.Meter({cpu.PLAIN: os.getpid()}, {}), None, "up")

    monkeypatch.setattr(gb, "stack_up", stand_in)
    monkeypatch.setattr("local.tiny_model.ensure_tiny_model", lambda: tmp_path)
    out = tmp_path / "goodput.json"
    argv = ["--out", str(out), "--rates", "2,4", "--duration-s", "1", "--idle-s", "0.1", "--streams", "2"]
    try:
        assert gb.main(argv) == 0
    finally:
        server.shutdown()
    rep = json.loads(out.read_text())
    assert set(rep["targets"]) == set(gb.TARGETS) and all(set(by) == {"2", "4"} for by in rep["targets"].values())
    s = rep["targets"]["aggregated"]["4"]
    assert s["errors_total"] == 0 and s["completed"] == s["requests"] > 0
    assert set(s["goodput"]) == {gf.pair_key(t, i) for t, i in gb.parse_args(argv).pairs}
    assert set(rep["profile"]) == set(gb.PROFILED) and set(rep["plan"]) == {"2", "4"}
    assert rep["gpu_crossing"]["stack"] == "prod" and "ours_vs_ray" in rep and "crossing" in rep
    printed = capsys.readouterr().out
    assert "Goodput (requests/s that met both thresholds) per threshold pair" in printed and f"JSON: {out}" in printed


def test_the_dry_run_prints_each_targets_deployment_and_starts_nothing(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started a stack")

    monkeypatch.setattr(gb, "stack_up", refuse)
    monkeypatch.setattr("local.background.background_stack", refuse)
    assert gb.main(["--dry-run", "--rates", "1,2", "--duration-s", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "vllm: -m vllm.entrypoints.openai.api_server, VLLM_CPU_OMP_THREADS_BIND=0-1"
    assert lines[1].endswith("-> serving.app:build_app; VLLM_CPU_OMP_THREADS_BIND: llm_configs[0] 0-1")
    assert lines[2].endswith("VLLM_CPU_OMP_THREADS_BIND: prefill_config 0, decode_config 1")
    assert "--mode ray-pd" in lines[3] and "-> ray.serve.llm:build_pd_openai_app;" in lines[3]
    args = gb.parse_args(["--rates", "1,2", "--duration-s", "60"])
    assert (
        lines[4]
        == f"rates 1, 2 long prompts/s, 60 s each, 12 threshold pairs; about {gb.estimate_s(args) / 60:.0f} minutes"
    )
    # Each window and each stack's start and stop counted once per target; the profile runs once per profiled app.
    per_target = gb.START_S + gb.WARM_AND_STOP_S + gb.IDLE_S + 2 * (60 + gb.TAIL_S)
    assert gb.estimate_s(args) == 4 * per_target + 2 * gb.PROFILE_S
    with pytest.raises(SystemExit):
        gb.parse_args(["--engine-cpus", "prefill=9"])
