"""serving/tracing.py: the span exporter factory Ray Serve loads from RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH.

Contracts (Ray 2.60, read in the installed ray/serve/_private/tracing_utils.py and constants.py):
- `_validate_tracing_exporter`: a plain function with no arguments;
  `_validate_tracing_exporter_processors`: it returns a list of SpanProcessor. Ray's own
  validators are called here, not re-implemented.
- `setup_tracing` (env-var path: RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH and
  RAY_SERVE_TRACING_SAMPLING_RATIO, read when constants.py is imported) builds a
  TracerProvider with ParentBasedTraceIdRatio(ratio) and adds our processors.
The end-to-end test runs Ray's real `setup_tracing` and Serve's own span context manager in a
subprocess (a process may set its tracer provider only once) and counts the spans that reach a
real OTLP/gRPC receiver (opentelemetry-proto's TraceService) on this machine.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from infra.paths import ROOT
from serving import tracing

TRACES = 400


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that counts spans and root spans."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list = []

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    servicer = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def test_ray_accepts_the_factory_and_what_it_returns(monkeypatch):
    from ray.serve._private.tracing_utils import _validate_tracing_exporter, _validate_tracing_exporter_processors

    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://otel-collector.monitoring.svc.cluster.local:4317")
    _validate_tracing_exporter(tracing.span_processors)
    processors = tracing.span_processors()
    _validate_tracing_exporter_processors(processors)
    (proc,) = processors
    assert isinstance(proc, BatchSpanProcessor)
    for p in processors:
        p.shutdown()


def test_without_an_endpoint_it_says_which_variable(monkeypatch):
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    with pytest.raises(RuntimeError, match=tracing.ENDPOINT_ENV):
        tracing.span_processors()


_CHILD = textwrap.dedent(
    """
    import contextvars
    import sys
    from ray.serve._private import tracing_utils as t

    def request():
        with t.TraceContextManager("proxy_http_request"):
            with t.TraceContextManager("replica_handle_request"):
                pass

    assert t.setup_tracing("proxy", "test"), "Serve did not turn tracing on"
    for i in range(int(sys.argv[1])):
        # Each request in a context of its own, as each proxied request runs in its own task.
        contextvars.Context().run(request)
    # The provider's atexit shutdown flushes the batch processor.
    """
)


def _serve_spans(endpoint: str, ratio: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH": "serving.tracing:span_processors",
        "RAY_SERVE_TRACING_SAMPLING_RATIO": ratio,
        tracing.ENDPOINT_ENV: endpoint,
    }
    subprocess.run([sys.executable, "-c", _CHILD, str(TRACES)], env=env, check=True, timeout=120)


def test_every_span_reaches_the_collector_at_ratio_one(receiver):
    servicer, endpoint = receiver
    _serve_spans(endpoint, "1.0")
    names = [s.name for s in servicer.spans]
    assert names.count("proxy_http_request") == TRACES
    assert names.count("replica_handle_request") == TRACES
    # Children share their parent's trace: one trace per request.
    assert len({s.trace_id for s in servicer.spans}) == TRACES


def test_the_sampling_ratio_is_honoured(receiver):
    servicer, endpoint = receiver
    _serve_spans(endpoint, "0.25")
    roots = [s for s in servicer.spans if s.name == "proxy_http_request"]
    # Binomial(400, 0.25): mean 100, sd 8.7; 50..150 is more than five sd either side.
    assert 50 <= len(roots) <= 150, len(roots)
    kept = {s.trace_id for s in roots}
    children = [s for s in servicer.spans if s.name == "replica_handle_request"]
    # Parent-based: every kept request keeps its child span, in the same trace.
    assert sum(1 for s in children if s.trace_id in kept) == len(roots)
    # What Serve 2.60 does with a dropped request (TraceContextManager.__enter__ leaves the
    # context unset when its span is not sampled): the next span starts a trace of its own and
    # is sampled again at the ratio, so a fragment of a dropped request can arrive alone
    # (docs/observability.md, "Traces").
    strays = [s for s in children if s.trace_id not in kept]
    assert all(not s.parent_span_id for s in strays)
    dropped = TRACES - len(roots)
    mean, sd = dropped * 0.25, math.sqrt(dropped * 0.25 * 0.75)
    assert abs(len(strays) - mean) <= 5 * sd, (len(strays), mean)
