"""A local stand-in for an external OpenAI-compatible provider (hybrid-routing e2e tests, bench).

What flows through here: requests from the ingress's fallback client -> a small recording
proxy (Starlette on uvicorn, in a process of its own, so its work never holds the GIL of the
test or benchmark client that measures the stack) that records every request's headers and
JSON body (in a multiprocessing manager's list, written before the answer starts, so a test
reads it as soon as its request returns) and the bytes of each answer it relays from vLLM
once that answer ends (a test compares what the ingress relayed with what the provider sent:
vLLM's own chunking of a stream varies from request to request), and refuses any key but the
provider key (as a real provider does) -> one of two backends (`Backend`):

- `vllm`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the tiny
  model served under another name, at low CPU priority), relayed as is. A real engine and
  a real OpenAI format; but it runs on the cores the cluster uses.
- `paced`: the answer is generated in the proxy at a set pace (`Pace`: time to first token,
  tokens per second), in OpenAI's completion and chat formats, streamed or not. It stands in
  for what a remote provider is to the cluster: an answer that takes time but none of our
  CPU, so a benchmark measures our routing rather than a second engine on the same cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import multiprocessing
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from local.config import HOST
from local.plain_vllm import PLAIN_VLLM_ENV, plain_vllm_argv
from local.procs import free_port

EXTERNAL_MODEL = "tiny-llama-external"
PROVIDER_KEY = "sk-provider-e2e-key"


class Backend(enum.Enum):
    VLLM = "vllm"
    PACED = "paced"


@dataclass(frozen=True)
class Pace:
    """How fast the paced backend answers: a remote provider's usual figures, not ours."""

    ttft_s: float = 0.5
    tokens_per_s: float = 60.0
    default_max_tokens: int = 16


# What the paced backend says, a word per token, over and over.
PACED_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "again")


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class StandInProvider:
    url: str  # the proxy's /v1 root: what the fallback's baseUrl points at
    vllm_url: str | None  # None with the paced backend
    _records: Any  # a manager list of Recorded, shared with the proxy's process
    _answers: Any  # a manager list of the relayed answers' bytes, in the order they ended
    _state: Any  # a manager dict: {"fail_with": status or 0}

    @property
    def records(self) -> list[Recorded]:
        return list(self._records)

    @property
    def answers(self) -> list[bytes]:
        """The bodies the vLLM backend answered with, in the order they ended."""
        return list(self._answers)

    def clear(self) -> None:
        del self._records[:]
        del self._answers[:]

    @property
    def fail_with(self) -> int | None:
        """Answer every request with this status instead (None: answer normally)."""
        return self._state["fail_with"] or None

    @fail_with.setter
    def fail_with(self, status: int | None) -> None:
        self._state["fail_with"] = status or 0


def _words(text: Any) -> int:
    """The paced backend's token count of a prompt or of chat messages: words."""
    if isinstance(text, list):
        return sum(_words(m.get("content") if isinstance(m, dict) else m) for m in text)
    return len(str(text or "").split())


def paced_events(chat: bool, body: dict[str, Any], pace: Pace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chunks of a paced answer (OpenAI's streamed shape) and its usage, for `body`."""
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or pace.default_max_tokens)
    prompt_tokens = _words(body.get("messages") if chat else body.get("prompt"))
    base = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
    }
    chunks = []
    for i in range(n):
        word = ("" if i == 0 else " ") + PACED_WORDS[i % len(PACED_WORDS)]
        finish = "length" if i == n - 1 else None
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": word}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": word, "logprobs": None, "finish_reason": finish}
        )
        chunks.append({**base, "choices": [choice]})
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    return chunks, {**base, "choices": [], "usage": usage}


def paced_document(chunks: list[dict[str, Any]], usage_event: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The non-streamed answer: the chunks joined into one OpenAI completion object."""
    if chat:
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    obj = "chat.completion" if chat else "text_completion"
    return {**usage_event, "object": obj, "choices": [choice]}


def _proxy_app(records: Any, answers: Any, state: Any, upstream: str | None, pace: Pace) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(300, connect=10)) if upstream else None

    async def paced(path: str, body: Any) -> Response:
        if not isinstance(body, dict) or not path.endswith("completions"):
            return JSONResponse({"error": {"message": "Not found", "type": "invalid_request_error"}}, status_code=404)
        chat = path.endswith("chat/completions")
        chunks, usage_event = paced_events(chat, body, pace)
        gap = 1.0 / pace.tokens_per_s
        if not body.get("stream"):
            await asyncio.sleep(pace.ttft_s + gap * (len(chunks) - 1))
            return JSONResponse(paced_document(chunks, usage_event, chat))
        opts = body.get("stream_options")
        with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

        async def events() -> AsyncIterator[str]:
            t0 = time.monotonic()
            for i, chunk in enumerate(chunks):
                # Sleep to a schedule, not by a fixed gap: a slow send does not slow the pace.
                await asyncio.sleep(max(0.0, t0 + pace.ttft_s + i * gap - time.monotonic()))
                yield f"data: {json.dumps(chunk)}\n\n"
            if with_usage:
                yield f"data: {json.dumps(usage_event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def relay(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        records.append(Recorded(request.method, request.url.path, dict(request.headers), body))
        if request.headers.get("authorization") != f"Bearer {PROVIDER_KEY}":
            return JSONResponse({"error": {"message": "Invalid API key", "type": "auth"}}, status_code=401)
        if fail_with := state["fail_with"]:
            return JSONResponse({"error": {"message": "provider internal detail", "type": "x"}}, status_code=fail_with)
        path = request.url.path.removeprefix("/v1")
        if client is None:
            return await paced(path, body)
        req = client.build_request(request.method, path, content=raw, headers={"content-type": "application/json"})
        resp = await client.send(req, stream=True)

        async def body_iter() -> AsyncIterator[bytes]:
            sent: list[bytes] = []
            try:
                async for chunk in resp.aiter_raw():
                    sent.append(chunk)
                    yield chunk
            finally:
                await resp.aclose()
                answers.append(b"".join(sent))

        return StreamingResponse(body_iter(), status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return Starlette(routes=[Route("/v1/{rest:path}", relay, methods=["GET", "POST"])])


def _serve_proxy(port: int, records: Any, answers: Any, state: Any, upstream: str | None, pace: Pace) -> None:
    """The proxy's process (spawned): serve until terminated."""
    import uvicorn

    app = _proxy_app(records, answers, state, upstream, pace)
    uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def running_provider(
    model_dir: str,
    log_path: Path,
    engine_env: dict[str, str] | None = None,
    timeout: float = 300,
    backend: Backend = Backend.VLLM,
    pace: Pace = Pace(),  # noqa: B008 - frozen
) -> Iterator[StandInProvider]:
    vport, pport = free_port(), free_port()
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until the finally below
    proc = None
    if backend is Backend.VLLM:
        env = {**os.environ, **(engine_env or {}), **PLAIN_VLLM_ENV}
        # Niced: the provider shares this machine's cores with the cluster it stands beside.
        cmd = ["nice", "-n", "15", *plain_vllm_argv(model_dir, EXTERNAL_MODEL, vport)]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    else:
        log.write(f"paced backend: first token after {pace.ttft_s}s, {pace.tokens_per_s} tokens/s\n")
        log.flush()
    vllm_url = f"http://{HOST}:{vport}/v1" if proc is not None else None
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads; fork would copy them
    manager = ctx.Manager()
    provider = StandInProvider(
        url=f"http://{HOST}:{pport}/v1",
        vllm_url=vllm_url,
        _records=manager.list(),
        _answers=manager.list(),
        _state=manager.dict(fail_with=0),
    )
    proxy = ctx.Process(
        target=_serve_proxy,
        args=(pport, provider._records, provider._answers, provider._state, vllm_url, pace),
        name="provider-proxy",
    )
    proxy.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the stand-in provider's vLLM exited with {proc.returncode}; see {log_path}")
            if not proxy.is_alive():
                raise RuntimeError(f"the stand-in provider's proxy exited with {proxy.exitcode}")
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{provider.url}/models", timeout=5)  # any answer (a 401 without the key): it listens
                if proc is None or httpx.get(f"http://{HOST}:{vport}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stand-in provider was not healthy after {timeout:.0f}s; see {log_path}")
            time.sleep(0.2 if proc is None else 2)
        provider.clear()  # the readiness probes above
        yield provider
    finally:
        proxy.terminate()
        proxy.join(timeout=10)
        manager.shutdown()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
