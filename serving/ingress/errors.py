"""The front door's error answers: one OpenAI error shape, shaped once at the edge.

What flows through here: a refusal the front door decides itself (401, 404, 413, 429, ...), or
an exception that reached the edge (a body that failed validation, a request the cluster
cannot serve: serving/core/failures.py `Unservable`, an engine's 4xx: `EngineRefused`, Ray's
HTTP exceptions, anything else) -> a JSON response `{"error": {"message", "type", "param",
"code"}}` with the status, and `Retry-After` where waiting helps. A 5xx never carries the
internal text: it is logged here and the client gets a fixed message.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from serving.core.failures import OVERLOADED_MESSAGE, EngineRefused, Unservable, as_unservable

logger = logging.getLogger("ray.serve")

# OpenAI's error `type` and `code` for each status the ingress answers itself.
_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    408: ("timeout_error", "timeout"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", None),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "overloaded"),
}
# Every chat/completion answer says where it came from (serving/ingress/routing.py).
SERVED_BY = "x-served-by"
# OpenAI's answer for a model that does not exist or that the key may not use (the same words
# for both, so that a refusal tells no client which ids exist).
MODEL_NOT_FOUND = "The model '{model}' does not exist or you do not have access to it."


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style JSON error: {"error": {"message", "type", "param", "code"}}."""
    default_type, default_code = _ERROR_KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    body = {
        "error": {
            "message": message,
            "type": type or default_type,
            "param": param,
            "code": code if code is not None else default_code,
        }
    }
    return JSONResponse(status_code=status, content=body, headers=dict(headers or {}))


def model_not_found(model: str) -> JSONResponse:
    """OpenAI's 404 for a model (or adapter) that does not exist or that the key may not use."""
    return error_response(
        404,
        MODEL_NOT_FOUND.format(model=model),
        type="invalid_request_error",
        param="model",
        code="model_not_found",
        headers={SERVED_BY: "cluster"},
    )


def unservable_response(failure: Unservable, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The answer to a request the cluster cannot serve (its reason is the error code)."""
    return error_response(
        failure.status, failure.message, code=failure.reason.value, headers={**failure.headers, **(headers or {})}
    )


def validation_error(err: ValidationError) -> JSONResponse:
    """400 naming the first field pydantic refused, and where."""
    first: dict[str, Any] = dict(err.errors()[0]) if err.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    msg = first.get("msg", "invalid request body")
    where = f" (at '{loc}')" if loc else ""
    return error_response(400, f"Invalid request body: {msg}{where}.", param=loc)


def request_refusal(exc: BaseException) -> JSONResponse | None:
    """The answer vLLM's own server gives to one of its client errors, raised where the ingress
    validates a request with vLLM's models (their validators raise `VLLMValidationError`,
    which pydantic passes through: `top_logprobs` without `logprobs`, a bad `tool_choice`), or
    None. vLLM 0.32 maps them (entrypoints/serve/exception_handling/error_response.py): not
    found 404, unprocessable 422, every other client error 400, naming the parameter."""
    try:
        from vllm.exceptions import VLLMClientError, VLLMNotFoundError, VLLMUnprocessableEntityError
    except ImportError:  # vLLM 0.29 (the worker image): its validators raise ValueError instead
        return None
    if not isinstance(exc, VLLMClientError):
        return None
    status = (
        404 if isinstance(exc, VLLMNotFoundError) else 422 if isinstance(exc, VLLMUnprocessableEntityError) else 400
    )
    return error_response(status, str(exc), param=getattr(exc, "parameter", None))


def answer_for(exc: BaseException, retry_after_s: int = 1) -> JSONResponse:
    """The one mapping from an exception that reached the edge to the client's answer."""
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    refusal = request_refusal(exc)
    if refusal is not None:
        return refusal
    if isinstance(exc, EngineRefused):
        return error_response(exc.status_code, exc.message)
    failure = as_unservable(exc, retry_after_s)
    if failure is not None:
        if not isinstance(exc, Unservable):
            logger.warning("ingress: %r answered as %s", exc, failure.reason.value)
        return unservable_response(failure)
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500:
        # fastapi.HTTPException carries `detail`; Ray's OpenAIHTTPException `message`.
        message = getattr(exc, "message", None) or getattr(exc, "detail", None) or str(exc)
        return error_response(status, str(message))
    logger.error("unhandled ingress error", exc_info=exc)
    return error_response(500, "Internal server error.", code="internal_error")


__all__ = ["OVERLOADED_MESSAGE", "SERVED_BY", "answer_for", "error_response", "model_not_found", "validation_error"]
