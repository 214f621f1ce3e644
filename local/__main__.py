"""`make serve`: the cloud's serving application, run for real on this machine's CPUs.

What flows through here: command-line options -> a CPU `ServingSpec` (tiny local model,
float32, eager mode) -> `ServingSpec.serve_config(Target(...))`, the SAME function that
renders the RayService's serveConfigV2 -> a local three-node Ray cluster whose nodes carry
the cloud's node-group labels (head, prefill, decode) -> the config PUT to the Ray
dashboard's Serve REST API, which is what KubeRay does with serveConfigV2 -> progress lines
until the applications run and a test request succeeds -> one ready line -> Ctrl-C stops
Ray and frees the port.

Local overrides of the rendered config, and nothing else: the HTTP host (127.0.0.1 instead
of 0.0.0.0), and with `--mode both` a second application (the aggregated one) under its own
name and route prefix. Everything under `args` is exactly what the spec renders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.cluster import DeployFailed, LocalCluster, deploy, smoke_request, wait_dashboard, wait_running
from local.config import (
    AGGREGATED_PREFIX,
    DATA_PLANE_ENV,
    HOST,
    MAX_LOCAL_MODELS,
    MAX_LOCAL_REPLICAS,
    MODEL_B_ID,
    MODEL_C_ID,
    MODEL_ID,
    MODELS_ENV,
    MODES,
    PREFILL_ROUTER_ENV,
    REPLICAS_ENV,
    SCALE_TO_ZERO_ENV,
    SIGNALS_ENV,
    LocalConfigError,
    app_urls,
    hybrid_from_env,
    local_data_plane,
    local_spec,
    models_problem,
    render_local_config,
    stack_ray_env,
)
from local.engine_cpus import add_option as add_engine_cpus
from local.engine_cpus import pin
from local.procs import STOP_SIGNALS, AlreadyRunning, free_port, instance_lock, leftover_haproxy, port_in_use
from local.prometheus import PROMETHEUS_HOST_ENV, SCRAPE_S, LocalPrometheus, PrometheusMissing
from local.prometheus import binary as prometheus_binary
from local.ray_pd import RAY_PD_MODE, ray_env_for, stock_config
from serving.spec import API_KEYS_ENV, FALLBACK_API_KEY_ENV, DataPlane, Mode, Router, key_id, parse_api_keys


# --- the command ---------------------------------------------------------------------------
def _replicas(raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_LOCAL_REPLICAS:
        raise argparse.ArgumentTypeError(
            f"{raw!r}: engine replicas per role must be 1 to {MAX_LOCAL_REPLICAS} on this machine "
            f"(--prefill-replicas, --decode-replicas or ${REPLICAS_ENV})"
        )
    return n


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The command line; the defaults from `environ` (the process's environment when None)."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="python -m local",
        description="Run the disaggregated prefill/decode OpenAI API locally on CPU with a tiny model.",
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="disaggregated",
        help="disaggregated (prefill+decode, default), aggregated (one engine), both (disaggregated at /, "
        f"aggregated at {AGGREGATED_PREFIX}), or {RAY_PD_MODE} (Ray Serve LLM's own P/D app: local/ray_pd.py)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help=f"serve without API keys (default: keys from ${API_KEYS_ENV}, or a generated one)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for ready (default 600)")
    default_n = env.get(REPLICAS_ENV) or "1"
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-replicas",
            type=_replicas,
            default=default_n,
            help=f"{role} engine replicas, 1-{MAX_LOCAL_REPLICAS} (default ${REPLICAS_ENV} or 1)",
        )
    p.add_argument(
        "--signals",
        action="store_true",
        default=env.get(SIGNALS_ENV) == "1",
        help="each role autoscales on its engines' own signals, read from a local Prometheus "
        f"(prefill 1-2 replicas too; default ${SIGNALS_ENV}=1)",
    )
    p.add_argument(
        "--fixed-replicas",
        action="store_true",
        help="every role keeps the replica count asked for: no Serve autoscaling (make bench "
        "measures a steady layout; make bench-scaling measures the scaling)",
    )
    p.add_argument(
        "--scale-to-zero",
        action="store_true",
        default=env.get(SCALE_TO_ZERO_ENV) == "1",
        help="decode may scale to zero replicas when idle; needs a fallback (PD_FALLBACK_BASE_URL) "
        f"for `unavailable` (default ${SCALE_TO_ZERO_ENV}=1)",
    )
    p.add_argument(
        "--models",
        type=int,
        choices=range(1, MAX_LOCAL_MODELS + 1),
        default=int(env.get(MODELS_ENV) or 1),
        help=f"2: also serve {MODEL_B_ID} (aggregated, with a LoRA adapter from a local S3) through "
        f"the same front door; 3: and {MODEL_C_ID} at zero replicas (default ${MODELS_ENV} or 1)",
    )
    p.add_argument(
        "--data-plane",
        choices=[d.value for d in DataPlane],
        default=env.get(DATA_PLANE_ENV) or None,
        help="how requests reach the ingress and cross between replicas: haproxy (Ray's "
        "high-throughput mode), grpc, or ray-proxy (Ray's defaults); default "
        f"${DATA_PLANE_ENV} or the spec's",
    )
    p.add_argument(
        "--prefill-router",
        choices=[r.value for r in Router],
        default=env.get(PREFILL_ROUTER_ENV) or None,
        help="how the disaggregated app's prefill tier picks a replica: power-of-two (the "
        "stacks' default), prefix-cache-affinity, or kv-aware (by where the prompt's KV cache "
        f"is); default ${PREFILL_ROUTER_ENV} or the spec's",
    )
    p.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="write URLs, key and node metrics endpoints as JSON here once ready",
    )
    return add_engine_cpus(p, env).parse_args(argv)


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    # SIGTERM and SIGHUP stop the stack the same way Ctrl-C does.
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in STOP_SIGNALS:
        signal.signal(s, _stop_on_sigterm)


def _say(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:5.1f}s] {msg}", flush=True)


def _preflight(args: argparse.Namespace) -> tuple[contextlib.ExitStack, dict[str, Any]] | str:
    """Refuse a second run and bad hybrid settings before anything heavy is imported or
    started: (the held instance lock, the hybrid settings), or the one-line error."""
    if port_in_use(args.port):
        return (
            f"port {args.port} on {HOST} is already in use (another `make serve`?); "
            "stop it or choose another port: make serve PORT=8001"
        )
    if args.signals:
        try:
            prometheus_binary()
        except PrometheusMissing as exc:
            return str(exc)
    problem = models_problem(args.models, args.mode) or mode_problem(args)
    if problem:
        return problem
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(instance_lock(args.port))
    except AlreadyRunning as exc:
        return str(exc)
    # Hybrid routing from the environment.
    try:
        hybrid = hybrid_from_env(dict(os.environ))
        local_spec(
            Mode.DISAGGREGATED,
            Path("/models/check"),
            hybrid=hybrid,
            scale_to_zero=args.scale_to_zero,
            prefill_router=args.prefill_router,
        )
    except LocalConfigError as exc:
        stack.close()
        return str(exc)
    # Last: a mistake in the settings is named first, whatever else runs on this machine.
    if local_data_plane(args.data_plane) is DataPlane.HAPROXY:
        leftover = leftover_haproxy()
        if leftover is not None:
            stack.close()
            return leftover
    return stack, hybrid


def _state(
    args: argparse.Namespace,
    model_dir: Path,
    api_key: str | None,
    urls: dict[str, str],
    cluster: LocalCluster,
    config: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """What --state-file records for tests and benches (local/background.py)."""
    return {
        "pid": os.getpid(),
        "port": args.port,
        "model": MODEL_ID,
        "model_dir": str(model_dir),
        "api_key": api_key,
        "urls": urls,
        "dashboard_url": cluster.dashboard_url,
        "gcs_address": cluster.gcs_address,
        "nodes": cluster.nodes(),
        "config": config,
        **extra,
    }


def _models_extras(args: argparse.Namespace, stack: contextlib.ExitStack, keys: list[str]) -> dict[str, Any]:
    """With --models 2: the local S3 holding the tiny LoRA adapter (its environment goes to the
    Ray nodes), and, with auth, one more key limited to the first model. What the render, the
    cluster and the state file need: lora_path, s3_env, key_models, models, adapter, limited_key."""
    if args.models < 2:
        return {}
    from local.s3 import local_adapters
    from local.tiny_lora import ADAPTER_NAME

    s3_env, lora_path = stack.enter_context(local_adapters())
    extras: dict[str, Any] = {
        "lora_path": lora_path,
        "s3_env": s3_env,
        "models": [MODEL_ID, MODEL_B_ID, MODEL_C_ID][: args.models],
        "adapter": f"{MODEL_B_ID}:{ADAPTER_NAME}",
    }
    if not args.no_auth:
        limited = "sk-local-" + secrets.token_urlsafe(18)
        keys.append(limited)
        extras["limited_key"] = limited
        extras["key_models"] = {key_id(limited): [MODEL_ID]}
    return extras


def _ready_line(mode: str, urls: dict[str, str], api_key: str | None, extras: dict[str, Any]) -> str:
    """The one line a person reads: where the API is, the key, and a curl to try."""
    auth_header = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    if "models" in urls:
        limited = f" | key for {MODEL_ID} only: {extras['limited_key']}" if "limited_key" in extras else ""
        return (
            f"OpenAI API at {urls['models']} | models: {', '.join(extras['models'])}, adapter {extras['adapter']}"
            f" | api key: {api_key}{limited} | try: curl -s {urls['models']}/models{auth_header} | Ctrl-C stops"
        )
    base = urls.get("disaggregated") or urls.get("aggregated") or urls[RAY_PD_MODE]
    also = f" (aggregated app at {urls['aggregated']})" if len(urls) > 1 else ""
    key_note = f" api key: {api_key} |" if api_key else " auth: off |"
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    kind = {"aggregated": "aggregated", RAY_PD_MODE: "Ray Serve LLM's own P/D"}.get(mode, "disaggregated")
    return (
        f"{kind} OpenAI API at {base}{also} | model: {MODEL_ID} |{key_note} try: curl -s "
        f"{base}/chat/completions{auth_header} -H 'Content-Type: application/json' -d '{body}' | Ctrl-C stops"
    )


def render_config(
    args: argparse.Namespace, model_dir: Path, hybrid: dict[str, Any], extras: dict[str, Any]
) -> dict[str, Any]:
    """The Serve config a run with these options deploys (pure: nothing is started; the
    benches' dry runs build it too, local/background.py plan_stack): the engines pinned to
    --engine-cpus, and with --mode ray-pd the disaggregated app's engines under Ray's own app."""
    config = render_local_config(
        Mode.DISAGGREGATED.value if args.mode == RAY_PD_MODE else args.mode,
        model_dir,
        port=args.port,
        auth=not args.no_auth,
        hybrid=hybrid,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        signals=args.signals,
        scale_to_zero=args.scale_to_zero,
        fixed=args.fixed_replicas,
        models=args.models,
        lora_path=extras.get("lora_path"),
        key_models=extras.get("key_models"),
        data_plane=args.data_plane,
        prefill_router=args.prefill_router,
    )
    config = pin(config, args.engine_cpus)
    return stock_config(config) if args.mode == RAY_PD_MODE else config


def mode_problem(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (Ray's own P/D app has no API keys), else None."""
    if args.mode == RAY_PD_MODE and not args.no_auth:
        return f"--mode {RAY_PD_MODE} serves Ray Serve LLM's own app, which checks no API keys: add --no-auth"
    return None


@dataclass
class _Run:
    """What one local run started, for its shutdown."""

    cluster: LocalCluster = field(default_factory=LocalCluster)
    prometheus: LocalPrometheus | None = None


def _serve(
    args: argparse.Namespace, run: _Run, stack: contextlib.ExitStack, hybrid: dict, keys: list[str], say: Any
) -> None:
    """Build the model, start the cluster, deploy, check each app, write the state file and
    print READY; then wait for the signal that stops the run."""
    from local.tiny_model import ensure_tiny_model

    auth = not args.no_auth
    api_key = keys[0] if auth else None
    say("building or loading the tiny model (random weights, local tokenizer)")
    model_dir = ensure_tiny_model()
    extras = _models_extras(args, stack, keys)
    if extras:
        say(f"local S3 with the tiny LoRA adapter at {extras['lora_path']} ({extras['adapter']})")
    config = render_config(args, model_dir, hybrid, extras)
    if "fallback" in hybrid:
        fb = hybrid["fallback"]
        say(f"fallback: {fb['baseUrl']} (model {fb['model']}); key from ${FALLBACK_API_KEY_ENV}")
    names = [a["name"] for a in config["applications"]]
    _start_cluster(args, run, extras, keys, say)
    cluster = run.cluster
    wait_dashboard(cluster.dashboard_url)
    say(
        f"cluster up, dashboard {cluster.dashboard_url}; deploying {', '.join(names)} "
        "(vLLM engines take about a minute on two cores)"
    )
    deploy(cluster.dashboard_url, config)
    wait_running(cluster.dashboard_url, names, timeout=args.timeout, progress=say)
    urls = app_urls(config, args.port)
    for mode, url in urls.items():
        for model in extras.get("models", [MODEL_ID])[:2]:  # a third starts on its first request
            say(f"test request through the {mode} app ({model})")
            smoke_request(url, api_key, model)
    if args.state_file:
        state = _state(
            args, model_dir, api_key, urls, cluster, config, {k: v for k, v in extras.items() if k != "s3_env"}
        )
        args.state_file.write_text(json.dumps(state, indent=2))
    # Ray's metrics export port on each node: Ray's, Serve's and vLLM's metrics (ray_vllm_*),
    # what Prometheus scrapes in the cloud (infra/k8s/monitoring.py).
    metrics = ", ".join(f"{n['label']} {n['metrics_url']}" for n in cluster.nodes())
    say(f"metrics (Prometheus text format): {metrics}")
    print(f"READY in {say.elapsed():.0f}s: {_ready_line(args.mode, urls, api_key, extras)}", flush=True)
    while True:
        time.sleep(3600)


def _start_cluster(args: argparse.Namespace, run: _Run, extras: dict[str, Any], keys: list[str], say: Any) -> None:
    say("starting a local Ray cluster: nodes labelled head, prefill, decode")
    env = {**ray_env_for(args.mode, stack_ray_env(args.data_plane)), **extras.get("s3_env", {})}
    if not args.no_auth:
        env[API_KEYS_ENV] = ",".join(keys)
    extra_prefill = args.prefill_replicas - 1
    if args.signals:
        # The Serve controller reads RAY_PROMETHEUS_HOST from its environment (Ray's
        # PrometheusQueryMixin); Prometheus itself starts once the nodes' ports are known.
        run.prometheus = LocalPrometheus(free_port())
        env[PROMETHEUS_HOST_ENV] = run.prometheus.url
        extra_prefill = max(extra_prefill, 1)  # room for a second prefill replica
    # The second model's engine runs on the decode node too.
    extra_decode = args.decode_replicas - 1 + (args.models - 1)
    run.cluster.start(env, extra_prefill=extra_prefill, extra_decode=extra_decode)
    if run.prometheus is not None:
        run.prometheus.start(run.cluster.nodes())
        if not run.prometheus.ready():
            raise DeployFailed(f"the local Prometheus did not start at {run.prometheus.url}")
        say(f"Prometheus at {run.prometheus.url} scrapes the nodes every {SCRAPE_S}s (per-role autoscaling signals)")
    # Ray's node code installs its own SIGTERM handler; ours decides how to stop.
    _stop_on_signals()


def _shutdown(args: argparse.Namespace, run: _Run, stack: contextlib.ExitStack, rc: int, say: Any) -> int:
    # A second Ctrl-C during shutdown must not leave Ray behind.
    for s in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(s, signal.SIG_IGN)
    run.cluster.shutdown()
    if run.prometheus is not None:
        run.prometheus.stop()
    stack.close()
    if rc == 0:
        deadline = time.monotonic() + 30
        while port_in_use(args.port) and time.monotonic() < deadline:
            time.sleep(0.5)
        if port_in_use(args.port):
            print(f"error: port {args.port} is still in use after shutdown", file=sys.stderr)
            return 1
        say(f"stopped; port {args.port} is free")
    return rc


class _Say:
    """Progress lines, each with the seconds since the start."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        _say(self.t0, msg)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = _Say()
    checked = _preflight(args)
    if isinstance(checked, str):
        print(f"error: {checked}", file=sys.stderr)
        return 1
    stack, hybrid = checked
    keys = list(parse_api_keys(os.environ.get(API_KEYS_ENV)))
    if not args.no_auth and not keys:
        keys = ["sk-local-" + secrets.token_urlsafe(18)]
    # Started in the background by a shell, SIGINT may arrive ignored: Ctrl-C must work.
    _stop_on_signals()
    run = _Run()
    rc = 0
    try:
        _serve(args, run, stack, hybrid, keys, say)
    except KeyboardInterrupt:
        print(flush=True)
        say("stopping: shutting Ray down")
    except (DeployFailed, TimeoutError, AlreadyRunning, PrometheusMissing) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        rc = 1
    except Exception:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        rc = _shutdown(args, run, stack, rc, say)
    return rc


if __name__ == "__main__":
    sys.exit(main())
