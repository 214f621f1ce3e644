"""Faults and overload on the shared local stack (shortened `make chaos` scenarios).

Both tests are disruptive: they run after the other e2e tests (tests/serving/conftest.py
orders them) and wait until the stack is healthy again before returning. They reuse the
chaos harness (bench/chaos.py), so the figures here and in `make chaos` are measured alike.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from bench import chaos, hops
from serving.resilience import METRICS, Reason

pytestmark = [pytest.mark.e2e, pytest.mark.disruptive]

# Ray exports a Serve Counter named N as ray_N_total.
METRIC = f"ray_{METRICS['local_prefill']}_total"


def _metric_total(stack, name: str) -> dict[str, float]:
    """{reason: value} of a Ray-exported counter, summed over the nodes' metrics endpoints."""
    out: dict[str, float] = {}
    for node in stack.nodes:
        try:
            text = httpx.get(node["metrics_url"], timeout=10).text
        except httpx.HTTPError:
            continue
        for series, labels, value in hops.parse_prometheus(text):
            if series == name:
                reason = labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + value
    return out


def test_prefill_killed_under_streamed_load_costs_no_request(stack):
    url = stack.urls["disaggregated"] + "/chat/completions"
    dashboard = stack.state["dashboard_url"]

    async def scenario():
        t0 = time.monotonic()
        async with chaos.Load(url, stack.api_key, 4, t0, model=stack.model) as load:
            await asyncio.sleep(5)
            victims = chaos.replica_processes(stack.proc.pid, ":Prefill:")
            assert victims, "no prefill replica process under the stack"
            os.kill(victims[0].pid, signal.SIGKILL)
            fault_at = time.monotonic() - t0
            await asyncio.sleep(12)  # requests keep flowing while prefill is gone
        return load.outcomes, fault_at, victims[0].pid

    outcomes, fault_at, dead = asyncio.run(scenario())
    try:
        during = [o for o in outcomes if o.start >= fault_at]
        failed = [o for o in outcomes if not o.ok]
        assert during, "no request was sent after the kill"
        assert not failed, f"{len(failed)} of {len(outcomes)} failed: {[o.kind for o in failed]}"
        # Counted with its reason, on Ray's metrics endpoint (exported every few seconds).
        deadline = time.monotonic() + 60
        fallbacks: dict[str, float] = {}
        while time.monotonic() < deadline and not sum(fallbacks.values()):
            time.sleep(5)
            fallbacks = _metric_total(stack, METRIC)
        assert sum(fallbacks.values()) >= 1, f"no local-prefill fallback counted in {METRIC}"
        assert set(fallbacks) <= {r.value for r in Reason}, fallbacks
    finally:
        # Leave the shared stack as we found it: the prefill replica running again.
        asyncio.run(chaos.wait_healthy(dashboard, ":Prefill:", 1, timeout=600, dead_pid=dead))


def test_overload_burst_is_refused_with_retry_after_and_nothing_hangs(stack):
    from serving.local.config import admission_bound

    url = stack.urls["disaggregated"] + "/chat/completions"
    burst_n = 3 * admission_bound(stack.state["config"])
    headers = {"Authorization": f"Bearer {stack.api_key}"}

    async def burst():
        t0 = time.monotonic()
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=burst_n + 8)) as c:
            return await asyncio.gather(
                *(chaos.one_request(c, url, headers, t0, model=stack.model, max_tokens=16) for _ in range(burst_n))
            )

    outcomes = asyncio.run(burst())
    kinds = {o.kind for o in outcomes}
    # Every request ended answered or refused: none hung, none lost its connection.
    assert kinds <= {"ok", "http_503", "http_429"}, kinds
    refused = [o for o in outcomes if o.status == 503]
    assert refused, "a 3x burst over the admission bound was not refused at all"
    assert all(o.retry_after for o in refused)
    # How fast the refusals come is a figure, not a pass/fail bound (it swings with machine
    # load): `make chaos` reports it (bench/chaos.py burst_refused_p50_s / burst_refused_max_s,
    # docs/resilience.md#figures).
    # And the stack still serves afterwards.
    r = httpx.post(
        url,
        headers=headers,
        timeout=60,
        json={"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
