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
import copy
import errno
import fcntl
import json
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from serving.spec import (
    API_KEYS_ENV,
    APP_NAME,
    DEFAULT_LABEL_KEY,
    Mode,
    ServingSpec,
    Target,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 1024
AGGREGATED_APP = f"{APP_NAME}-aggregated"
AGGREGATED_PREFIX = "/aggregated"
HOST = "127.0.0.1"
MODES = ("disaggregated", "aggregated", "both")

# Logical CPUs per node. Ray only counts them (the OS shares the real cores); each engine
# replica takes 2 (its actor plus the vLLM worker bundle). The head offers none, as in the
# cloud: the ingress, proxy and controller ask for no CPU.
HEAD_CPUS = 0
PREFILL_CPUS = 2
DECODE_CPUS = 4


# --- what gets deployed ------------------------------------------------------------------
def local_spec(mode: Mode, model_dir: Path, *, auth: bool = True) -> ServingSpec:
    """The spec a stack file would hold, with CPU-friendly values."""
    return ServingSpec.model_validate(
        {
            "model": {
                "id": MODEL_ID,
                "source": str(model_dir),
                "dtype": "float32",
                "maxModelLen": MAX_MODEL_LEN,
            },
            "mode": mode.value,
            "auth": "api-key" if auth else "disabled",
            # One ingress replica: a second would only compete for the same two cores.
            "ingress": {"minReplicas": 1, "maxReplicas": 1},
            # No CUDA graphs on CPU.
            "engineKwargs": {"enforce_eager": True},
        }
    )


def local_target() -> Target:
    """CPU target: vLLM's CPU KV-cache size and thread binding, nothing else."""
    return Target(
        accelerator_type=None,
        engine_env={
            # GiB of KV cache per engine; the tiny model needs far less.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Several engines share these cores, and each NIXL worker keeps a UCX progress
            # thread busy: pinning ('auto', or a core list) stacks them onto the same
            # cores and made decode ~9x slower per token here. Let the OS place threads.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        },
    )


def render_local_config(
    mode: str, model_dir: Path, *, port: int, auth: bool = True, target: Target | None = None
) -> dict[str, Any]:
    """The Serve config to deploy locally: serve_config() plus the local overrides."""
    target = target or local_target()
    modes = [Mode.DISAGGREGATED, Mode.AGGREGATED] if mode == "both" else [Mode(mode)]
    configs = [local_spec(m, model_dir, auth=auth).serve_config(target, port=port) for m in modes]
    config = copy.deepcopy(configs[0])
    config["http_options"]["host"] = HOST
    if mode == "both":
        agg = configs[1]["applications"][0]
        agg["name"] = AGGREGATED_APP
        agg["route_prefix"] = AGGREGATED_PREFIX
        config["applications"].append(agg)
    return config


def app_urls(config: dict[str, Any], port: int) -> dict[str, str]:
    """OpenAI base URL (…/v1) of each application, by its mode."""
    urls = {}
    for app in config["applications"]:
        prefix = app["route_prefix"].rstrip("/")
        urls[app["args"]["mode"]] = f"http://{HOST}:{port}{prefix}/v1"
    return urls


# --- one instance per port -------------------------------------------------------------
class AlreadyRunning(RuntimeError):
    pass


def _cache_dir() -> Path:
    from serving.tiny_model import default_cache_dir

    return default_cache_dir()


@contextlib.contextmanager
def instance_lock(port: int, lock_dir: Path | None = None):
    """Hold `<cache>/serve-<port>.lock` for the life of the run; refuse a second one.

    flock is released by the kernel when the process dies, so a crashed run never leaves
    a stale lock behind.
    """
    lock_dir = lock_dir or _cache_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / f"serve-{port}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
            raise AlreadyRunning(
                f"a local serving stack is already running on port {port} ({holder}); "
                "stop it with Ctrl-C in its terminal, or pick another port: make serve PORT=8001"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --- the local cluster ---------------------------------------------------------------------
@dataclass
class LocalCluster:
    """Three Ray nodes on this machine, labelled like the cloud's worker groups."""

    label_key: str = DEFAULT_LABEL_KEY
    dashboard_port: int = field(default_factory=free_port)
    _cluster: Any = None

    def start(self, env: dict[str, str]) -> None:
        # Workers inherit the environment of the raylets, which inherit ours.
        os.environ.update(env)
        import logging

        from ray.cluster_utils import Cluster

        # Ray's INFO lines (address files, draining) would bury the progress lines.
        logging.getLogger("ray").setLevel(logging.WARNING)
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": HEAD_CPUS,
                "labels": {self.label_key: "head"},
                "include_dashboard": True,
                "dashboard_host": HOST,
                "dashboard_port": self.dashboard_port,
            },
        )
        self._cluster.add_node(num_cpus=PREFILL_CPUS, labels={self.label_key: "prefill"})
        self._cluster.add_node(num_cpus=DECODE_CPUS, labels={self.label_key: "decode"})
        self._cluster.wait_for_nodes()

    @property
    def gcs_address(self) -> str:
        return self._cluster.address

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.dashboard_port}"

    def nodes(self) -> list[dict[str, Any]]:
        """Alive nodes: id, label, metrics URL (Ray's Prometheus endpoint, vLLM metrics too)."""
        out = []
        for n in self._cluster.global_state.node_table():
            if not n.get("Alive"):
                continue
            out.append(
                {
                    "node_id": n["NodeID"],
                    "label": (n.get("Labels") or {}).get(self.label_key),
                    "metrics_url": f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics",
                }
            )
        return out

    def shutdown(self) -> None:
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None


def wait_dashboard(url: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/api/serve/applications/", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray dashboard at {url} did not answer within {timeout:.0f}s")
        time.sleep(1)


def deploy(dashboard_url: str, config: dict[str, Any]) -> None:
    """PUT the Serve config to the dashboard, as KubeRay does with serveConfigV2."""
    import httpx

    r = httpx.put(f"{dashboard_url}/api/serve/applications/", json=config, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"Serve rejected the config ({r.status_code}): {r.text[:2000]}")


class DeployFailed(RuntimeError):
    pass


def wait_running(
    dashboard_url: str,
    names: Iterable[str],
    *,
    timeout: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Poll Serve's status until every application RUNS; report each change once."""
    import httpx

    names = list(names)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    last_news = time.monotonic()
    while True:
        status = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()
        apps = status.get("applications") or {}
        for name in names:
            app = apps.get(name)
            if not app:
                continue
            if app["status"] in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise DeployFailed(f"application {name!r} is {app['status']}: {app.get('message', '')}")
            for dname, dep in (app.get("deployments") or {}).items():
                replicas = dep.get("replicas") or []
                running = sum(1 for r in replicas if r.get("state") == "RUNNING")
                line = f"{name}/{dname}: {dep['status'].lower()} ({running}/{max(1, len(replicas))} replicas running)"
                if seen.get(f"{name}/{dname}") != line:
                    seen[f"{name}/{dname}"] = line
                    progress(line)
                    last_news = time.monotonic()
        if time.monotonic() - last_news > 15:
            waiting = [k for k, v in seen.items() if "healthy" not in v]
            progress(f"still starting: waiting for {', '.join(waiting) or 'Serve'}")
            last_news = time.monotonic()
        if names and all((apps.get(n) or {}).get("status") == "RUNNING" for n in names):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout:.0f}s: {seen}")
        time.sleep(2)


def smoke_request(base_url: str, api_key: str | None, model: str, timeout: float = 120) -> None:
    """One short completion through the app: the engines and KV transfer really answer."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(
                f"{base_url}/completions",
                json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                headers=headers,
                timeout=60,
            )
            if r.status_code == 200:
                return
            err = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            err = repr(exc)
        if time.monotonic() > deadline:
            raise DeployFailed(f"test request to {base_url} failed: {err}")
        time.sleep(2)


# --- running the command in the background (tests, make bench) ------------------------------
@dataclass
class RunningStack:
    """A `python -m serving.local` subprocess that has printed its ready line."""

    proc: Any
    port: int
    state: dict[str, Any]
    ready_line: str
    output: list[str]

    @property
    def urls(self) -> dict[str, str]:
        return self.state["urls"]

    @property
    def api_key(self) -> str | None:
        return self.state["api_key"]

    @property
    def model(self) -> str:
        return self.state["model"]

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return self.state["nodes"]

    def stop(self, timeout: float = 120) -> int:
        """Ctrl-C, as a person would; wait for Ray to go down. Returns the exit status."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def background_stack(
    *,
    mode: str = "both",
    port: int | None = None,
    api_key: str | None = "sk-local-test",
    log_path: Path | None = None,
    timeout: float = 600,
):
    """Start `python -m serving.local` in a subprocess, yield once it is ready, stop it after."""
    import subprocess
    import tempfile
    import threading

    port = port or free_port()
    tmp = Path(tempfile.mkdtemp(prefix="pd-serve-"))
    state_file = tmp / "state.json"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "serving.local", "--port", str(port), "--mode", mode,
           "--state-file", str(state_file), "--timeout", str(timeout)]
    if api_key:
        env[API_KEYS_ENV] = api_key
    else:
        env.pop(API_KEYS_ENV, None)
        cmd.append("--no-auth")
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1,
    )
    output: list[str] = []
    ready = threading.Event()
    log = open(log_path or tmp / "serve.log", "a", buffering=1)

    def pump():
        # Keep draining the pipe for the life of the process, or it would block on writes.
        for line in proc.stdout:
            output.append(line)
            log.write(line)
            if line.startswith("READY"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    running = RunningStack(proc=proc, port=port, state={}, ready_line="", output=output)
    try:
        if not ready.wait(timeout + 60) or proc.poll() is not None or not state_file.exists():
            tail = "".join(output[-60:])
            raise RuntimeError(f"`{' '.join(cmd)}` did not become ready (exit {proc.poll()}):\n{tail}")
        running.state = json.loads(state_file.read_text())
        running.ready_line = next(line for line in output if line.startswith("READY"))
        yield running
    finally:
        running.stop()
        log.close()


# --- the command ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m serving.local",
        description="Run the disaggregated prefill/decode OpenAI API locally on CPU with a tiny model.",
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    p.add_argument("--mode", choices=MODES, default="disaggregated",
                   help="disaggregated (prefill+decode, default), aggregated (one engine), "
                        f"or both (disaggregated at /, aggregated at {AGGREGATED_PREFIX})")
    p.add_argument("--no-auth", action="store_true",
                   help=f"serve without API keys (default: keys from ${API_KEYS_ENV}, or a generated one)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for ready (default 600)")
    p.add_argument("--state-file", type=Path, default=None,
                   help="write URLs, key and node metrics endpoints as JSON here once ready")
    return p.parse_args(argv)


def _stop_on_sigterm(signum, frame):
    # SIGTERM stops the stack the same way Ctrl-C does.
    raise KeyboardInterrupt


def _say(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:5.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    say = lambda msg: _say(t0, msg)  # noqa: E731

    # Refuse a second run before anything heavy is imported or started.
    if port_in_use(args.port):
        print(f"error: port {args.port} on {HOST} is already in use (another `make serve`?); "
              "stop it or choose another port: make serve PORT=8001", file=sys.stderr)
        return 1
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(instance_lock(args.port))
    except AlreadyRunning as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    auth = not args.no_auth
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if auth and not keys:
        keys = ["sk-local-" + secrets.token_urlsafe(18)]
    api_key = keys[0] if auth else None

    # Started in the background by a shell, SIGINT may arrive ignored: Ctrl-C must work.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    cluster = LocalCluster()
    rc = 0
    try:
        from serving.tiny_model import ensure_tiny_model

        say("building or loading the tiny model (random weights, local tokenizer)")
        model_dir = ensure_tiny_model()
        config = render_local_config(args.mode, model_dir, port=args.port, auth=auth)
        names = [a["name"] for a in config["applications"]]

        say("starting a local Ray cluster: nodes labelled head, prefill, decode")
        env = {
            "RAY_AUTH_MODE": "disabled",  # local-only cluster on 127.0.0.1
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            # Nothing may be downloaded: the model is on disk.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "DO_NOT_TRACK": "1",
        }
        if auth:
            env[API_KEYS_ENV] = ",".join(keys)
        cluster.start(env)
        # Ray's node code installs its own SIGTERM handler; ours decides how to stop.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        wait_dashboard(cluster.dashboard_url)
        say(f"cluster up, dashboard {cluster.dashboard_url}; deploying {', '.join(names)} "
            "(vLLM engines take about a minute on two cores)")
        deploy(cluster.dashboard_url, config)
        wait_running(cluster.dashboard_url, names, timeout=args.timeout, progress=say)
        urls = app_urls(config, args.port)
        for mode, url in urls.items():
            say(f"test request through the {mode} app")
            smoke_request(url, api_key, MODEL_ID)

        if args.state_file:
            state = {
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
            }
            args.state_file.write_text(json.dumps(state, indent=2))

        base = urls.get("disaggregated") or urls["aggregated"]
        also = f" (aggregated app at {urls['aggregated']})" if len(urls) > 1 else ""
        auth_header = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
        key_note = f" api key: {api_key} |" if api_key else " auth: off |"
        body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello!"}],
                           "max_tokens": 32})
        print(
            f"READY in {time.monotonic() - t0:.0f}s: {'aggregated' if args.mode == 'aggregated' else 'disaggregated'} OpenAI API at {base}{also} | model: "
            f"{MODEL_ID} |{key_note} try: curl -s {base}/chat/completions{auth_header} "
            f"-H 'Content-Type: application/json' -d '{body}' | Ctrl-C stops",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print(flush=True)
        say("stopping: shutting Ray down")
    except (DeployFailed, TimeoutError, AlreadyRunning) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        rc = 1
    except Exception:  # noqa: BLE001 - report, then still shut Ray down
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        # A second Ctrl-C during shutdown must not leave Ray behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.shutdown()
        stack.close()
        if rc == 0:
            deadline = time.monotonic() + 30
            while port_in_use(args.port) and time.monotonic() < deadline:
                time.sleep(0.5)
            if port_in_use(args.port):
                print(f"error: port {args.port} is still in use after shutdown", file=sys.stderr)
                rc = 1
            else:
                say(f"stopped; port {args.port} is free")
    return rc


if __name__ == "__main__":
    sys.exit(main())
