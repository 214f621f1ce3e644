"""Every Ray, Serve and vLLM metric that the rules and dashboards use, found in a live scrape.

What flows through here: the shared e2e stack (`make serve` with both apps) gets the
traffic whose metrics the rules read (a 401 and a 404, then streamed P/D and aggregated
completions sharing a long prompt, kept running while the scrape goes on) -> every Ray
node's metrics endpoint (Ray's metrics export port: the one KubeRay exposes as the pod's
`metrics` port) is scraped every few seconds -> the metric names seen in any scrape
(Prometheus also scrapes while the stack serves). Why under traffic: vLLM sets its gauges
(running and waiting requests, KV-cache usage, KV fetches by stage) on engine steps, and
Ray drops a gauge that has not been set for two export intervals (Ray 2.60
ray/_private/telemetry/open_telemetry_metric_recorder.py, `_gauge_metric_ttl_s`), so an
idle engine exports none of them. The metric names of every shipped rule and dashboard
expression (parsed by promql-parser) must all be there; so must every name in the offline
snapshot (tests/infra/k8s/data/ray-live-metric-names.txt) and the SLO thresholds as `le`
bucket bounds of vLLM's histograms. `PD_UPDATE_METRIC_SNAPSHOT=1` rewrites the snapshot
from this scrape (only names the expressions use).

Not from the scrape: the serving code's own event counters (`serving.ingress.limits`: usage per
key, 429s, fallbacks, limiter errors; `serving.core.failures`: retries, local prefills,
refusals). A labelled Ray counter has no series until its first event, and this traffic
causes no 429, fallback or fault, so an idle stack cannot show them. Their names are checked
statically against the serving code's declarations instead
(`metric_sources.event_counter_names()`: every `Counter(<name>, ...)` in serving/, read from
the source, each name as Ray exports a counter), here and in the offline tests alike; they
are left out of the snapshot.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from bench import hops
from infra.k8s import kv_offload
from tests.infra.k8s import metric_sources as ms


def _scrape(stack) -> str:
    return "\n".join(httpx.get(n["metrics_url"], timeout=20).text for n in stack.nodes)


def _names(text: str) -> set[str]:
    """Every series name in a scrape (prometheus_client's parser)."""
    return {name for name, _, _ in hops.parse_prometheus(text)}


# Long enough to fill whole KV blocks, so the repeats are prefix-cache hits.
SHARED_PROMPT = "Metrics for the dashboards, scraped while the engines work. " * 30


def _refusals(stack) -> None:
    key = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": stack.model, "prompt": "Metrics.", "max_tokens": 4}
    for url in stack.urls.values():
        assert httpx.post(f"{url}/completions", json=body, timeout=60).status_code == 401
        wrong = {**body, "model": "no-such-model"}
        assert httpx.post(f"{url}/completions", json=wrong, headers=key, timeout=60).status_code == 404


def _traffic(stack, stop: threading.Event, errors: list[str], streams_per_app: int = 3) -> list[threading.Thread]:
    """Streamed completions to every app, back to back, until `stop` is set."""
    key = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": stack.model, "prompt": SHARED_PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}

    def loop(url: str) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                with client.stream("POST", f"{url}/completions", json=body, headers=key) as r:
                    if r.status_code != 200:
                        errors.append(f"{url}: HTTP {r.status_code}")
                    for _ in r.iter_bytes():
                        pass

    threads = [
        threading.Thread(target=loop, args=(url,), daemon=True)
        for url in stack.urls.values()
        for _ in range(streams_per_app)
    ]
    for t in threads:
        t.start()
    return threads


def _scrape_under_traffic(stack, want: set[str], timeout_s: float = 120) -> set[str]:
    """Every metric name seen in any scrape while traffic runs, until `want` is covered."""
    stop, errors = threading.Event(), []
    threads = _traffic(stack, stop, errors)
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            time.sleep(3)
            seen |= _names(_scrape(stack))
            if want <= seen or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    assert not errors, errors[:5]
    return seen


@pytest.mark.e2e
@pytest.mark.live_metrics
def test_every_metric_the_rules_and_dashboards_use_is_exported_by_the_live_stack(stack, rendered_stacks):
    exprs = ms.shipped_expressions(rendered_stacks)
    events = ms.event_counter_names()
    # The KV offload tier's series are checked offline (ms.unknown_names): vLLM's CPU build
    # cannot run the tier, so waiting for them here would only run out the scrape's deadline.
    offload = set(kv_offload.METRICS)
    used = {n for e in exprs.values() for n in ms.metric_names(e) if n.startswith("ray_")} - events - offload
    assert used, "no Ray metric used: the expressions were not found"
    _refusals(stack)
    live = _scrape_under_traffic(stack, used | ms.live_snapshot())
    if os.environ.get("PD_UPDATE_METRIC_SNAPSHOT") == "1":
        ms.LIVE_SNAPSHOT.write_text(
            "# Ray/Serve/vLLM metric names the rules and dashboards use, seen in a live scrape of the local\n"
            "# stack (tests/serving/test_metrics_live.py; PD_UPDATE_METRIC_SNAPSHOT=1 rewrites this file).\n"
            + "".join(f"{n}\n" for n in sorted(used & live))
        )
    problems = ms.unknown_names(exprs, live)
    assert not problems, "\n".join(problems)
    stale = ms.live_snapshot() - live
    assert not stale, f"the offline snapshot names metrics the live stack does not export: {sorted(stale)}"


@pytest.mark.e2e
def test_make_serve_says_where_its_metrics_are(stack):
    (line,) = [line for line in stack.output if "metrics (Prometheus text format):" in line]
    for node in stack.nodes:
        assert f"{node['label']} {node['metrics_url']}" in line
        assert "ray_vllm_" in httpx.get(node["metrics_url"], timeout=20).text or node["label"] == "head"


@pytest.mark.e2e
def test_slo_thresholds_are_bucket_bounds_of_the_live_histograms(stack):
    """An SLO burn rule reads the bucket whose `le` IS the threshold (infra/k8s/alerts.py)."""
    from serving.spec import ITL_BUCKETS_S, TTFT_BUCKETS_S

    text = _scrape(stack)
    for metric, bounds in (
        ("ray_vllm_time_to_first_token_seconds_bucket", TTFT_BUCKETS_S),
        ("ray_vllm_inter_token_latency_seconds_bucket", ITL_BUCKETS_S),
    ):
        les = {labels["le"] for name, labels, _ in hops.parse_prometheus(text) if name == metric}
        assert les, f"{metric} not exported"
        assert {repr(float(b)) for b in bounds} <= les, (metric, sorted(les))
