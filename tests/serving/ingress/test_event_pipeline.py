"""The ingress's one pass over a streamed answer (serving/ingress/sse.py EventPipeline, driven by
guarded_stream in serving/ingress/relay.py, read by serving/ingress/routing.py's metering): each
event decoded once and encoded at most once, and the bytes a client reads those of the two
passes it replaced; the request dumped only for a continuation.

Driven through serving.ingress.server.AuthenticatedIngress in front of a stand-in decode handle that
streams vLLM-shaped events in Ray's batches (bench/ingress_events.py): the composition
app.py serves (auth, parse, hybrid routing, the resilient call, stream migration's record,
the metering), no Ray started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.exceptions import RayActorError
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

from bench.ingress_events import (
    PROMPT_IDS,
    EngineHandle,
    asked,
    batches,
    call,
    engine_events,
    make_ingress,
    piece,
    request_body,
)
from serving.ingress import sse

N = 50  # JSON events in a stream


def client_bytes(ingress: Any, endpoint: str, body: dict[str, Any]) -> str:
    async def go() -> str:
        resp = await call(ingress, endpoint, body)
        assert resp.status_code == 200
        return "".join([c async for c in resp.body_iterator])

    return asyncio.run(go())


def docs_of(text: str) -> list[Any]:
    """The client's events: each JSON value, or the data as it is ("[DONE]")."""
    out = []
    for raw in text.split("\n\n")[:-1]:
        assert raw.startswith("data: ")
        try:
            out.append(json.loads(raw[6:]))
        except ValueError:
            out.append(raw[6:])
    return out


def text_of(docs: list[Any]) -> str:
    return "".join(
        (c["delta"].get("content") or "") if "delta" in c else c["text"]
        for d in docs
        if isinstance(d, dict)
        for c in d.get("choices") or []
    )


@contextlib.contextmanager
def counted(monkeypatch: pytest.MonkeyPatch):
    """Counts every JSON decode and encode while inside: the stream's own decoder and encoder
    (serving/ingress/sse.py's msgspec ones) and any of the standard library (json.loads and
    any JSONDecoder, json.dumps and any JSONEncoder)."""
    calls = {"decode": 0, "encode": 0}
    raw_decode, encode = json.JSONDecoder.raw_decode, json.JSONEncoder.encode

    def counting_decode(self, *a, **kw):
        calls["decode"] += 1
        return raw_decode(self, *a, **kw)

    def counting_encode(self, *a, **kw):
        calls["encode"] += 1
        return encode(self, *a, **kw)

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, *a):
            calls["decode"] += 1
            return self.inner.decode(*a)

        def encode(self, *a):
            calls["encode"] += 1
            return self.inner.encode(*a)

    with monkeypatch.context() as m:
        m.setattr(json.JSONDecoder, "raw_decode", counting_decode)
        m.setattr(json.JSONEncoder, "encode", counting_encode)
        m.setattr(sse, "_DECODER", Counting(sse._DECODER))
        m.setattr(sse, "_ENCODER", Counting(sse._ENCODER))
        yield calls


# --- one decode per event ---------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("migrations", [2, 0])
def test_each_streamed_event_is_decoded_once_and_encoded_at_most_once(monkeypatch, endpoint, migrations):
    def script(ep, body):  # N JSON events: the tokens, chat's role chunk, the usage event
        return batches(engine_events(ep, N - (2 if ep == "chat" else 1), **asked(body)), 4)

    handle = EngineHandle(script)
    ingress = make_ingress(handle, migrations=migrations)

    async def go():
        resp = await call(ingress, endpoint, request_body(endpoint, N))
        with counted(monkeypatch) as calls:  # the stream only: the request was parsed above
            chunks = [c async for c in resp.body_iterator]
        return chunks, calls

    chunks, calls = asyncio.run(go())
    # The engine was asked for token ids (migration) and usage in every chunk (metering).
    assert asked(handle.calls[0][1]) == {"ids": migrations > 0, "every_usage": True, "final_usage": True}
    assert calls["decode"] == N
    docs = docs_of("".join(chunks))
    assert 0 < calls["encode"] <= N and calls["encode"] == len(docs) - 1  # every JSON event the client got
    # and nothing was lost on the way: the whole answer, no usage the client did not ask for
    assert text_of(docs) == "".join(piece(i) for i in range(N - (2 if endpoint == "chat" else 1)))
    assert docs[-1] == "[DONE]" and all(d["usage"] is None for d in docs[:-1])


def test_the_metering_counts_the_ingress_stream_when_it_ends_and_when_the_client_leaves():
    """The metering settles a stream of the ingress's own at its end: its usage counted once,
    its in-flight ticket closed, also for a client that goes away mid-stream."""
    handle = EngineHandle(lambda ep, body: batches(engine_events(ep, 12, **asked(body)), 2))
    ingress = make_ingress(handle, migrations=2)
    settled = []
    ingress._door.router._count = lambda ctx, where, usage, *cached: settled.append(
        (where, usage.prompt_tokens, usage.completion_tokens)
    )
    client_bytes(ingress, "chat", request_body("chat", 12))
    assert settled == [("cluster", len(PROMPT_IDS), 12)] and ingress._door.router.inflight.count() == 0

    async def leave_after_three_chunks():
        resp = await call(ingress, "completions", request_body("completions", 12))
        it = resp.body_iterator.__aiter__()
        got = [await it.__anext__() for _ in range(3)]
        await it.aclose()  # what Starlette does when the client goes away
        return got

    sent = docs_of("".join(asyncio.run(leave_after_three_chunks())))
    tokens = sum(len(d["choices"]) for d in sent)  # completions: one token a chunk here
    assert 3 <= tokens < 12
    assert settled[1:] == [("cluster", len(PROMPT_IDS), tokens)] and ingress._door.router.inflight.count() == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_one_engine_batch_reaches_the_client_as_one_chunk(endpoint):
    """Ray Serve LLM sends a stream's events in batches (streaming.batchIntervalMs): the
    ingress passes a batch on as one chunk, so Serve's proxy carries a message per batch,
    not one per token (as the fallback relay joins a provider's events)."""
    sent: list[list[str]] = []

    def script(ep, body):
        sent[:] = batches(engine_events(ep, 20, **asked(body)), 4)
        return sent

    ingress = make_ingress(EngineHandle(script), migrations=2)

    async def go():
        resp = await call(ingress, endpoint, request_body(endpoint, 20))
        return [c async for c in resp.body_iterator]

    chunks = asyncio.run(go())
    assert len(chunks) == len(sent) and len(docs_of(chunks[1])) == 4
    assert text_of(docs_of("".join(chunks))) == "".join(piece(i) for i in range(20))


# --- migration through the ingress ------------------------------------------------------------
def test_a_stream_that_is_never_cut_never_dumps_its_request(monkeypatch):
    """Migration needs the client's fields only for a continuation: a stream that ends well
    must not pay a pydantic dump of its whole body."""
    dumps = []
    for cls in (ChatCompletionRequest, CompletionRequest):
        real = cls.model_dump

        def counting(self, *a, _real=real, **kw):
            dumps.append((type(self).__name__, kw))
            return _real(self, *a, **kw)

        monkeypatch.setattr(cls, "model_dump", counting)
    handle = EngineHandle(lambda ep, body: batches(engine_events(ep, 6, **asked(body)), 2))
    ingress = make_ingress(handle, migrations=2)
    for endpoint in ("chat", "completions"):
        out = client_bytes(ingress, endpoint, request_body(endpoint, 6, seed=3, top_p=0.9))
        assert text_of(docs_of(out)) == "".join(piece(i) for i in range(6))
    assert handle.calls[0][1].return_token_ids  # the stream can still be continued
    assert dumps == []


def _dying_then_continuing(die_after: int, n: int):
    """An engine whose first stream breaks after `die_after` batches (replica died), and
    which continues any /v1/completions body whose prompt holds the answer's first ids."""

    def script(endpoint, body):
        if isinstance(getattr(body, "prompt", None), list):
            start = len(body.prompt) - len(PROMPT_IDS)
            return batches(
                engine_events("completions", body.max_tokens, rid="cont", start=start, **asked(body)),
                2,
            )
        items = batches(engine_events(endpoint, n, **asked(body)), 2)
        return [*items[:die_after], RayActorError()]

    return script


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_cut_stream_is_continued_with_the_fields_the_client_set(endpoint):
    n = 10
    handle = EngineHandle(_dying_then_continuing(3, n))
    ingress = make_ingress(handle, migrations=2)
    body = request_body(endpoint, n, seed=7, top_p=0.5, stop=["zz"], stream_options={"include_usage": True})
    docs = docs_of(client_bytes(ingress, endpoint, body))
    assert text_of(docs) == "".join(piece(i) for i in range(n))
    assert {d["id"] for d in docs if isinstance(d, dict)} == {"r-1"}
    assert docs[-2]["usage"]["completion_tokens"] == n and docs[-1] == "[DONE]"
    cont = handle.calls[-1][1]
    assert isinstance(cont, CompletionRequest) and isinstance(cont.prompt, list)
    assert (cont.seed, cont.top_p, cont.stop) == (7, 0.5, ["zz"])
    assert cont.max_tokens == n - (len(cont.prompt) - len(PROMPT_IDS))


# --- the bytes a client reads -------------------------------------------------------------------
# What the client read when each packet went through two passes, each decoding and writing
# every JSON event (the documented behaviour, not the code); the one pass keeps it byte for byte:
#  1. stream migration's relay (serving/ingress/migration.py, when the request can be continued): a
#     JSON object that is not an error event loses its token ids unless the client asked for
#     them, a chat chunk that exists only to carry ids (a delta with nothing but empty
#     content, no finish, no logprobs) is dropped, and the rest is written compact; [DONE],
#     comments, error events and what is not JSON go on as they came;
#  2. the metering (serving/ingress/sse.py): comments dropped, [DONE] as `data: [DONE]`, a JSON object
#     loses kv_transfer_params / ec_transfer_params, its usage read: a usage-only event
#     dropped unless the client asked for usage, a chunk's usage set to null (the client never
#     asked for continuous usage), written compact (json.dumps, UTF-8 as vLLM writes it); other
#     data as it came.
def _events(packet: str) -> list[tuple[str, list[str]]]:
    out = []
    for raw in packet.split("\n\n"):
        if raw.strip():
            out.append((raw, [ln[5:] for ln in raw.split("\n") if ln.startswith("data:")]))
    return out


def _relay_pass(packet: str, client_ids: bool, chat: bool) -> str:
    out = ""
    for raw, data in _events(packet):
        try:
            doc = json.loads(data[-1]) if data and data[-1].strip() != "[DONE]" else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or "error" in doc:
            out += raw + "\n\n"
            continue
        if not client_ids:
            doc.pop("prompt_token_ids", None)
            for c in doc.get("choices") or []:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
            if chat and doc.get("choices"):
                carries = [
                    set(c.get("delta") or {}) - {"content"}
                    or (c.get("delta") or {}).get("content")
                    or c.get("finish_reason")
                    or c.get("logprobs") is not None
                    for c in doc["choices"]
                ]
                if not any(carries):
                    continue
        out += "data: " + json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n\n"
    return out


def _metering_pass(text: str, asked_usage: bool) -> str:
    out = ""
    for _raw, lines in _events(text):
        if not lines:
            continue
        data = "\n".join(ln.lstrip() for ln in lines)
        if data.strip() == "[DONE]":
            out += "data: [DONE]\n\n"
            continue
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            out += f"data: {data}\n\n"
            continue
        doc.pop("kv_transfer_params", None)
        doc.pop("ec_transfer_params", None)
        if doc.get("usage"):
            if not doc.get("choices"):
                if not asked_usage:
                    continue
            else:
                doc["usage"] = None
        out += "data: " + json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n\n"
    return out


def two_passes(packets: list[str], *, relay: bool, client_ids: bool, chat: bool, asked_usage: bool) -> str:
    relayed = "".join(_relay_pass(p, client_ids, chat) if relay else p for p in packets)
    return _metering_pass(relayed, asked_usage)


EXTRA = {
    "comment": ": keep-alive\n\n",
    "error": 'data: {"error":{"message":"bad logit_bias","type":"BadRequestError","param":null,"code":400}}\n\n',
    "not_json": "data: not json\n\n",
    "list": "data: [1, 2]\n\n",
    "ec": 'data: {"id":"r-1","choices":[],"ec_transfer_params":{"x":1}}\n\n',
}


@settings(max_examples=120, deadline=None)
@given(
    endpoint=st.sampled_from(["chat", "completions"]),
    n=st.integers(min_value=1, max_value=14),
    asked_usage=st.booleans(),
    client_ids=st.booleans(),
    logprobs=st.booleans(),
    migrations=st.sampled_from([2, 0]),
    held=st.frozensets(st.integers(min_value=0, max_value=13), max_size=3),
    kv=st.booleans(),
    extras=st.lists(st.tuples(st.integers(min_value=0, max_value=12), st.sampled_from(sorted(EXTRA))), max_size=3),
    batch=st.integers(min_value=1, max_value=4),
)
def test_the_client_reads_the_bytes_of_the_relay_then_the_metering(
    endpoint, n, asked_usage, client_ids, logprobs, migrations, held, kv, extras, batch
):
    sent: list[list[str]] = []

    def script(ep, body):
        events = engine_events(ep, n, held=held, kv=kv, logprobs=logprobs, **asked(body))
        for at, kind in sorted(extras, reverse=True):
            events.insert(min(at, len(events) - 1), EXTRA[kind])  # before [DONE]
        items = batches(events, batch)
        sent.extend(items)
        return items

    ingress = make_ingress(EngineHandle(script), migrations=migrations)
    extra: dict[str, Any] = {}
    if asked_usage:
        extra["stream_options"] = {"include_usage": True}
    if client_ids:
        extra["return_token_ids"] = True
    if logprobs:
        extra["logprobs"] = True if endpoint == "chat" else 1
    got = client_bytes(ingress, endpoint, request_body(endpoint, n, **extra))
    relay = migrations > 0 and not logprobs  # logprobs: the request cannot be continued
    want = two_passes(
        ["".join(b) for b in sent], relay=relay, client_ids=client_ids, chat=endpoint == "chat", asked_usage=asked_usage
    )
    assert got == want
    # not vacuous: the whole answer is there (its bytes are the two passes' above, UTF-8 where
    # the ingress wrote an event, as vLLM's server writes it)
    assert text_of(docs_of(got)) == "".join(piece(i) for i in range(n))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_cut_that_cannot_be_continued_ends_with_one_compact_error_event(endpoint):
    """The ingress's own error event goes through the metering like the engine's events."""
    n = 6

    def script(ep, body):
        return [*batches(engine_events(ep, n, **asked(body)), 2)[:2], RayActorError()]

    ingress = make_ingress(EngineHandle(script), migrations=2)
    out = client_bytes(ingress, endpoint, request_body(endpoint, n, logprobs=True if endpoint == "chat" else 1))
    tail = (
        'data: {"error":{"message":"The model stream failed; the answer is incomplete.",'
        '"type":"server_error","param":null,"code":500}}\n\ndata: [DONE]\n\n'
    )
    assert out.endswith(tail) and out.count("data: [DONE]") == 1
    assert text_of(docs_of(out)[:-2]) == "".join(piece(i) for i in range(2 if endpoint == "chat" else 3))


def test_a_cut_after_the_last_token_ends_with_the_finish_and_the_usage_asked_for():
    """Every token was generated before the death: no continuation, the ingress writes the
    usage event itself, and it reaches the client through the metering."""
    n = 5

    def script(ep, body):
        events = engine_events(ep, n, **asked(body))
        return [*batches(events[:-2], 1), RayActorError()]  # the finish sent, the usage event not

    handle = EngineHandle(script)
    ingress = make_ingress(handle, migrations=2)
    out = client_bytes(ingress, "completions", request_body("completions", n, stream_options={"include_usage": True}))
    docs = docs_of(out)
    assert len(handle.calls) == 1 and text_of(docs) == "".join(piece(i) for i in range(n))
    assert docs[-2] == {
        "id": "r-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n, "total_tokens": len(PROMPT_IDS) + n},
    }
    assert out.endswith('"total_tokens":13}}\n\ndata: [DONE]\n\n') and out.count("[DONE]") == 1
