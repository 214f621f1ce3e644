"""What `make bench` and its siblings read from running targets, beside their load: the engines'
metrics once settled, Serve's applications and replicas, Serve's request spans, idle CPU.

What flows through here: Prometheus text from the nodes' metrics ports -> hops.Sample lists
(settled: scraped until the engines' counters stop moving); Serve's REST API -> app ->
{ingress, replicas per deployment} and each app's roles; Ray's span files -> hops.Span;
decode's NIXL counters -> totals; decode's prefill-path counter -> P/D requests per path and
level; the stack's process tree -> CPU use by process title.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench import cpu, hops, prefill_mode
from serving.core.metrics import PrefillPath
from serving.spec.base import KV_SCORER_DEPLOYMENT

if TYPE_CHECKING:
    from local.background import RunningStack


# --- metrics and spans around each level ------------------------------------------------------
def scrape(url: str) -> list[hops.Sample]:
    return hops.parse_prometheus(httpx.get(url, timeout=10).text)


def settled(
    urls: list[str], quiet_s: float = hops.SETTLED_QUIET_S, limit_s: float = 60
) -> dict[str, list[hops.Sample]]:
    """A scrape of every URL once the engines' counters stop moving for longer than one of
    Ray's export intervals (hops.SETTLED_QUIET_S)."""

    def counts(scrapes: dict[str, list[hops.Sample]]) -> list[float]:
        return [v for ss in scrapes.values() for n, _, v in ss if n.endswith("_count") and "vllm" in n]

    now = {u: scrape(u) for u in urls}
    since = t0 = time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(1)
        nxt = {u: scrape(u) for u in urls}
        if counts(nxt) != counts(now):
            since = time.monotonic()
        now = nxt
    return now


def serve_apps(dashboard_url: str) -> dict[str, dict[str, Any]]:
    """app -> {"ingress": deployment name, "replicas": deployment -> Serve replica ids}.

    The replica ids are the `ReplicaId` label Ray puts on the engines' vLLM metrics.
    """
    apps = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()["applications"]
    return {
        app: {
            # Serve's schema: ApplicationDetails.deployment_topology.ingress_deployment.
            "ingress": (a.get("deployment_topology") or {}).get("ingress_deployment")
            or next((d for d in a.get("deployments") or {} if "Ingress" in d), None),
            "replicas": {
                dep: [r["replica_id"] for r in d.get("replicas") or []]
                for dep, d in (a.get("deployments") or {}).items()
            },
        }
        for app, a in apps.items()
    }


def read_spans(since: float) -> list[hops.Span]:
    """Serve's span files written since `since` (Ray's file exporter: <session>/logs/serve/spans/)."""
    spans: list[hops.Span] = []
    for path in glob.glob("/tmp/ray/session_*/logs/serve/spans/*"):
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) >= since:
                spans.extend(hops.parse_spans(Path(path).read_text(errors="replace")))
    return spans


def roles(app: dict[str, Any]) -> tuple[str, str, str | None]:
    """(ingress, streaming engine, prefill or None) deployment names of one application."""
    ingress, deployments = app["ingress"], app["replicas"]
    prefill = next((d for d in deployments if d.startswith("Prefill")), None)
    engine = next(d for d in deployments if d not in (ingress, prefill, KV_SCORER_DEPLOYMENT))
    return ingress, engine, prefill


def stack_apps(stack: RunningStack) -> tuple[dict[str, str], dict[str, dict[str, Any]], dict[str, tuple[str, str]]]:
    """A running local stack's Ray apps: target (the app's mode; ray-pd: Ray's own P/D app) ->
    Serve app name, Serve's view of each app (serve_apps), and the CPU sampler's layout of
    their replicas."""
    from local.ray_pd import app_mode

    apps = {app_mode(c): c["name"] for c in stack.state["config"]["applications"]}
    served = serve_apps(stack.state["dashboard_url"])
    return apps, served, cpu.serve_layout({app: roles(served[app]) for app in apps.values()})


def idle_cpu(root_pid: int, seconds: float = 5) -> dict[str, float]:
    """CPU use (% of one core) of the stack's processes while no request is in flight, by title.

    The processes under `root_pid` (the `make serve` command: raylets, Serve replicas, vLLM
    engine cores and workers) grouped by their process title's first word, e.g.
    `ray::ServeReplica:llm:Decode:tiny-llama` or `VLLM::EngineCore`.
    """
    import psutil

    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(seconds)
    use: dict[str, float] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            title = (cmd[0] if cmd else p.name()).split(" ")[0]
            if title.endswith("python") or title.endswith("python3"):
                title = " ".join(cmd[1:3])[:60]
            use[title] = use.get(title, 0.0) + p.cpu_percent(None)
    return {k: round(v, 1) for k, v in sorted(use.items(), key=lambda kv: -kv[1]) if v >= 1.0}


# --- decode's NIXL counters ---------------------------------------------------------------------
KV_KEYS = ("nixl_bytes", "nixl_transfers", "nixl_xfer_s", "external_kv_tokens")


def kv_totals(samples: list[hops.Sample]) -> dict[str, float]:
    return {
        "nixl_bytes": hops.metric_total(samples, "ray_vllm_nixl_bytes_transferred_sum"),
        "nixl_transfers": hops.metric_total(samples, "ray_vllm_nixl_xfer_time_seconds_count"),
        "nixl_xfer_s": hops.metric_total(samples, "ray_vllm_nixl_xfer_time_seconds_sum"),
        "external_kv_tokens": hops.metric_total(
            samples,
            "ray_vllm_prompt_tokens_by_source_total",
            lambda labels: labels.get("source") == "external_kv_transfer",
        ),
    }


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def kv_line(kv: dict[str, Any]) -> str:
    """The KV transfer's figures as `make bench` prints them."""
    return (
        f"KV transfer over NIXL {kv['backend']} (decode's NIXL counters over the disaggregated requests): "
        f"{_num(kv['bytes_per_request'], 0)} bytes and {_num(kv['kv_tokens_per_request'], 1)} prompt tokens "
        f"per request; {_num(kv['xfer_ms_per_transfer'], 2)} ms per transfer ({int(kv['transfers'] or 0)} transfers)"
    )


# --- how the P/D requests were prefilled ----------------------------------------------------------
# The decode replicas' pd_prefill_path counter (serving/engines/pd_server.py: one count per
# request), read as bench/prefill_mode.py reads it for make chaos. A P/D figure is a P/D figure
# only for the requests prefill served: the decode server prefills on its own engine when the
# prefill hop fails or its KV is late.
def serving_mode(before: list[hops.Sample], after: list[hops.Sample]) -> dict[str, float]:
    """Requests per prefill path between two scrapes of the decode node: "remote",
    "remote_retry", and "local:<reason>" per reason. A series missing from the later scrape
    (Ray ages an idle series out) counts as unchanged."""
    delta = prefill_mode.path_delta(
        prefill_mode.series_counts([before]), prefill_mode.series_counts([after]), by_reason=True
    )
    out: dict[str, float] = {}
    for key, n in delta.items():
        path, reason = key.split("/", 1)
        name = f"{path}:{reason}" if path == PrefillPath.LOCAL.value else path
        if n > 0:
            out[name] = out.get(name, 0.0) + n
    return dict(sorted(out.items()))


def serving_mode_line(modes: dict[str, dict[str, float]]) -> str:
    """One line: per level, how many P/D requests prefill served, and what the others did."""
    parts = []
    for level, mode in modes.items():
        share, total = prefill_mode.share_of(mode)
        others = ", ".join(f"{k} {v:,.0f}" for k, v in mode.items() if k not in prefill_mode.REMOTE)
        head = "-" if share is None else f"{share:.0%} of {total:,.0f} remote"
        parts.append(f"c{level} {head}" + (f" ({others})" if others else ""))
    return "P/D requests prefilled by the prefill tier (decode's pd_prefill_path): " + "; ".join(parts)
