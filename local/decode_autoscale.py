"""Watch the local stack's decode role scale out under load and back in when idle.

What flows through here: a running local stack (dashboard URL, OpenAI URL, key, model) ->
streamed completions from `clients` concurrent clients, each request long (ignore_eos), until
Serve reports a second decode replica RUNNING -> the load stops -> polling until one decode
replica is left -> `ScalingRun`: both delays, the replica counts seen, request outcomes.
Used by `make bench` (bench/decode_autoscale.py); local-only (never packaged).

Scale-out delay = from the first request to the second replica RUNNING (Serve's decision
after upscaleDelayS, plus a vLLM engine start on CPU). Scale-in delay = from the last request
to one replica left (downscaleDelayS after Serve's look-back window drains).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from serving.spec import APP_NAME


@dataclass
class ScalingRun:
    clients: int
    scale_out_s: float | None = None  # first request -> 2 decode replicas RUNNING
    decision_s: float | None = None  # first request -> Serve starts a 2nd replica
    scale_in_s: float | None = None  # load stopped -> 1 decode replica
    max_running: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    errors: list[str] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, running, all)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_replicas(dashboard_url: str, app: str = APP_NAME) -> tuple[int, int]:
    """(RUNNING, all) replicas of the decode deployment of `app`, from Serve's REST API."""
    status = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()
    deployments = ((status.get("applications") or {}).get(app) or {}).get("deployments") or {}
    decode = [d for name, d in deployments.items() if "decode" in name.lower()]
    if len(decode) != 1:
        raise RuntimeError(f"expected one decode deployment in {app!r}, found {sorted(deployments)}")
    replicas = decode[0].get("replicas") or []
    return sum(1 for r in replicas if r.get("state") == "RUNNING"), len(replicas)


async def _client(url: str, headers: dict, model: str, max_tokens: int, stop: asyncio.Event, run: ScalingRun) -> None:
    body = {
        "model": model,
        "prompt": "Tell me a long story.",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as r:
                    async for _ in r.aiter_bytes():
                        pass
                    if r.status_code == 200:
                        run.requests_ok += 1
                    else:
                        run.requests_failed += 1
                        run.errors.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                run.requests_failed += 1
                run.errors.append(repr(exc)[:200])


async def _measure(
    dashboard_url: str,
    base_url: str,
    api_key: str | None,
    model: str,
    *,
    clients: int,
    max_tokens: int,
    out_timeout: float,
    in_timeout: float,
) -> ScalingRun:
    run = ScalingRun(clients=clients)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stop = asyncio.Event()
    t0 = time.monotonic()

    def sample() -> tuple[int, int]:
        running, total = decode_replicas(dashboard_url)
        run.timeline.append((round(time.monotonic() - t0, 1), running, total))
        run.max_running = max(run.max_running, running)
        return running, total

    tasks = [asyncio.create_task(_client(base_url, headers, model, max_tokens, stop, run)) for _ in range(clients)]
    try:
        while time.monotonic() - t0 < out_timeout:
            running, total = await asyncio.to_thread(sample)
            if total >= 2 and run.decision_s is None:
                run.decision_s = time.monotonic() - t0
            if running >= 2:
                run.scale_out_s = time.monotonic() - t0
                break
            await asyncio.sleep(1)
    finally:
        stop.set()
        # Requests in flight finish (they are counted); new ones are not sent.
        await asyncio.wait(tasks, timeout=120)
        for t in tasks:
            t.cancel()
    t_stop = time.monotonic()
    if run.scale_out_s is None:
        return run
    while time.monotonic() - t_stop < in_timeout:
        running, total = await asyncio.to_thread(sample)
        if total == 1 and running == 1:
            run.scale_in_s = time.monotonic() - t_stop
            break
        await asyncio.sleep(1)
    return run


def measure_decode_scaling(
    dashboard_url: str,
    base_url: str,
    api_key: str | None,
    model: str,
    *,
    clients: int = 24,
    max_tokens: int = 384,
    out_timeout: float = 300,
    in_timeout: float = 180,
) -> ScalingRun:
    """Drive load until decode has 2 RUNNING replicas, stop, wait for 1 (see module doc)."""
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(
            _measure(
                dashboard_url,
                base_url,
                api_key,
                model,
                clients=clients,
                max_tokens=max_tokens,
                out_timeout=out_timeout,
                in_timeout=in_timeout,
            )
        )
    raise KeyboardInterrupt
