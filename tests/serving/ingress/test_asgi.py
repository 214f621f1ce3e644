"""The front door's ASGI app (serving/ingress/asgi.py) against Ray Serve LLM's own `init()` app:
the same middleware stack but the one BaseHTTPMiddleware, and the same answers, errors
included, for the same routes. Ray's app is the oracle: every expectation here is what it does."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import init as ray_init
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import StreamingResponse

from serving.ingress.asgi import AppErrors, ingress_app


class Body(BaseModel):
    n: int


def _with_routes(app: FastAPI) -> FastAPI:
    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/boom")
    async def boom() -> dict:
        raise ValueError("internal detail")

    @app.get("/http-error")
    async def http_error() -> dict:
        raise OpenAIHTTPException(status_code=429, message="slow down", type="rate_limit_error")

    @app.post("/typed")
    async def typed(body: Body) -> dict:
        return {"n": body.n}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            for i in range(5):
                await asyncio.sleep(0)
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/late")
    async def late() -> StreamingResponse:
        async def chunks():
            yield "data: 0\n\n"
            raise RuntimeError("after the first byte")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_the_stack_is_rays_with_app_errors_in_place_of_its_base_http_middleware():
    ray_stack, ours = ray_init().user_middleware, ingress_app().user_middleware
    assert BaseHTTPMiddleware in [m.cls for m in ray_stack], "Ray's init() no longer adds BaseHTTPMiddleware"
    assert BaseHTTPMiddleware not in [m.cls for m in ours]
    expected = [AppErrors if m.cls is BaseHTTPMiddleware else m.cls for m in ray_stack]
    assert [m.cls for m in ours] == expected
    # The other middleware keep Ray's options (CORS's origins, credentials, ...).
    for theirs, mine in zip(ray_stack, ours, strict=True):
        if theirs.cls is not BaseHTTPMiddleware:
            assert (mine.args, mine.kwargs) == (theirs.args, theirs.kwargs), theirs.cls
    assert set(ingress_app().exception_handlers) == set(ray_init().exception_handlers)


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/ok", None),
        ("GET", "/boom", None),
        ("GET", "/http-error", None),
        ("POST", "/typed", {"n": 3}),
        ("POST", "/typed", {"n": "three"}),
        ("GET", "/stream", None),
    ],
)
def test_answers_equal_rays(method, path, body):
    headers = {"Origin": "https://app.example", "x-request-id": "req-1"}
    got = []
    for app in (_with_routes(ray_init()), _with_routes(ingress_app())):
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.request(method, path, json=body, headers=headers)
        got.append((r.status_code, r.text, r.headers.get("access-control-allow-origin"), r.headers.get("content-type")))
    assert got[1] == got[0]
    if path == "/boom":  # the error is answered in the OpenAI shape, not as plain text
        assert got[1][0] == 500 and '"error"' in got[1][1]


def test_an_exception_after_the_first_byte_propagates_as_through_rays_stack():
    seen = []
    for app in (_with_routes(ray_init()), _with_routes(ingress_app())):
        with TestClient(app) as client, pytest.raises(RuntimeError, match="after the first byte"):
            client.get("/late")
        seen.append(True)
    assert seen == [True, True]


def test_a_streamed_chunk_reaches_the_server_as_it_is_sent():
    """No stage between the route and the server holds chunks back: each message the route
    sends is passed on before the route's next one (what BaseHTTPMiddleware's second task does not
    promise)."""
    order: list[str] = []

    async def route(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            order.append(f"route {i}")
            await send({"type": "http.response.body", "body": f"{i}".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def server_send(message):
        if message["type"] == "http.response.body" and message["body"]:
            order.append(f"server {message['body'].decode()}")

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(AppErrors(route)({"type": "http", "method": "GET", "path": "/", "headers": []}, receive, server_send))
    assert order == ["route 0", "server 0", "route 1", "server 1", "route 2", "server 2"]


@pytest.mark.parametrize("path,status", [("/boom", 500), ("/http-error", 429)])
def test_an_exception_before_the_first_byte_is_answered_not_raised_to_serve(path, status):
    """Ray's stack answers a route's exception inside the app: nothing reaches Serve's replica
    (which would log the request as failed). Starlette's last-resort handler alone would answer
    the same body, then raise on."""
    for app in (_with_routes(ray_init()), _with_routes(ingress_app())):
        with TestClient(app) as client:  # raises whatever leaves the app
            assert client.get(path).status_code == status
