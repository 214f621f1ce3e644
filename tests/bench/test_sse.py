"""bench/sse.py, the one streamed-request client of the benches and e2e tests, against canned
answers in OpenAI's streamed format (an httpx MockTransport: no server, no Ray)."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.sse import Streamed, stream_request


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _run(handler) -> Streamed:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await stream_request(c, "http://x/v1/completions", {"stream": True})

    return asyncio.run(go())


def _text(t):
    return {"choices": [{"index": 0, "text": t}]}


def test_a_complete_stream_is_ok_with_its_text_usage_and_path():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},  # a role event carries no text
        _text("Hel"),
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    got = _run(lambda req: httpx.Response(200, content=body, headers={"x-served-by": "fallback"}))
    assert got.ok and got.kind == "ok"
    assert got.text == "Hello" and len(got.token_times) == 2
    assert got.usage == usage and got.served_by == "fallback"
    assert got.ttfb_s is not None and got.ttft_s is not None and got.ttft_s >= got.ttfb_s


def test_an_error_event_after_text_is_a_stream_error():
    body = _sse(_text("Hi"), {"error": {"message": "engine died", "code": 500}}, "[DONE]")
    got = _run(lambda req: httpx.Response(200, content=body))
    assert not got.ok and got.kind == "stream_error"
    assert got.error_event == {"error": {"message": "engine died", "code": 500}}


def test_a_stream_without_done_is_not_ok():
    got = _run(lambda req: httpx.Response(200, content=_sse(_text("Hi"))))
    assert got.text == "Hi" and not got.done and got.kind == "stream_error"


def test_a_refusal_keeps_its_status_and_retry_after():
    got = _run(lambda req: httpx.Response(503, json={"error": {"message": "busy"}}, headers={"Retry-After": "1"}))
    assert got.kind == "http_503" and got.retry_after == "1" and not got.ok
    assert got.error is not None and "busy" in got.error and got.ttft_s is None


def test_no_answer_is_a_connection_error_and_a_read_timeout_is_hung():
    def refuse(req):
        raise httpx.ConnectError("refused", request=req)

    def silent(req):
        raise httpx.ReadTimeout("no byte", request=req)

    assert _run(refuse).kind == "conn_error"
    assert _run(silent).kind == "hung"


def test_each_event_counts_its_tokens_from_its_token_ids_or_its_text():
    # vLLM's `return_token_ids` puts each event's token ids in its choice (a stop string held
    # back leaves an event with ids and no text); without them an event with text is one token.
    ids = {"choices": [{"index": 0, "text": "abc", "token_ids": [5, 6, 7]}]}
    held = {"choices": [{"index": 0, "text": "", "token_ids": [8]}]}
    body = _sse(ids, held, _text("d"), {"choices": [], "usage": {"completion_tokens": 5}}, "[DONE]")
    got = _run(lambda req: httpx.Response(200, content=body))
    assert [n for _, n in got.chunk_tokens] == [3, 1, 1]
    assert len(got.token_times) == 2  # the events with text, as before
    assert [t for t, _ in got.chunk_tokens] == sorted(t for t, _ in got.chunk_tokens)
