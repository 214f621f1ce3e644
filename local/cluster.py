"""The local Ray cluster and the Serve REST calls that deploy to it, as KubeRay does.

What flows through here: an environment -> three Ray nodes on this machine labelled like the
cloud's worker groups (head, prefill, decode) -> the Serve config PUT to the dashboard's REST
API -> status polled until every application runs (one progress line per change) -> one test
request through each app.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from local.config import DECODE_CPUS, HEAD_CPUS, HOST, PREFILL_CPUS
from local.procs import free_port, stop_haproxy
from serving.spec import DEFAULT_LABEL_KEY, LOG_MONITOR


# --- the local cluster ---------------------------------------------------------------------
@dataclass
class LocalCluster:
    """Three Ray nodes on this machine, labelled like the cloud's worker groups."""

    label_key: str = DEFAULT_LABEL_KEY
    dashboard_port: int = field(default_factory=free_port)
    # Logical CPUs of the decode node: two per engine replica (the prefix-routing bench runs four).
    decode_cpus: int = DECODE_CPUS
    _cluster: Any = None

    def start(self, env: dict[str, str], extra_prefill: int = 0, extra_decode: int = 0) -> None:
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
                # As every cloud pod (serving.spec.base.LOG_MONITOR); Ray starts the other
                # local nodes without one (ray.cluster_utils: one per physical host).
                "include_log_monitor": LOG_MONITOR,
            },
        )
        # Each engine replica beyond the first needs its 2 logical CPUs on its role's node.
        self._cluster.add_node(num_cpus=PREFILL_CPUS + 2 * extra_prefill, labels={self.label_key: "prefill"})
        self._cluster.add_node(num_cpus=self.decode_cpus + 2 * extra_decode, labels={self.label_key: "decode"})
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
        """Ray down, and the HAProxy processes Serve started on its nodes (they outlive the
        actors that Ray kills at shutdown)."""
        if self._cluster is not None:
            try:
                node_ids = [n["node_id"] for n in self.nodes()]
            except Exception:  # the GCS is already gone: every leftover HAProxy is ours
                node_ids = [""]
            self._cluster.shutdown()
            self._cluster = None
            stop_haproxy(node_ids)


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


def set_ingress_user_config(
    dashboard_url: str, config: dict[str, Any], app: str, user_config: dict[str, Any], timeout: float = 120
) -> None:
    """PUT `config` (the stack's own Serve config) with app `app`'s ingress user_config
    replaced (Serve's lightweight update: no engine restarts); return once every ingress
    replica runs with it."""
    import copy

    import httpx

    from serving.spec import INGRESS_DEPLOYMENT

    config = copy.deepcopy(config)
    for entry in config["applications"]:
        if entry["name"] == app:
            others = [d for d in entry.get("deployments", []) if d["name"] != INGRESS_DEPLOYMENT]
            entry["deployments"] = [*others, {"name": INGRESS_DEPLOYMENT, "user_config": user_config}]
    deploy(dashboard_url, config)
    deadline = time.monotonic() + timeout
    while True:
        apps = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()["applications"]
        dep = apps[app]["deployments"][INGRESS_DEPLOYMENT]
        if (
            dep["deployment_config"].get("user_config") == user_config
            and dep["status"] == "HEALTHY"
            and all(r["state"] == "RUNNING" for r in dep["replicas"])
        ):
            time.sleep(1)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {app} ingress did not take the new user_config: {dep['status']}")
        time.sleep(0.5)


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
        try:
            status = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=30).json()
        except httpx.HTTPError:
            # A busy machine (engines starting on two cores) can keep the dashboard from
            # answering for a while: that is no reason to give up; the deadline below is.
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
            continue
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
