"""`make bench-ingress`: CPU per streamed event on the ingress's stream path, against a bare
passthrough run beside it.

What flows through here: synthetic vLLM-shaped streamed answers (chat and completions; the
wire format of vLLM 0.32's chat_completion/serving.py and completion/serving.py: the
prompt's token ids and each chunk's when the request asks `return_token_ids`, usage in every
chunk with `continuous_usage_stats`, the final usage event with `include_usage`, [DONE]),
shaped by what the ingress asked for, in Ray Serve LLM's batches (the first chunk alone, then
lists of `--batch` events) from a stand-in decode handle -> the ingress's real path
(serving.ingress.server.AuthenticatedIngress: auth, parse, hybrid routing, the resilient call, then
the stream: stream migration's record, the metering) -> the bytes a client reads. Beside
it, in the same rounds and the same event loop, the same batches through an async generator
that yields their text unchanged: the floor of moving the bytes at all.

Per round, each path streams `--streams` answers of each endpoint, in alternating order;
CPU time is time.process_time() (this process only: a loaded machine slows the wall clock,
not this figure, though it still costs cache misses). Per event: the stream's CPU from the
moment the ingress returned its response to the last byte, over the JSON events streamed.
Per request: the ingress's CPU until it returned the response (first chunk in hand), against
one json.loads and pydantic validation of the same body run beside it. Figures are printed as
ratios to their baseline, median over rounds with the 25th-75th percentile spread; a
benchmark prints figures, it does not pass or fail. No Ray is started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict

MODEL = "tiny"
PROMPT_IDS = [101, 102, 103, 104, 105, 106, 107, 108]
# Generated text, cycled: some pieces are not ASCII (a client's bytes escape them).
PIECES = [
    " The",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " the",
    " lazy",
    " dog",
    ".",
    " Ça",
    " va",
    " 日本",
    "語",
]
OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def engine_events(
    endpoint: str,
    n: int,
    *,
    ids: bool,
    every_usage: bool,
    final_usage: bool,
    rid: str = "r-1",
    start: int = 0,
    held: frozenset[int] = frozenset(),
    kv: bool = False,
    logprobs: bool = False,
) -> list[str]:
    """The events (`data: ...`, [DONE] last) a vLLM engine streams for `n` generated tokens,
    the answer's tokens from position `start` on (a continuation's prompt holds the ones
    before). `held`: positions whose text vLLM holds back (an empty chunk, sent only when
    token ids were asked for); `kv`: kv_transfer_params on the last chunk; `logprobs`: a
    logprob per token (the request asked for them)."""
    base = {"id": rid, "object": OBJECT[endpoint], "created": 1700000000, "model": MODEL}
    prompt = len(PROMPT_IDS) + start

    def usage(done: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

    docs: list[dict[str, Any]] = []
    if endpoint == "chat":
        first: dict[str, Any] = {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        if ids:
            first["prompt_token_ids"] = PROMPT_IDS
        if every_usage:
            first["usage"] = usage(0)
        docs.append(first)
    pending = ""
    for i in range(n):
        last = i == n - 1
        pending += piece(start + i)
        text = "" if start + i in held and not last else pending
        if text:
            pending = ""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": {"content": [{"token": text, "logprob": -0.25 / (i + 1), "bytes": None}]} if logprobs else None,
            "finish_reason": "length" if last else None,
        }
        if endpoint == "chat":
            if not text and not last and not ids:
                continue  # vLLM sends no chunk without text unless token ids were asked for
            choice["delta"] = {"content": text} if text else {}
        else:
            choice = {"index": 0, "text": text, **{k: v for k, v in choice.items() if k != "index"}}
            choice["stop_reason"] = None
            if i == 0 and ids:
                choice["prompt_token_ids"] = PROMPT_IDS + token_ids(start)
        if ids:
            choice["token_ids"] = [1000 + start + i]
        doc = {**base, "choices": [choice]}
        if every_usage:
            doc["usage"] = usage(i + 1)
        if last and kv:
            doc["kv_transfer_params"] = {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_engine_id": "e-1"}
        docs.append(doc)
    if final_usage:
        docs.append({**base, "choices": [], "usage": usage(n)})
    # vLLM writes pydantic's JSON: compact, UTF-8 as it is.
    return [f"data: {json.dumps(d, separators=(',', ':'), ensure_ascii=False)}\n\n" for d in docs] + [
        "data: [DONE]\n\n"
    ]


def piece(position: int) -> str:
    """The text of the answer's token at `position`."""
    return PIECES[position % len(PIECES)]


def token_ids(n: int) -> list[int]:
    """The ids of the answer's first `n` tokens."""
    return [1000 + i for i in range(n)]


def batches(events: list[str], size: int) -> list[list[str]]:
    """Ray Serve LLM's batches of a stream: the first event alone, then `size` at a time."""
    return [events[:1]] + [events[i : i + size] for i in range(1, len(events), size)]


class Asked(TypedDict):
    ids: bool
    every_usage: bool
    final_usage: bool


def asked(body: Any) -> Asked:
    """What a request asked the engine for: token ids, usage in every chunk, the usage event."""
    opts = getattr(body, "stream_options", None)
    return Asked(
        ids=bool(getattr(body, "return_token_ids", False)),
        every_usage=bool(opts and getattr(opts, "continuous_usage_stats", False)),
        final_usage=bool(opts and getattr(opts, "include_usage", False)),
    )


class EngineStream:
    """A Serve response stream of fixed items (an exception among them is raised there),
    with Serve's cancel()."""

    def __init__(self, items: list[Any]):
        self._items = iter(items)
        self.cancelled = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> Any:
        try:
            item = next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class EngineHandle:
    """Stands in for the decode deployment's handle: `script(endpoint, typed body)` gives the
    items each call streams (a list, or an exception to raise there)."""

    deployment_name = "Decode"

    def __init__(self, script: Callable[[str, Any], list[Any]]):
        self.script = script
        self.calls: list[tuple[str, Any]] = []

    def options(self, **_: Any) -> EngineHandle:
        return self

    def __getattr__(self, name: str) -> Any:
        if name not in ("chat", "completions"):
            raise AttributeError(name)
        handle = self

        class Method:
            def remote(self, body: Any, info: Any) -> EngineStream:
                handle.calls.append((name, body))
                return EngineStream(handle.script(name, body))

        return Method()


def make_ingress(handle: EngineHandle, *, migrations: int | None = None) -> Any:
    """The real ingress (auth off) in front of `handle`, outside Serve (no Ray started)."""
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard

    from serving.ingress.server import AuthenticatedIngress
    from serving.spec import ResilienceSpec

    resilience = ResilienceSpec().runtime_args()
    if migrations is not None:
        resilience = {**resilience, "migrations": migrations}
    card = ModelCard(id=MODEL, object="model", owned_by="bench", permission=[], metadata={})
    return AuthenticatedIngress({MODEL: handle}, {MODEL: card}, auth_mode="disabled", resilience=resilience)


def make_request(body: dict[str, Any], endpoint: str) -> Any:
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = [(b"content-type", b"application/json")]
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}, receive)


def request_body(endpoint: str, n: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": True, "temperature": 0, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me about the fox."}]
    else:
        body["prompt"] = "Tell me about the fox."
    return body


async def call(ingress: Any, endpoint: str, body: dict[str, Any]) -> Any:
    """The ingress's response to `body` (a StreamingResponse for a stream)."""
    method = ingress.chat if endpoint == "chat" else ingress.completions
    return await method(make_request(body, endpoint))


async def drain(chunks: AsyncIterator[Any]) -> int:
    size = 0
    async for chunk in chunks:
        size += len(chunk)
    return size


async def passthrough(stream: EngineStream) -> AsyncIterator[str]:
    """The baseline: each batch's text, unchanged."""
    async for item in stream:
        yield item if isinstance(item, str) else "".join(item)


# --- the benchmark ----------------------------------------------------------------------------
def _script(events: int, batch: int) -> Callable[[str, Any], list[Any]]:
    """The engine's answers, built once per shape: the engine's own cost is not measured."""
    built: dict[tuple[str, tuple[bool, ...]], list[Any]] = {}

    def script(endpoint: str, body: Any) -> list[Any]:
        flags = asked(body)
        key = (endpoint, (flags["ids"], flags["every_usage"], flags["final_usage"]))
        if key not in built:
            n = events - (2 if endpoint == "chat" else 1)  # JSON events: tokens, the role chunk, usage
            built[key] = batches(engine_events(endpoint, n, **flags), batch)
        return built[key]

    return script


async def _round(handle: EngineHandle, ingress: Any, args: argparse.Namespace, flip: bool) -> dict[str, Any]:
    """One round: per endpoint, CPU-s per event of each path and per request of each path."""
    from pydantic import TypeAdapter
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    out: dict[str, Any] = {}
    for endpoint in ("chat", "completions"):
        body = request_body(endpoint, args.events)
        adapter: TypeAdapter[Any] = TypeAdapter(ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
        # The passthrough streams what the engine streamed to the ingress (what it asked for).
        await drain((await call(ingress, endpoint, body)).body_iterator)
        engine_saw = handle.calls[-1][1]
        events = {"ingress": 0.0, "passthrough": 0.0}
        request = {"ingress": 0.0, "parse": 0.0}
        for path in ("passthrough", "ingress") if flip else ("ingress", "passthrough"):
            for _ in range(args.streams):
                if path == "ingress":
                    t0 = time.process_time()
                    resp = await call(ingress, endpoint, body)
                    t1 = time.process_time()
                    await drain(resp.body_iterator)
                    t2 = time.process_time()
                    request["ingress"] += t1 - t0
                else:
                    stream = EngineStream(handle.script(endpoint, engine_saw))
                    t1 = time.process_time()
                    await drain(passthrough(stream))
                    t2 = time.process_time()
                    raw = json.dumps(body)
                    t3 = time.process_time()
                    adapter.validate_python(json.loads(raw))
                    request["parse"] += time.process_time() - t3
                events[path] += t2 - t1
        per_event = {k: v / (args.streams * args.events) for k, v in events.items()}
        per_request = {k: v / args.streams for k, v in request.items()}
        out[endpoint] = {"event": per_event, "request": per_request}
    return out


def _spread(values: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.median(values), qs[0], qs[2]


def report(rounds: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"ingress stream path vs bare passthrough: {args.events} JSON events a stream in batches of "
        f"{args.batch}, {args.streams} streams per path and endpoint per round, {len(rounds)} rounds "
        f"(CPU time of this process, time.process_time; migrations {'off' if args.migrations == 0 else 'on'})",
    ]
    for endpoint in rounds[0]:
        ratio = [r[endpoint]["event"]["ingress"] / r[endpoint]["event"]["passthrough"] for r in rounds]
        ing = [r[endpoint]["event"]["ingress"] * 1e6 for r in rounds]
        base = [r[endpoint]["event"]["passthrough"] * 1e6 for r in rounds]
        m, lo, hi = _spread(ratio)
        lines.append(
            f"  {endpoint:<11} per event: ingress {statistics.median(ing):.1f} CPU-µs, passthrough "
            f"{statistics.median(base):.2f} CPU-µs; ingress ÷ passthrough {m:.1f}x (p25-p75 {lo:.1f}-{hi:.1f}x)"
        )
        req = [r[endpoint]["request"]["ingress"] / r[endpoint]["request"]["parse"] for r in rounds]
        us = [r[endpoint]["request"]["ingress"] * 1e6 for r in rounds]
        m, lo, hi = _spread(req)
        lines.append(
            f"  {'':<11} per request until the response: {statistics.median(us):.0f} CPU-µs; ÷ one json.loads + "
            f"validation of the body {m:.1f}x (p25-p75 {lo:.1f}-{hi:.1f}x)"
        )
    load = os.getloadavg()
    lines.append(f"  machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingress_events", description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=200, help="JSON events per stream (default 200)")
    p.add_argument("--batch", type=int, default=8, help="events per batch after the first (default 8)")
    p.add_argument("--streams", type=int, default=5, help="streams per path, endpoint and round (default 5)")
    p.add_argument("--rounds", type=int, default=15, help="rounds, after one warm-up round (default 15)")
    p.add_argument(
        "--migrations", type=int, default=None, help="the ingress's resilience.migrations (default: the spec's)"
    )
    args = p.parse_args(argv)
    import logging

    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    handle = EngineHandle(_script(args.events, args.batch))
    ingress = make_ingress(handle, migrations=args.migrations)
    rounds = []
    for i in range(args.rounds + 1):
        result = asyncio.run(_round(handle, ingress, args, flip=i % 2 == 1))
        if i:  # the first round warms up imports and caches
            rounds.append(result)
    print(report(rounds, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
