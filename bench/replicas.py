"""The local stack's Serve replicas, seen from outside: their processes (under the stack's own
process tree, so only what this run started is ever signalled) and their states from Serve's
REST API, for the chaos scenarios that kill one and wait for Serve to replace it.

What flows through here: the stack's root pid and a deployment marker (":Prefill:") -> the
replica processes; the dashboard URL -> {deployment: [{state, pid, replica_id}]} -> seconds
until the deployment is whole again without the killed pid; with the nodes' metrics pages,
the engines' running requests by replica (Ray labels vLLM's metrics with `ReplicaId`, Serve's
replica_id) -> the replica of the deployment whose engine runs the most (the victim).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from bench import hops

# vLLM's gauge of the requests its engine is running, as Ray re-exports it.
RUNNING = "ray_vllm_num_requests_running"


# --- the victim -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Victim:
    replica_id: str
    pid: int
    running: float | None  # requests its engine ran at the last reading; None: no engine reading


def choose_victim(candidates: Iterable[Mapping[str, Any]], running: Mapping[str, float]) -> Victim | None:
    """The candidate ({replica_id, pid}) whose engine runs the most requests; a replica with no
    reading (no engine, e.g. the ingress) ranks below any reading; ties go to the lower pid."""
    found = [
        Victim(c["replica_id"], c["pid"], running.get(c["replica_id"]))
        for c in sorted(candidates, key=lambda c: c["pid"])
    ]
    return max(found, key=lambda v: -1.0 if v.running is None else v.running, default=None)


def busy(candidates: Iterable[Mapping[str, Any]], running: Mapping[str, float]) -> int:
    """How many of the candidates' engines run at least one request."""
    return sum(1 for c in candidates if running.get(c["replica_id"], 0) > 0)


def removed_replica(before: Iterable[str], now: Iterable[Mapping[str, Any]]) -> str | None:
    """The first replica id of `before` that Serve no longer lists as RUNNING (stopping or gone)."""
    running = {r["replica_id"] for r in now if r.get("state") == "RUNNING"}
    return next((rid for rid in before if rid not in running), None)


def descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def replica_processes(root_pid: int, marker: str) -> list[Any]:
    """Serve replica processes under our stack whose title names `marker` (e.g. ':Prefill:')."""
    out = []
    for p in descendants(root_pid):
        try:
            title = " ".join(p.cmdline())
        except Exception:
            continue
        if title.startswith("ray::ServeReplica:") and marker in title:
            out.append(p)
    return out


def engine_rss_mb(root_pid: int) -> dict[str, float]:
    """RSS (MB) of the engine side: Serve replica and vLLM processes under our stack."""
    out: dict[str, float] = {}
    for p in descendants(root_pid):
        try:
            title = " ".join(p.cmdline())
            if title.startswith("ray::ServeReplica:") or "VLLM" in title or "EngineCore" in title:
                out[f"{p.pid}:{title[:60]}"] = p.memory_info().rss / 2**20
        except Exception:
            continue
    return out


def replicas(dashboard_url: str) -> dict[str, list[dict[str, Any]]]:
    """{deployment: [{state, pid}, ...]} of every application, from Serve's REST API."""
    r = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=30).json()
    out: dict[str, list[dict[str, Any]]] = {}
    for app in (r.get("applications") or {}).values():
        for name, dep in (app.get("deployments") or {}).items():
            out[name] = [
                {"state": rep.get("state"), "pid": rep.get("pid"), "replica_id": rep.get("replica_id")}
                for rep in dep.get("replicas") or []
            ]
    return out


def deployment_replicas(dashboard_url: str, marker: str) -> list[dict[str, Any]]:
    """The replicas (any state) of the deployment named like `marker`, as Serve lists them."""
    key = marker.strip(":")
    return [r for name, reps in replicas(dashboard_url).items() if key in name for r in reps]


def running_replicas(dashboard_url: str, marker: str) -> list[dict[str, Any]]:
    """The RUNNING replicas of the deployment named like `marker`."""
    return [r for r in deployment_replicas(dashboard_url, marker) if r["state"] == "RUNNING"]


def engine_running(metrics_urls: list[str]) -> dict[str, float]:
    """{replica_id: requests running in its engine}, as last exported (Ray exports every few
    seconds, so a reading lags the engine by up to one interval)."""
    return hops.scrape_by_label(metrics_urls, RUNNING, "ReplicaId")


async def busiest_replica(
    dashboard_url: str, metrics_urls: list[str], root_pid: int, marker: str, *, within_s: float, want_busy: int = 1
) -> tuple[Victim | None, list[dict[str, Any]], dict[str, float]]:
    """(victim, the deployment's replicas, the engine readings): the replica of the deployment
    whose engine runs the most requests, waiting up to `within_s` until `want_busy` of them
    run some. Only replicas whose process descends from the stack are candidates."""
    ours = {p.pid for p in replica_processes(root_pid, marker)}
    deadline = time.monotonic() + within_s
    while True:
        try:
            reps = await asyncio.to_thread(running_replicas, dashboard_url, marker)
        except httpx.HTTPError:  # a busy dashboard: ask again
            reps = []
        cands = [r for r in reps if r["pid"] in ours]
        running = {k: v for k, v in (await asyncio.to_thread(engine_running, metrics_urls)).items() if k}
        if (cands and busy(cands, running) >= want_busy) or time.monotonic() >= deadline:
            return choose_victim(cands, running), cands, running
        await asyncio.sleep(0.5)


async def wait_healthy(
    dashboard_url: str, marker: str, want: int, timeout: float, dead_pid: int | None = None
) -> float:
    """Seconds until the deployment named like `marker` has `want` RUNNING replicas again,
    none of them the killed process (Serve still lists it as RUNNING for a while)."""
    t = time.monotonic()
    key = marker.strip(":")
    seen: Any = None
    while time.monotonic() - t < timeout:
        try:
            deps = await asyncio.to_thread(replicas, dashboard_url)
        except httpx.HTTPError:  # a busy dashboard: ask again
            await asyncio.sleep(1)
            continue
        for name, reps in deps.items():
            if key not in name:
                continue
            seen = reps
            running = [r for r in reps if r["state"] == "RUNNING" and r["pid"] != dead_pid]
            if len(running) >= want and len(reps) == len(running):
                return time.monotonic() - t
        await asyncio.sleep(1)
    raise TimeoutError(f"{key} not healthy {timeout:.0f}s after the fault: {seen}")
