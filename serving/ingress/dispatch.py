"""One call to a model's engines, and what of the client's request crosses with it.

What flows through here: the engine deployment's handle, the typed body, the method to call
and the client's raw request -> the handle with Serve's session affinity (from the session
header; not for the engine) -> the body sanitized as Ray's own ingress does -> the call, with
only the allow-listed headers (W3C trace context, the ingress's own span injected) -> Serve's
response object, kept so that the relay can cancel it.

Only tracing headers reach the engines: vLLM reads `X-Vllm-Priority`, `X-Session-ID`,
`X-data-parallel-rank` and `x-request-id` from a request's headers (vllm 0.32
entrypoints/openai/generate/base/serving.py), and those are the server's to set.
"""

from __future__ import annotations

from typing import Any

# The request headers an engine may see: W3C trace context, so vLLM's spans join the
# ingress's trace (vllm/tracing/otel.py extract_trace_context). Nothing else a client sends.
ENGINE_HEADERS = frozenset({"traceparent", "tracestate"})


def engine_headers(raw_request: Any) -> dict[str, str]:
    """The headers of the client's request that an engine may see (ENGINE_HEADERS)."""
    if raw_request is None:
        return {}
    return {k: v for k, v in raw_request.headers.items() if k.lower() in ENGINE_HEADERS}


def dispatch_call(handle: Any, body: Any, call_method: str, raw_request: Any) -> Any:
    """One streaming call to the model deployment (what OpenAiIngress._get_response does,
    keeping hold of the response so it can be cancelled), with the allow-listed headers."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    from serving import ray_internals as ri

    if raw_request is not None:
        session_id = ri.session_id_from_headers(raw_request.headers)
        if session_id:  # Serve's session-affinity routing, on the handle; not for the engine
            handle = handle.options(session_id=session_id)
    if isinstance(body, ChatCompletionRequest):
        body = ri.sanitize_chat_request(body)
    info = ri.RawRequestInfo(headers=engine_headers(raw_request)) if raw_request is not None else None
    if info is not None:
        _with_trace_context(info.headers)
    return getattr(handle, call_method).remote(body, info)


def _with_trace_context(headers: dict[str, str]) -> None:
    """The ingress's span (Serve attaches it to OpenTelemetry's current context,
    ray/serve/_private/tracing_utils.py) becomes the parent of the engines' spans: vLLM takes
    `traceparent` from the headers it is handed (vllm/tracing/otel.py
    extract_trace_context). With tracing off there is no span and nothing is written."""
    try:
        from opentelemetry import propagate
    except ImportError:  # not in every image: then there are no spans either
        return
    propagate.inject(headers)
