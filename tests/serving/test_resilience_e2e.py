"""Faults and overload on the shared local stack (shortened `make chaos` scenarios).

Both tests are disruptive: they run after the other e2e tests (tests/conftest.py
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

from bench import chaos, hops, prefill_mode, replicas
from bench import chaos_faults as cf
from serving.core.failures import Reason
from serving.core.metrics import KV_ROUTES, LOCAL_PREFILLS

pytestmark = [pytest.mark.e2e, pytest.mark.disruptive]

# Ray exports a Serve Counter named N as ray_N_total.
METRIC = LOCAL_PREFILLS.prometheus


def _metric_total(stack, name: str) -> dict[str, float]:
    """{reason: value} of a Ray-exported counter, summed over the nodes' metrics endpoints."""
    return _metric_total_by(stack, name, "reason")


def _metric_total_by(stack, name: str, label: str) -> dict[str, float]:
    """{value of `label`: total} of a Ray-exported counter, summed over the nodes' endpoints."""
    return hops.scrape_by_label([n["metrics_url"] for n in stack.nodes], name, label)


# After the killed prefill replica is back, the stack must be doing P/D again within this
# long (the circuit reopens remote prefill after circuitOpenS, 3 s locally, with one probe).
# A bound on recovery, not a speed figure: `make chaos` reports the measured time.
BACK_TO_PD_WITHIN_S = 180
BATCH = 6


def _prefill_prompt_tokens(stack) -> float:
    total = 0.0
    for node in stack.nodes:
        if node["label"] == "prefill":
            samples = hops.parse_prometheus(httpx.get(node["metrics_url"], timeout=10).text)
            total += hops.metric_total(
                samples,
                "ray_vllm_prompt_tokens_by_source_total",
                lambda labels: labels.get("source") == "local_compute",
            )
    return total


def _back_to_remote_prefill(stack, url: str) -> float:
    """Seconds until a batch of requests is prefilled entirely by the prefill tier again
    (pd_prefill_path) and the prefill engine's prompt-token count rises with it."""
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    urls = [n["metrics_url"] for n in stack.nodes]
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 4}
    t = time.monotonic()
    seen = []
    while True:
        before, prompt_before = prefill_mode.read_counts(urls), _prefill_prompt_tokens(stack)
        for _ in range(BATCH):
            r = httpx.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
        # Ray exports counters every few seconds: wait until the batch shows.
        settle = time.monotonic() + 30
        while True:
            after = prefill_mode.read_counts(urls)
            share, n = prefill_mode.remote_share(before, after)
            if n >= BATCH or time.monotonic() > settle:
                break
            time.sleep(1)
        seen.append((round(time.monotonic() - t), share, n))
        if share == 1.0 and n >= BATCH and _prefill_prompt_tokens(stack) > prompt_before:
            return time.monotonic() - t
        assert time.monotonic() - t < BACK_TO_PD_WITHIN_S, (
            f"still not back to remote prefill {BACK_TO_PD_WITHIN_S}s after the prefill replica returned: "
            f"(seconds, remote share, requests) per batch: {seen}"
        )


def test_prefill_killed_under_streamed_load_costs_no_request_and_pd_comes_back(stack):
    url = stack.urls["disaggregated"] + "/chat/completions"
    dashboard = stack.state["dashboard_url"]

    urls = [n["metrics_url"] for n in stack.nodes]
    fallbacks_before = hops.scrape_by_label(urls, METRIC, "reason")

    async def scenario():
        t0 = time.monotonic()
        async with chaos.Load(url, stack.api_key, 4, t0, model=stack.model) as load:
            await asyncio.sleep(5)
            victims = replicas.replica_processes(stack.proc.pid, ":Prefill:")
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
        # The fault landed first: requests were in flight at the kill, and the outage was seen
        # (local prefills counted after it, on Ray's metrics endpoint, exported every few
        # seconds); only then does "nothing failed" say anything.
        assert cf.open_at(((o.start, o.end) for o in outcomes), fault_at) >= 1, "no request in flight at the kill"
        deadline = time.monotonic() + 60
        fallbacks: dict[str, float] = {}
        while time.monotonic() < deadline and not cf.delta_total(fallbacks_before, fallbacks):
            time.sleep(5)
            fallbacks = _metric_total(stack, METRIC)
        assert cf.delta_total(fallbacks_before, fallbacks) >= 1, f"no local-prefill fallback counted in {METRIC}"
        assert set(fallbacks) <= {r.value for r in Reason}, fallbacks
        assert not failed, f"{len(failed)} of {len(outcomes)} failed: {[o.kind for o in failed]}"
    finally:
        # Leave the shared stack as we found it: the prefill replica running again.
        asyncio.run(replicas.wait_healthy(dashboard, ":Prefill:", 1, timeout=600, dead_pid=dead))
    # The designed state, not only answers: requests are prefilled remotely again, and routed
    # by KV state again (the replacement's KV events indexed by the prefill tier's scorer).
    _back_to_remote_prefill(stack, url)
    _scored_again(stack, url)


def _scored_again(stack, url: str) -> None:
    """A batch of requests all scored by the KV-aware prefill router (pd_kv_routes), within
    BACK_TO_PD_WITHIN_S: the scorer dropped the killed replica and registered its replacement
    (Ray reports a replica's KV-event endpoint with its routing stats, every 2 s here)."""
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    urls = [n["metrics_url"] for n in stack.nodes]
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
    t = time.monotonic()
    seen = []
    while time.monotonic() - t < BACK_TO_PD_WITHIN_S:
        before = hops.scrape_by_label(urls, KV_ROUTES.prometheus, "outcome")
        for _ in range(BATCH):
            assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
        settle = time.monotonic() + 30
        while True:
            after = hops.scrape_by_label(urls, KV_ROUTES.prometheus, "outcome")
            delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            if sum(delta.values()) >= BATCH or time.monotonic() > settle:
                break
            time.sleep(1)
        seen.append((round(time.monotonic() - t), delta))
        if delta == {"scored": BATCH}:
            return
    raise AssertionError(f"KV-aware routing did not come back: (seconds, outcomes) per batch: {seen}")


def test_overload_burst_is_refused_with_retry_after_and_nothing_hangs(stack):
    from local.config import admission_bound

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
    # The fault landed first: the burst really met the bound (some refused).
    refused = [o for o in outcomes if o.status == 503]
    assert refused, "a 3x burst over the admission bound was not refused at all"
    # Every request ended answered or refused: none hung, none lost its connection.
    assert kinds <= {"ok", "http_503", "http_429"}, kinds
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
