"""A local stand-in for an external LLM aggregator, for the hybrid-routing e2e tests and bench.

What flows through here: requests from the ingress's fallback client -> a small recording
proxy (Starlette on uvicorn, in a thread of the test process) that records every request's
headers and JSON body, refuses any key but the provider key it was given (as a real provider
does), and relays the request to vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, the tiny model served under another name, at low CPU
priority: a real provider does not share our cores) -> vLLM's answer, streamed back as is.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serving.local.config import HOST, PLAIN_VLLM_ENV, plain_vllm_argv
from serving.local.procs import free_port

EXTERNAL_MODEL = "tiny-llama-external"
PROVIDER_KEY = "sk-provider-e2e-key"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Aggregator:
    url: str  # the proxy's /v1 root: what the fallback's baseUrl points at
    vllm_url: str
    records: list[Recorded] = field(default_factory=list)
    fail_with: int | None = None  # answer every request with this status instead

    def clear(self) -> None:
        self.records.clear()


def _proxy_app(agg: Aggregator, upstream: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(300, connect=10))

    async def relay(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        agg.records.append(Recorded(request.method, request.url.path, dict(request.headers), body))
        if request.headers.get("authorization") != f"Bearer {PROVIDER_KEY}":
            return JSONResponse({"error": {"message": "Invalid API key", "type": "auth"}}, status_code=401)
        if agg.fail_with:
            return JSONResponse(
                {"error": {"message": "provider internal detail", "type": "x"}}, status_code=agg.fail_with
            )
        path = request.url.path.removeprefix("/v1")
        req = client.build_request(request.method, path, content=raw, headers={"content-type": "application/json"})
        resp = await client.send(req, stream=True)

        async def body_iter():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(body_iter(), status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return Starlette(routes=[Route("/v1/{rest:path}", relay, methods=["GET", "POST"])])


@contextlib.contextmanager
def running_aggregator(
    model_dir: str, log_path: Path, engine_env: dict[str, str] | None = None, timeout: float = 300
) -> Iterator[Aggregator]:
    import uvicorn

    vport, pport = free_port(), free_port()
    env = {**os.environ, **(engine_env or {}), **PLAIN_VLLM_ENV}
    # Niced: the provider shares this machine's cores with the cluster it stands beside.
    cmd = ["nice", "-n", "15", *plain_vllm_argv(model_dir, EXTERNAL_MODEL, vport)]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until the finally below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    agg = Aggregator(url=f"http://{HOST}:{pport}/v1", vllm_url=f"http://{HOST}:{vport}/v1")
    server = uvicorn.Server(
        uvicorn.Config(_proxy_app(agg, agg.vllm_url), host=HOST, port=pport, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the aggregator's vLLM exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{HOST}:{vport}/health", timeout=5).status_code == 200 and server.started:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator's vLLM was not healthy after {timeout:.0f}s; see {log_path}")
            time.sleep(2)
        yield agg
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
