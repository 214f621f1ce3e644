"""The front door's ASGI app: Ray Serve LLM's middleware stack, with its one BaseHTTPMiddleware
replaced by a plain ASGI middleware that does the same.

What flows through here: every HTTP message of every request the ingress replica serves, each
chunk of a streamed answer included. Ray's `init()` (ray/llm/_internal/serve/core/ingress/
ingress.py) builds, outermost first: SetRequestIdMiddleware, the HTTP metrics middleware (only
with ENABLE_VERBOSE_TELEMETRY), CORSMiddleware, then `add_exception_handling_middleware`'s
`BaseHTTPMiddleware(dispatch=_handle_application_exceptions)` (middleware.py), plus two
exception handlers. Starlette's BaseHTTPMiddleware runs the route in a task of its own and
passes every body chunk through an in-memory stream to a second task, a task switch and a
stream hop per chunk: py-spy put about a fifth of a streaming ingress replica's samples under
it. `AppErrors` keeps its behaviour (an exception before the response starts becomes Ray's
OpenAI-shaped error; a validation error the 400 Ray gives; after the start, the exception goes
on as before) without the hop. The app is Ray's own `init()` app, the rest of its stack and
its exception handlers untouched (tests/serving/ingress/test_asgi.py holds it against `init()`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse, Response

Scope = dict[str, Any]


class AppErrors:
    """Ray Serve LLM's application-exception middleware as plain ASGI: an exception the route
    raises before its response starts is answered as Ray answers it (`get_response_for_error`:
    an OpenAI error body with its status; a `RequestValidationError` Ray's 400); after the
    start it propagates unchanged, as it does through BaseHTTPMiddleware. Cancellation is never
    answered."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if started:
                raise
            response = await error_response_for(Request(scope), exc)
            await response(scope, receive, send)


async def error_response_for(request: Request, exc: Exception) -> Response:
    """What Ray's `_handle_application_exceptions` answers for `exc`."""
    from ray.llm._internal.serve.core.ingress import middleware as ray_middleware
    from ray.llm._internal.serve.utils.server_utils import get_response_for_error

    if isinstance(exc, RequestValidationError):
        return await ray_middleware._handle_validation_error(request, exc)
    error = get_response_for_error(exc, ray_middleware.get_request_id(request))
    return JSONResponse(content=error.model_dump(), status_code=error.error.code)


def ingress_app() -> FastAPI:
    """A FastAPI app for `make_fastapi_ingress(app=...)`: Ray's own `init()` app, its middleware
    list (read when the app first serves) with `AppErrors` where Ray put its BaseHTTPMiddleware."""
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    app.user_middleware = [Middleware(AppErrors) if m.cls is BaseHTTPMiddleware else m for m in app.user_middleware]
    return app
