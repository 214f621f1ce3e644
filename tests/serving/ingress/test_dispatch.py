"""One call to a model's engines: only the tracing headers cross, with the ingress's span."""

from __future__ import annotations

from serving.ingress.dispatch import dispatch_call


def test_the_ingress_span_is_the_parent_the_engines_are_handed():
    """vLLM reads `traceparent` from the forwarded headers (vllm/tracing/otel.py): the
    ingress's span goes there, and without a span nothing is added."""
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.requests import Request

    class Handle:
        def __getattr__(self, name):
            return self

        def remote(self, body, info):
            return info

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [(b"x-k", b"v")]})
    assert "traceparent" not in dispatch_call(Handle(), object(), "completions", request).headers
    with TracerProvider().get_tracer("t").start_as_current_span("ingress") as span:
        info = dispatch_call(Handle(), object(), "completions", request)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert info.headers["traceparent"].split("-")[1] == trace_id
    # Nothing else a client sends reaches the engines (vLLM reads x-request-id, priority and
    # session headers: the server's to set).
    assert "x-k" not in info.headers
