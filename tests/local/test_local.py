"""local/: what `make serve` deploys (unit), and the command itself (e2e)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra.paths import ROOT
from local import __main__ as local_main
from local import config as local_config
from local import procs as local_procs
from serving.spec import APP_IMPORT_PATH, SERVING_ENV, Mode, Router

MODEL_DIR = Path("/models/tiny")


# --- unit: the rendered config carries the local differences docs/local-serving.md lists -------
# Expected values from that page's "What changes" list (and docs/scaling.md "Locally" for the
# decode autoscaling), not from the renderer.
@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_local_config_has_the_documented_local_values(mode):
    rendered = local_config.render_local_config(mode, MODEL_DIR, port=8123)
    assert rendered["http_options"]["host"] == "127.0.0.1" and rendered["http_options"]["port"] == 8123
    assert rendered["proxy_location"] == "HeadOnly"
    (app,) = rendered["applications"]
    args = app["args"]
    engines = [args["prefill_config"], args["decode_config"]] if mode == "disaggregated" else args["llm_configs"]
    for engine in engines:
        assert engine["accelerator_config"] == {"kind": "cpu"}
        kw = engine["engine_kwargs"]
        assert (kw["dtype"], kw["max_model_len"], kw["enforce_eager"]) == ("float32", 1024, True)
        assert engine["model_loading_config"]["model_source"] == str(MODEL_DIR)
    if mode == "disaggregated":
        for side, group in (("prefill_config", "prefill"), ("decode_config", "decode")):
            cfg = args[side]
            assert cfg["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == "NixlConnector"
            assert cfg["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] == "cpu"
            assert cfg["deployment_config"]["placement_group_bundle_label_selector"] == [
                {"pd-inference/node-group": group}
            ]
        scaling = args["decode_config"]["deployment_config"]["autoscaling_config"]
        assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 2, 8)
        assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"]) == (2, 10)


def test_both_adds_the_aggregated_app_under_its_own_name_and_prefix():
    target = local_config.local_target()
    rendered = local_config.render_local_config("both", MODEL_DIR, port=8000, target=target)
    pd, agg = rendered["applications"]
    assert (pd["name"], pd["route_prefix"]) == ("llm", "/")
    assert (agg["name"], agg["route_prefix"]) == (local_config.AGGREGATED_APP, local_config.AGGREGATED_PREFIX)
    assert pd["import_path"] == agg["import_path"] == APP_IMPORT_PATH
    assert agg["args"] == local_config.local_spec(Mode.AGGREGATED, MODEL_DIR).app_args(target)
    assert local_config.app_urls(rendered, 8000) == {
        "disaggregated": "http://127.0.0.1:8000/v1",
        "aggregated": "http://127.0.0.1:8000/aggregated/v1",
    }


def test_local_config_passes_ray_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(local_config.render_local_config("both", MODEL_DIR, port=8000))


def test_local_values_are_cpu_friendly():
    args = local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR).app_args(local_config.local_target())
    for cfg in (args["prefill_config"], args["decode_config"]):
        kw = cfg["engine_kwargs"]
        assert kw["dtype"] == "float32" and kw["enforce_eager"] is True
        assert kw["max_model_len"] == local_config.MAX_MODEL_LEN
        assert kw["kv_transfer_config"]["kv_buffer_device"] == "cpu"
        assert cfg["accelerator_config"] == {"kind": "cpu"}
        assert cfg["runtime_env"]["env_vars"] == {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # tool choice forced by the tools' JSON schema, which the tiny model can follow
            "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",
            **SERVING_ENV,
        }
        assert cfg["model_loading_config"]["model_source"] == str(MODEL_DIR)
    assert args["auth"]["mode"] == "api-key"


def test_no_auth_renders_auth_disabled():
    args = local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR, auth=False).app_args(local_config.local_target())
    assert args["auth"]["mode"] == "disabled"


def test_parse_args_defaults_and_choices():
    a = local_main.parse_args([])
    assert (a.port, a.mode, a.no_auth) == (8000, "disaggregated", False)
    assert local_main.parse_args(["--mode", "aggregated", "--no-auth", "--port", "9"]).mode == "aggregated"
    with pytest.raises(SystemExit):
        local_main.parse_args(["--mode", "hybrid"])


def test_the_data_plane_comes_from_the_flag_or_env_and_sets_rays_switches(monkeypatch):
    """Ray 2.60 reads its high-throughput switches from every Ray process's environment
    (ray/serve/_private/constants.py; docs.ray.io "Enable High Throughput on Ray Serve with
    KubeRay": RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_THROUGHPUT_OPTIMIZED=1), so make serve
    puts them into the local cluster's environment; the default is the spec's (haproxy)."""
    monkeypatch.delenv(local_config.DATA_PLANE_ENV, raising=False)
    assert local_main.parse_args([]).data_plane is None
    monkeypatch.setenv(local_config.DATA_PLANE_ENV, "grpc")
    assert local_main.parse_args([]).data_plane == "grpc"
    assert local_main.parse_args(["--data-plane", "ray-proxy"]).data_plane == "ray-proxy"
    with pytest.raises(SystemExit):
        local_main.parse_args(["--data-plane", "nginx"])
    on = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert on.items() <= local_config.data_plane_env(None).items()
    assert on.items() <= local_config.data_plane_env("haproxy").items()
    off = local_config.data_plane_env("ray-proxy")
    assert off["RAY_SERVE_ENABLE_HA_PROXY"] != "1" and off["RAY_SERVE_THROUGHPUT_OPTIMIZED"] != "1"
    # gRPC between replicas behind Serve's own proxy: direct ingress stays off, or nothing
    # would listen on the Serve port (constants.py: direct ingress starts no proxies).
    grpc = local_config.data_plane_env("grpc")
    assert (grpc["RAY_SERVE_THROUGHPUT_OPTIMIZED"], grpc["RAY_SERVE_ENABLE_HA_PROXY"]) == ("1", "0")
    assert grpc["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"


def test_the_prefill_router_is_the_stacks_default_unless_asked_for(monkeypatch):
    """make serve runs what a stack runs unless told (power-of-two: make bench measures it);
    `PD_PREFILL_ROUTER` / `--prefill-router` opt the P/D prefill tier into another router, as
    `serving.prefill.router` does in a stack file, and the aggregated app has no prefill."""
    monkeypatch.delenv(local_config.PREFILL_ROUTER_ENV, raising=False)
    assert local_main.parse_args([]).prefill_router is None
    monkeypatch.setenv(local_config.PREFILL_ROUTER_ENV, "kv-aware")
    assert local_main.parse_args([]).prefill_router == "kv-aware"
    assert local_main.parse_args(["--prefill-router", "power-of-two"]).prefill_router == "power-of-two"
    with pytest.raises(SystemExit):
        local_main.parse_args(["--prefill-router", "round-robin"])
    default = local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR)
    kv = local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR, prefill_router="kv-aware")
    assert (default.prefill.router, default.kv_routed) == (Router.POWER_OF_TWO, False)
    assert (kv.prefill.router, kv.kv_routed) == (Router.KV_AWARE, True)
    assert local_config.local_spec(Mode.AGGREGATED, MODEL_DIR, prefill_router="kv-aware").kv_routed is False
    with pytest.raises(local_config.LocalConfigError, match="router"):
        local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR, prefill_router="round-robin")


def test_replicas_per_role_from_flags_or_env(monkeypatch, capsys):
    monkeypatch.delenv(local_config.REPLICAS_ENV, raising=False)
    a = local_main.parse_args([])
    assert (a.prefill_replicas, a.decode_replicas) == (1, 1)
    a = local_main.parse_args(["--decode-replicas", "2"])
    assert (a.prefill_replicas, a.decode_replicas) == (1, 2)
    monkeypatch.setenv(local_config.REPLICAS_ENV, "2")
    a = local_main.parse_args([])
    assert (a.prefill_replicas, a.decode_replicas) == (2, 2)
    for bad in (["--prefill-replicas", "3"], ["--decode-replicas", "x"]):
        with pytest.raises(SystemExit):
            local_main.parse_args(bad)
        assert "engine replicas per role must be 1 to 2" in capsys.readouterr().err


def test_replicas_render_as_fixed_replica_counts_with_bounded_queues():
    cfg = local_config.render_local_config("disaggregated", MODEL_DIR, port=8000, prefill_replicas=2, decode_replicas=2)
    args = cfg["applications"][0]["args"]
    for role in ("prefill_config", "decode_config"):
        dep = args[role]["deployment_config"]
        assert dep["autoscaling_config"]["min_replicas"] == dep["autoscaling_config"]["max_replicas"] == 2
        assert dep["max_queued_requests"] == local_config.LOCAL_ROLE_LIMITS["maxQueuedRequests"]
    # decode: 2 replicas x 16 running + 32 queued at the ingress's handle
    assert local_config.admission_bound(cfg) == 2 * 16 + 32


def test_local_deadlines_come_from_the_spec_model():
    from serving.spec import ResilienceSpec

    args = local_config.render_local_config("disaggregated", MODEL_DIR, port=8000)["applications"][0]["args"]
    cfg = ResilienceSpec.from_args(args["resilience"])
    assert cfg.prefill_timeout_s == local_config.LOCAL_RESILIENCE["prefillTimeoutS"]


def test_instance_lock_refuses_a_second_holder(tmp_path):
    with local_procs.instance_lock(8000, tmp_path):
        # A separate process, as a second `make serve` would be.
        code = (
            "import sys; from pathlib import Path; from local import procs as local_procs\n"
            f"try:\n    local_procs.instance_lock(8000, Path({str(tmp_path)!r})).__enter__()\n"
            "except local_procs.AlreadyRunning as e:\n    print(e); sys.exit(3)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 3, r.stderr
        assert "already running on port 8000" in r.stdout and "make serve PORT=8001" in r.stdout
        # Another port is another instance.
        with local_procs.instance_lock(8001, tmp_path):
            pass
    with local_procs.instance_lock(8000, tmp_path):
        pass  # released on exit


def test_port_in_use_detects_a_listener():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert local_procs.port_in_use(s.getsockname()[1])
    assert not local_procs.port_in_use(local_procs.free_port())


def test_second_run_on_a_busy_port_exits_nonzero_before_starting_anything():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "local", "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    # It stopped at the port check: no model built, no Ray started (each step prints a progress
    # line on stdout first, local/__main__.py).
    assert "tiny model" not in r.stdout and "Ray" not in r.stdout, r.stdout


# --- e2e: the running command ----------------------------------------------------------------
@pytest.mark.e2e
def test_ready_line_has_url_key_and_a_curl_example(stack):
    line = stack.ready_line
    base = stack.urls["disaggregated"]
    assert line.count("\n") == 1 and line.startswith("READY")
    assert base in line and stack.api_key in line
    assert f"curl -s {base}/chat/completions -H 'Authorization: Bearer {stack.api_key}'" in line
    assert sum(1 for ln in stack.output if ln.startswith("READY")) == 1
    # Progress was shown before it.
    assert any("starting a local Ray cluster" in ln for ln in stack.output)


@pytest.mark.e2e
def test_the_printed_curl_example_works(stack):
    cmd = stack.ready_line.split("try: ", 1)[1].rsplit(" | Ctrl-C", 1)[0]
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and '"chat.completion"' in r.stdout, r.stdout + r.stderr


@pytest.mark.e2e
def test_the_serve_port_is_haproxys_and_the_ingress_listens_on_its_own(stack):
    """The designed front door (serving.ingress.dataPlane: haproxy): HAProxy, not Serve's
    Python proxy actor, holds the Serve port, and the ingress replica serves HTTP itself
    (direct ingress), so no proxy actor call sits between them."""
    import psutil

    def listener(port: int) -> psutil.Process:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
        raise AssertionError(f"nothing listens on {port}")

    assert listener(stack.port).name() == "haproxy"
    ingress_ports = {
        c.laddr.port
        for p in psutil.process_iter(["cmdline"])
        if "ServeReplica:llm:AuthenticatedIngress" in " ".join(p.info["cmdline"] or [])
        for c in p.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    # Ray 2.60's direct-ingress HTTP range (constants.py RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT).
    assert any(30000 <= port <= 31000 for port in ingress_ports), ingress_ports


@pytest.mark.e2e
def test_second_serve_on_the_same_port_says_so_and_fails(stack):
    r = subprocess.run(
        [sys.executable, "-m", "local", "--port", str(stack.port)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode != 0
    assert "already" in r.stderr and str(stack.port) in r.stderr


@pytest.mark.e2e
def test_nodes_carry_the_cloud_labels_and_each_part_runs_on_its_group(stack):
    labels = sorted(n["label"] for n in stack.nodes)
    assert labels == ["decode", "head", "prefill"]
    node_label = {n["node_id"]: n["label"] for n in stack.nodes}
    apps = httpx.get(f"{stack.state['dashboard_url']}/api/serve/applications/", timeout=10).json()
    placed = {}
    for app_name, app in apps["applications"].items():
        assert app["status"] == "RUNNING"
        for dep_name, dep in app["deployments"].items():
            placed[(app_name, dep_name.split(":")[0])] = {node_label[r["node_id"]] for r in dep["replicas"]}
    assert placed == {
        ("llm", "Prefill"): {"prefill"},
        # The prefill tier's KV scorer (serving/engines/kv_router.py) beside the engines it indexes.
        ("llm", "LLMRouter"): {"prefill"},
        ("llm", "Decode"): {"decode"},
        ("llm", "AuthenticatedIngress"): {"head"},
        # The aggregated engine runs the spec's eager-first-chunk server class (serving/engines/streaming.py).
        (local_config.AGGREGATED_APP, "EagerLLMServer"): {"decode"},
        (local_config.AGGREGATED_APP, "AuthenticatedIngress"): {"head"},
    }
    # What Serve runs is what the spec rendered.
    deployed = apps["applications"]["llm"]["deployed_app_config"]
    assert deployed["args"] == stack.state["config"]["applications"][0]["args"]


@pytest.mark.e2e
def test_no_idle_ray_worker_log_monitor_or_telemetry_actor_is_kept(stack):
    """Ray Serve LLM initialises each engine replica's node in a Ray task; with Ray's default
    the worker that ran it (vLLM imported, about 750 MB) stays as `ray::IDLE` for as long as
    the node has free CPUs. The spec's RAY_num_workers_soft_limit=0 (serving.spec
    IDLE_WORKERS_KEPT) lets the raylet end it after a second idle. No node runs a log monitor
    either (serving.spec LOG_MONITOR): nothing reads what it would publish. Nor is Ray Serve
    LLM's usage telemetry actor started: usage stats are off in every stack
    (serving.ray_internals.skip_usage_telemetry_when_off)."""
    import psutil

    def idle() -> list[str]:
        found = []
        for p in psutil.Process(stack.proc.pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                if cmd.startswith(("ray::IDLE", "ray::TelemetryAgent")) or "ray/_private/log_monitor.py" in cmd:
                    found.append(f"pid {p.pid} {cmd[:60]}, {p.memory_info().rss >> 20} MiB")
            except psutil.Error:
                continue
        return found

    # A worker starting for a task shows as idle for a moment: none left at some point is the bar.
    deadline = time.monotonic() + 15
    while (left := idle()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"idle Ray workers, log monitors or a telemetry actor kept: {left}"


@pytest.mark.e2e
def test_ctrl_c_shuts_everything_down(stack):
    """Runs last (see conftest): Ctrl-C stops Ray, frees the port, leaves no Ray process."""
    import psutil

    gcs = stack.state["gcs_address"]
    rc = stack.stop()
    out = "".join(stack.output)
    assert rc == 0, out[-3000:]
    assert f"stopped; port {stack.port} is free" in out
    assert not local_procs.port_in_use(stack.port)
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.state["dashboard_url"], timeout=2)
    deadline = time.monotonic() + 30
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if gcs in " ".join(p.info["cmdline"] or []):
                    left.append(p.pid)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, f"Ray processes of the stopped cluster still alive: {left}"
    # nor the HAProxy Serve ran on its nodes (the haproxy data plane): a next start is clean
    nodes = [n["node_id"] for n in stack.nodes]
    assert not [p.pid for p in local_procs._haproxies() if any(n in " ".join(p.info["cmdline"]) for n in nodes)]
