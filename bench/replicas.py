"""The local stack's Serve replicas, seen from outside: their processes (under the stack's own
process tree, so only what this run started is ever signalled) and their states from Serve's
REST API, for the chaos scenarios that kill one and wait for Serve to replace it.

What flows through here: the stack's root pid and a deployment marker (":Prefill:") -> the
replica processes; the dashboard URL -> {deployment: [{state, pid}]} -> seconds until the
deployment is whole again without the killed pid.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


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
            out[name] = [{"state": rep.get("state"), "pid": rep.get("pid")} for rep in dep.get("replicas") or []]
    return out


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
