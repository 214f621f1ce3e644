"""e2e: decode scales out under load; a decode replica killed mid-stream, then decode scaled in
under streams: nothing cut.

On the shared local stack (decode autoscaled 1..2, local/config.py, one replica at the start):
streamed chat and completion clients (more than the autoscaling target) drive decode to two
replicas, and no request fails while it scales out; one decode replica is SIGKILLed while
every client is mid-stream (the one whose engine runs the most); then the load drops to a
few clients and decode scales back to one replica while they stream. That each fault landed
is asserted first (the killed replica ran streams and they were continued; the replica
scale-in removed ran streams), then the designed state, not status codes: every
stream ends with its finish reason, [DONE], no error event, and a usage block counting
exactly the tokens asked for (ignore_eos); the cut streams were continued
(`pd_stream_migrations`, outcome continued), none failed. The stack is left as found (one
decode replica). Disruptive: runs after the other e2e tests (tests/conftest.py). About four
minutes (two engine starts and Serve's downscale delay): `make test-long` runs it, and CI after
`make test`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from bench import replicas
from bench.sse import Streamed, stream_request
from local.config import LOCAL_DECODE_TARGET
from local.decode_autoscale import decode_replicas
from serving.core.metrics import STREAM_MIGRATIONS
from tests.serving.test_resilience_e2e import _metric_total_by

pytestmark = [pytest.mark.e2e, pytest.mark.disruptive, pytest.mark.long]

MIGRATIONS = STREAM_MIGRATIONS.prometheus
MAX_TOKENS = 192
# Bounds on how long the stack may take, not speed figures (`make chaos` measures those).
SCALE_OUT_WITHIN_S = 300
SCALE_IN_WITHIN_S = 240
# The replica scale-in removed must have run streams within this long before Serve stopped it.
BUSY_WINDOW_S = 20
BOTH_BUSY_WITHIN_S = 60
# Clients left while decode scales in: under one replica's target, so Serve keeps one replica,
# and enough that Serve's power-of-two router leaves neither of the two without a stream.
KEEP_CLIENTS = LOCAL_DECODE_TARGET * 3 // 4


class Clients:
    """N streamed clients, each sending one request after another until told to stop."""

    def __init__(self, stack, n: int):
        self.base = stack.urls["disaggregated"]
        self.headers = {"Authorization": f"Bearer {stack.api_key}"}
        self.model = stack.model
        self.results: list[tuple[str, Streamed]] = []
        self.stops = [asyncio.Event() for _ in range(n)]
        self.tasks: list[asyncio.Task] = []

    async def _run(self, i: int, client: httpx.AsyncClient) -> None:
        chat = i % 2 == 0
        common = {
            "model": self.model,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            url, body = (
                f"{self.base}/chat/completions",
                {**common, "messages": [{"role": "user", "content": "A story."}]},
            )
        else:
            url, body = f"{self.base}/completions", {**common, "prompt": "Once upon a time"}
        while not self.stops[i].is_set():
            got = await stream_request(client, url, body, headers=self.headers, timeout=httpx.Timeout(120, connect=10))
            self.results.append(("chat" if chat else "completions", got))

    async def __aenter__(self) -> Clients:
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        self.tasks = [asyncio.create_task(self._run(i, self._http)) for i in range(len(self.stops))]
        return self

    def stop(self, keep: int = 0) -> None:
        for ev in self.stops[keep:]:
            ev.set()

    async def __aexit__(self, *exc) -> None:
        self.stop()
        await asyncio.wait(self.tasks, timeout=180)
        await self._http.aclose()


async def _until(pred, within_s: float, what: str, seen: list, watch=None) -> None:
    from local.decode_autoscale import decode_replicas

    t = time.monotonic()
    while time.monotonic() - t < within_s:
        state = await asyncio.to_thread(decode_replicas, DASHBOARD[0])
        seen.append((round(time.monotonic() - t), *state))
        if watch is not None:
            await watch()
        if pred(*state):
            return
        await asyncio.sleep(1)
    raise AssertionError(f"{what} not reached within {within_s}s: (s, running, all) {seen[-8:]}")


DASHBOARD: list[str] = []


def test_decode_scales_out_under_load_and_a_death_and_scale_in_cut_no_stream(stack):
    DASHBOARD[:] = [stack.state["dashboard_url"]]
    assert decode_replicas(DASHBOARD[0]) == (1, 1), "the shared stack should start with one decode replica"
    killed_at: list[float] = []
    urls = [n["metrics_url"] for n in stack.nodes]
    before = _metric_total_by(stack, MIGRATIONS, "outcome")
    seen: list = []
    # Each decode replica's engine readings while Serve listed it RUNNING (Ray exports the gauge
    # every few seconds): did the replica scale-in removed run streams shortly before?
    readings: dict[str, list[tuple[float, float]]] = {}
    listed: list[dict] = []

    async def watch() -> None:
        listed[:] = await asyncio.to_thread(replicas.deployment_replicas, DASHBOARD[0], ":Decode:")
        running = await asyncio.to_thread(replicas.engine_running, urls)
        for r in listed:
            if r["state"] == "RUNNING" and r["replica_id"] in running:
                readings.setdefault(r["replica_id"], []).append((time.monotonic(), running[r["replica_id"]]))

    def busy_replicas() -> int:
        running = {r["replica_id"] for r in listed if r["state"] == "RUNNING"}
        return sum(1 for rid, got in readings.items() if rid in running and got[-1][1] > 0)

    def ran_streams_before_it_stopped(replica_id: str | None) -> bool:
        got = readings.get(replica_id or "") or []
        return any(v > 0 for t, v in got if t >= got[-1][0] - BUSY_WINDOW_S)

    async def scenario() -> tuple[list[tuple[str, Streamed]], Any, str | None]:
        async with Clients(stack, 3 * LOCAL_DECODE_TARGET) as load:
            await _until(lambda running, _all: running >= 2, SCALE_OUT_WITHIN_S, "2 running decode replicas", seen)
            # Both engines streaming for a while, so the replica killed has streams past their
            # first byte to continue (a fresh replica's first requests may all be before it,
            # and a stream cut there is retried, not migrated).
            await _until(lambda *_: busy_replicas() >= 2, BOTH_BUSY_WITHIN_S, "both engines busy", seen, watch)
            await asyncio.sleep(5)
            victims = replicas.replica_processes(stack.proc.pid, ":Decode:")
            assert len(victims) >= 2, f"expected two decode replica processes, found {len(victims)}"
            # The decode replica whose engine runs the most streams (as last exported).
            victim, _, _ = await replicas.busiest_replica(
                DASHBOARD[0], urls, stack.proc.pid, ":Decode:", within_s=20, want_busy=1
            )
            assert victim is not None, "no decode replica of the stack listed by Serve"
            killed_at.append(time.monotonic())
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.sleep(10)
            # Decode whole again, so scale-in chooses between two replicas that serve streams
            # (not the replacement still starting, which Serve would stop first).
            await replicas.wait_healthy(DASHBOARD[0], ":Decode:", 2, SCALE_OUT_WITHIN_S, dead_pid=victim.pid)
            # The replacement takes new requests only as streams end: wait until both engines
            # run streams before the load drops, or scale-in may remove one that ran none.
            await _until(lambda *_: busy_replicas() >= 2, BOTH_BUSY_WITHIN_S, "both decode engines busy", seen, watch)
            # A few clients stay: decode scales in to one replica while they stream.
            load.stop(keep=KEEP_CLIENTS)
            await watch()
            ids = [r["replica_id"] for r in listed if r["state"] == "RUNNING"]
            await _until(
                lambda running, all_: running == 1 and all_ == 1,
                SCALE_IN_WITHIN_S,
                "one decode replica",
                seen,
                watch=watch,
            )
            await asyncio.sleep(3)
        return load.results, victim, replicas.removed_replica(ids, listed)

    results, victim, removed = asyncio.run(scenario())
    assert results, "no stream finished"
    # Scaling out under load failed no request: each one that ended before the kill is whole.
    scaling_out = [r for _, r in results if r.end <= killed_at[0]]
    assert scaling_out, "no stream ended while decode scaled out"
    assert all(r.ok for r in scaling_out), [r.kind for r in scaling_out if not r.ok][:5]
    # The faults landed first. The kill cut streams, and each of them was continued on the
    # other replica; the replica scale-in removed ran streams shortly before Serve stopped it.
    assert victim.running, f"the killed decode replica ran no request at the kill: {victim}"
    deadline = time.monotonic() + 60
    after = before
    while time.monotonic() < deadline:
        after = _metric_total_by(stack, MIGRATIONS, "outcome")
        if after.get("continued", 0) > before.get("continued", 0):
            break
        time.sleep(3)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("continued", 0) >= 1, f"no continued migration counted: {delta}"
    assert removed is not None and ran_streams_before_it_stopped(removed), (
        f"the decode replica scale-in removed ({removed}) ran no stream in the {BUSY_WINDOW_S}s "
        f"before it stopped: {readings.get(removed or '')}"
    )
    # Then nothing broke.
    # 24 clients on the one replica left after the kill may meet Serve's admission bound: a
    # request refused before its first byte gets the designed 503 + Retry-After (the overload
    # tests cover it). A stream that started must end complete.
    refused = [r for _, r in results if r.status == 503 and r.retry_after and "overloaded" in (r.error or "")]
    bad = []
    for kind, r in results:
        if any(r is x for x in refused):
            continue
        finish = r.usage and r.usage.get("completion_tokens")
        if not r.ok or finish != MAX_TOKENS:
            bad.append((kind, r.kind, r.usage, r.error_event, r.error))
    assert not bad, f"{len(bad)} of {len(results)} streams cut or short: {bad[:4]}"
    assert len(refused) < len(results) / 10, f"{len(refused)} of {len(results)} refused"
    assert not delta.get("failed") and not delta.get("not_migratable"), delta
