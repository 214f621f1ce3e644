"""The hop breakdown's arithmetic, on hand-made spans and metric scrapes."""

from __future__ import annotations

import json

import pytest

from bench.hops import (
    SETTLED_QUIET_S,
    EngineDelta,
    breakdown,
    engine_delta,
    exported_name,
    format_breakdown,
    parse_prometheus,
    parse_spans,
    span_hops,
)


def _span(name, trace, start, end, **attrs):
    # The shape OpenTelemetry's ConsoleSpanExporter writes (pretty-printed, one after another).
    return json.dumps(
        {
            "name": name,
            "context": {"trace_id": trace, "span_id": "0x1", "trace_state": "[]"},
            "kind": "SpanKind.SERVER",
            "parent_id": None,
            "start_time": f"2026-11-30T05:00:{start:09.6f}Z",
            "end_time": f"2026-11-30T05:00:{end:09.6f}Z",
            "attributes": attrs,
        },
        indent=4,
    )


def _pd_trace(trace, t0):
    return [
        # Ray 2.60 names the proxy's span after the route (a file exporter line of `make bench`).
        _span("proxy_http_request AuthenticatedIngress POST /v1/completions", trace, t0, t0 + 1.0),
        _span("replica_handle_request Ingress chat", trace, t0 + 0.002, t0 + 1.0, deployment="Ingress", app="llm"),
        _span("replica_handle_request Decode chat", trace, t0 + 0.010, t0 + 1.0, deployment="Decode", app="llm"),
        _span("replica_handle_request Prefill chat", trace, t0 + 0.013, t0 + 0.053, deployment="Prefill", app="llm"),
    ]


def test_span_hops_means_over_traces():
    text = "\n".join(_pd_trace("0xa", 1.0) + _pd_trace("0xb", 3.0))
    spans = parse_spans(text)
    assert len(spans) == 8
    hops = span_hops(spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill")
    assert hops.requests == 2
    assert hops.proxy_to_ingress_ms == pytest.approx(2.0, abs=1e-3)
    assert hops.ingress_to_engine_ms == pytest.approx(8.0, abs=1e-3)
    assert hops.decode_to_prefill_ms == pytest.approx(3.0, abs=1e-3)
    assert hops.prefill_leg_ms == pytest.approx(40.0, abs=1e-3)


def _haproxy_trace(trace, t0):
    # Serve's HAProxy mode: HAProxy hands the request to the ingress replica's own HTTP server,
    # whose span is the root (ray/serve/_private/replica.py: direct ingress builds the request's
    # metadata with call_method "__call__", and `_tracing_context` names the span
    # `replica_handle_request <deployment> <call_method>`); no proxy span.
    return [
        _span("replica_handle_request Ingress __call__", trace, t0 + 0.002, t0 + 1.0, deployment="Ingress", app="llm"),
        *_pd_trace(trace, t0)[2:],
    ]


def test_span_hops_without_a_proxy_span_count_from_the_ingress():
    spans = parse_spans("\n".join(_haproxy_trace("0xa", 1.0) + _haproxy_trace("0xb", 3.0)))
    start = spans[0].start
    hops = span_hops(
        spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill", window=(start, start + 10)
    )
    assert hops.requests == 2 and hops.proxied == 0
    assert hops.proxy_to_ingress_ms is None
    assert hops.ingress_to_engine_ms == pytest.approx(8.0, abs=1e-3)
    assert hops.decode_to_prefill_ms == pytest.approx(3.0, abs=1e-3)
    # The window reads the ingress span's start when there is no proxy span.
    late = span_hops(spans, app="llm", ingress="Ingress", engine="Decode", window=(start + 0.001, start + 10))
    assert late.requests == 1


def test_a_proxy_span_on_some_traces_is_averaged_over_those():
    spans = parse_spans("\n".join(_pd_trace("0xa", 1.0) + _haproxy_trace("0xb", 3.0)))
    hops = span_hops(spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill")
    assert (hops.requests, hops.proxied) == (2, 1)
    assert hops.proxy_to_ingress_ms == pytest.approx(2.0, abs=1e-3)


def test_haproxy_mode_breakdown_shows_the_untraced_proxy_row_as_a_dash():
    spans = parse_spans("\n".join(_haproxy_trace("0xa", 1.0)))
    hops = span_hops(spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill")
    decode = EngineDelta(sums={"ttft": 0.2}, counts={"ttft": 10})
    row = breakdown(100.0, decode, requests=10, hops=hops)
    assert row["proxy_to_ingress"] is None
    # 100 - (8 + 3 + 40 + 20): HAProxy's share is in the rest.
    assert row["delivery_rest"] == pytest.approx(29.0, abs=1e-3)
    lines = format_breakdown({"disaggregated": {1: row}}).splitlines()
    proxy = next(line for line in lines if line.startswith("proxy -> ingress"))
    assert "HAProxy: not traced" in proxy and proxy.split()[-1] == "-"
    # Plain vLLM has neither span: no proxy row at all.
    plain = format_breakdown({"vllm": {1: breakdown(25.0, decode, requests=10)}})
    assert "proxy -> ingress" not in plain


def test_span_hops_keeps_one_app_and_the_window():
    other = [s.replace('"llm"', '"llm-aggregated"') for s in _pd_trace("0xc", 5.0)]
    spans = parse_spans("\n".join(_pd_trace("0xa", 1.0) + other + _pd_trace("0xd", 30.0)))
    start = spans[0].start
    hops = span_hops(
        spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill", window=(start - 1, start + 10)
    )
    assert hops.requests == 1  # 0xc is another app, 0xd outside the window


def test_half_written_span_file_stops_cleanly():
    text = "\n".join(_pd_trace("0xa", 1.0)) + '\n{"name": "proxy_http_req'
    assert len(parse_spans(text)) == 4


SCRAPE_BEFORE = """
# HELP ray_vllm_time_to_first_token_seconds ttft
ray_vllm_time_to_first_token_seconds_sum{ReplicaId="r1",model_name="m"} 1.0
ray_vllm_time_to_first_token_seconds_count{ReplicaId="r1",model_name="m"} 10
ray_vllm_time_to_first_token_seconds_sum{ReplicaId="r2",model_name="m"} 5.0
ray_vllm_time_to_first_token_seconds_count{ReplicaId="r2",model_name="m"} 10
ray_vllm_request_queue_time_seconds_sum{ReplicaId="r1"} 0.1
ray_vllm_request_queue_time_seconds_count{ReplicaId="r1"} 10
ray_vllm_nixl_xfer_time_seconds_sum{ReplicaId="r1"} 0.0
ray_vllm_nixl_xfer_time_seconds_count{ReplicaId="r1"} 0
ray_vllm_prefix_cache_queries_total{ReplicaId="r1"} 100
ray_vllm_prefix_cache_hits_total{ReplicaId="r1"} 0
"""
SCRAPE_AFTER = """
ray_vllm_time_to_first_token_seconds_sum{ReplicaId="r1",model_name="m"} 1.5
ray_vllm_time_to_first_token_seconds_count{ReplicaId="r1",model_name="m"} 20
ray_vllm_time_to_first_token_seconds_sum{ReplicaId="r2",model_name="m"} 9.0
ray_vllm_time_to_first_token_seconds_count{ReplicaId="r2",model_name="m"} 11
ray_vllm_request_queue_time_seconds_sum{ReplicaId="r1"} 0.2
ray_vllm_request_queue_time_seconds_count{ReplicaId="r1"} 20
ray_vllm_nixl_xfer_time_seconds_sum{ReplicaId="r1"} 0.1
ray_vllm_nixl_xfer_time_seconds_count{ReplicaId="r1"} 10
ray_vllm_prefix_cache_queries_total{ReplicaId="r1"} 300
ray_vllm_prefix_cache_hits_total{ReplicaId="r1"} 150
"""


def test_engine_delta_filters_by_replica():
    d = engine_delta(parse_prometheus(SCRAPE_BEFORE), parse_prometheus(SCRAPE_AFTER), via_ray=True, replica_ids=["r1"])
    assert d.mean_ms("ttft") == pytest.approx(50.0)  # 0.5 s over 10 requests
    assert d.mean_ms("queue") == pytest.approx(10.0)
    assert d.per_request_ms("nixl", 10) == pytest.approx(10.0)
    assert d.prefix_hit_rate == pytest.approx(0.75)
    everyone = engine_delta(parse_prometheus(SCRAPE_BEFORE), parse_prometheus(SCRAPE_AFTER), via_ray=True)
    assert everyone.mean_ms("ttft") == pytest.approx(4500 / 11)


def test_exported_names():
    assert exported_name("vllm:time_to_first_token_seconds", via_ray=True) == "ray_vllm_time_to_first_token_seconds"
    assert exported_name("vllm:time_to_first_token_seconds", via_ray=False) == "vllm:time_to_first_token_seconds"


def test_breakdown_rest_is_what_the_hops_do_not_explain():
    spans = parse_spans("\n".join(_pd_trace("0xa", 1.0)))
    hops = span_hops(spans, app="llm", ingress="Ingress", engine="Decode", prefill="Prefill")
    decode = EngineDelta(
        sums={"ttft": 0.2, "queue": 0.1, "prefill": 0.05, "nixl": 0.03},
        counts={"ttft": 10, "queue": 10, "prefill": 10, "nixl": 10},
    )
    prefill = EngineDelta(
        sums={"ttft": 0.3, "queue": 0.05, "prefill": 0.25}, counts={"ttft": 10, "queue": 10, "prefill": 10}
    )
    row = breakdown(100.0, decode, requests=10, hops=hops, prefill=prefill)
    assert row["engine_ttft"] == pytest.approx(20.0)
    assert row["kv_transfer"] == pytest.approx(3.0)
    assert row["prefill_compute"] == pytest.approx(25.0)
    # 100 - (2 + 8 + 3 + 40 + 20)
    assert row["delivery_rest"] == pytest.approx(27.0, abs=1e-3)
    text = format_breakdown({"disaggregated": {1: row}})
    assert "KV transfer" in text and "27.0" in text


def test_breakdown_without_ray_has_no_serve_hops():
    engine = EngineDelta(
        sums={"ttft": 0.2, "queue": 0.0, "prefill": 0.2}, counts={"ttft": 10, "queue": 10, "prefill": 10}
    )
    row = breakdown(25.0, engine, requests=10)
    assert row["proxy_to_ingress"] is None and row["kv_transfer"] is None
    assert row["delivery_rest"] == pytest.approx(5.0)


def test_engine_rows_through_ray_are_marked_approximate_and_plain_vllm_is_not():
    from bench.hops import RAY_HISTOGRAM_NOTE, format_breakdown

    row = {"client_ttft": 100.0, "proxy_to_ingress": 2.0, "engine_queue": 150.0}
    out = format_breakdown({"aggregated": {1: row}, "vllm": {1: row}}, approx_targets=["aggregated"])
    lines = out.splitlines()
    queue = next(line for line in lines if "of which queue wait" in line)
    assert queue.split()[-2:] == ["~150.0", "150.0"]  # Ray-exported, then plain vLLM
    proxy = next(line for line in lines if line.startswith("proxy -> ingress"))
    assert "~" not in proxy  # Serve's spans are exact
    assert out.endswith(RAY_HISTOGRAM_NOTE)


def test_scrape_by_label_sums_a_series_over_the_endpoints_that_answer(monkeypatch):
    import httpx

    from bench import hops

    texts = {
        "http://a/metrics": 'ray_x_total{outcome="continued"} 2.0\nray_x_total{outcome="failed"} 1.0\nray_y_total 9.0\n',
        "http://b/metrics": 'ray_x_total{outcome="continued"} 3.0\n',
    }

    def get(url, timeout):
        if url not in texts:
            raise httpx.ConnectError("node restarting")
        return httpx.Response(200, text=texts[url])

    monkeypatch.setattr(httpx, "get", get)
    got = hops.scrape_by_label([*texts, "http://c/metrics"], "ray_x_total", "outcome")
    assert got == {"continued": 5.0, "failed": 1.0}


def test_a_settled_reading_outlasts_one_of_rays_metric_exports():
    """Ray's processes hand their metrics over every metrics_report_interval_ms (Ray 2.60's
    config, read here): a quiet window shorter than that can end before the last requests'
    counters arrive, and the bench's per-level deltas lose them."""
    import ray._raylet

    assert ray._raylet.Config.metrics_report_interval_ms() / 1000 < SETTLED_QUIET_S


def test_the_stacks_metric_readings_wait_as_long_as_settled_does():
    import inspect

    from bench import observe

    assert inspect.signature(observe.settled).parameters["quiet_s"].default == SETTLED_QUIET_S
