"""serving/ingress/fallback.py: what goes upstream, what comes back, and how failures read."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serving.ingress.fallback import SERVED_BY, FallbackClient, FallbackConfig, FallbackError
from serving.ingress.sse import ask_for_usage

FALLBACK_KEY = "sk-provider-key"


def _config(**over) -> FallbackConfig:
    cfg = {
        "base_url": "https://llm.example.com/api/v1/",
        "models": {"ours": "their/model"},
        "when": ["unavailable", "overloaded", "deadline"],
        "overflow_at": 4,
        "first_token_timeout_s": 5,
        "timeout_s": 10,
        "connect_timeout_s": 1,
        "retries": 0,
        **over,
    }
    return FallbackConfig.from_user_config(cfg)


def _client(handler, monkeypatch, **over) -> tuple[FallbackClient, list[httpx.Request]]:
    monkeypatch.setenv("PD_FALLBACK_API_KEY", FALLBACK_KEY)
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    return FallbackClient(_config(**over), transport=httpx.MockTransport(record)), seen


def _event_stream(**body) -> httpx.Response:
    """The provider's 200 with an event stream: `content=` (bytes or an async generator) or
    `stream=` (an httpx.AsyncByteStream)."""
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, **body)


def _forward(client, endpoint, body, asked_usage=True):
    done = []

    async def go():
        resp = await client.forward(
            endpoint,
            body,
            model="ours",
            reason="unavailable",
            client_asked_usage=asked_usage,
            on_done=lambda u, ok: done.append((u, ok)),
        )
        chunks = []
        if hasattr(resp, "body_iterator"):
            async for c in resp.body_iterator:
                chunks.append(c)
        return resp, chunks

    resp, chunks = asyncio.run(go())
    return resp, chunks, done


def test_only_the_body_and_our_key_go_upstream(monkeypatch):
    client, seen = _client(
        lambda r: httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "model": "their/model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            },
        ),
        monkeypatch,
    )
    body = {"model": "ours", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "top_k": 2}
    resp, _, done = _forward(client, "chat", body)
    (req,) = seen
    assert str(req.url) == "https://llm.example.com/api/v1/chat/completions"
    assert req.headers["authorization"] == f"Bearer {FALLBACK_KEY}"
    # Nothing but what we set ourselves (httpx adds host, length, encoding, connection).
    assert set(req.headers) <= {
        "authorization",
        "user-agent",
        "accept",
        "content-type",
        "content-length",
        "host",
        "accept-encoding",
        "connection",
    }
    # OpenAI's documented fields only: top_k is a vLLM extension another provider may refuse.
    sent = {k: v for k, v in body.items() if k != "top_k"}
    assert json.loads(req.content) == {**sent, "model": "their/model"}
    assert body["model"] == "ours"  # the caller's dict is not changed
    assert resp.status_code == 200 and resp.headers[SERVED_BY] == "fallback"
    assert json.loads(resp.body)["model"] == "ours"
    ((usage, ok),) = done
    assert ok and (usage.prompt_tokens, usage.completion_tokens) == (5, 2)


def _sse(*events: dict | str) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def test_stream_is_relayed_event_by_event_with_our_model_and_usage_read(monkeypatch):
    stream = _sse(
        {"object": "chat.completion.chunk", "model": "their/model", "choices": [{"delta": {"content": "a"}}]},
        {"object": "chat.completion.chunk", "model": "their/model", "choices": [{"delta": {"content": "b"}}]},
        {
            "object": "chat.completion.chunk",
            "model": "their/model",
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2},
        },
        "[DONE]",
    )
    client, seen = _client(lambda r: _event_stream(content=stream), monkeypatch)
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    asked = ask_for_usage(body)
    assert asked is False and body["stream_options"] == {"include_usage": True}
    _, chunks, done = _forward(client, "chat", body, asked_usage=asked)
    assert json.loads(seen[0].content)["stream_options"] == {"include_usage": True}
    events = [c[len("data: ") :].strip() for c in chunks]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    # The usage-only event we asked for is not shown to a client that did not ask.
    assert [p["choices"][0]["delta"]["content"] for p in payloads] == ["a", "b"]
    assert {p["model"] for p in payloads} == {"ours"}
    ((usage, ok),) = done
    assert ok and (usage.prompt_tokens, usage.completion_tokens) == (9, 2)


@pytest.mark.parametrize(
    "status,ours,code",
    [
        (400, 400, "fallback_rejected"),
        (401, 503, "fallback_failed"),
        (429, 503, "fallback_failed"),
        (500, 503, "fallback_failed"),
        (404, 400, "fallback_rejected"),
    ],
)
def test_provider_errors_become_ours(monkeypatch, status, ours, code):
    client, _ = _client(
        lambda r: httpx.Response(
            status, json={"error": {"message": "their words", "type": "x"}}, headers={"retry-after": "3"}
        ),
        monkeypatch,
    )
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    e = err.value
    assert (e.status, e.code) == (ours, code)
    assert "unavailable" in e.message  # why the cluster was skipped
    assert "their words" not in e.message  # the provider's text is logged, never relayed
    if status == 429:
        assert e.retry_after_s == 3


def test_unreachable_and_slow_providers(monkeypatch):
    def refuse(r):
        raise httpx.ConnectError("refused")

    client, _ = _client(refuse, monkeypatch)
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    assert err.value.status == 503 and "could not be reached" in err.value.message

    def slow(r):
        raise httpx.ReadTimeout("slow")

    client, _ = _client(slow, monkeypatch)
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    assert err.value.status == 504


def test_a_model_without_a_mapping_is_not_sent(monkeypatch):
    client, seen = _client(lambda r: httpx.Response(200, json={}), monkeypatch, models={"other": "x"})
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    assert seen == [] and "no fallback model" in err.value.message


def test_a_stream_that_fails_after_its_first_event_ends_with_an_error_event(monkeypatch):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield _sse({"model": "their/model", "choices": [{"text": "a"}]})
            raise httpx.RemoteProtocolError("peer closed")

    client, _ = _client(lambda r: _event_stream(stream=Broken()), monkeypatch)
    _, chunks, done = _forward(client, "completions", {"model": "ours", "prompt": "x", "stream": True})
    assert json.loads(chunks[0][6:])["model"] == "ours"
    assert '"fallback_failed"' in chunks[1] and chunks[-1] == "data: [DONE]\n\n"
    assert done[0][1] is False


def test_a_streamed_answer_is_relayed_first_event_at_once_then_in_batches(monkeypatch):
    n = 12

    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(n):
                yield _sse({"model": "their/model", "choices": [{"text": f"t{i}"}]})
                await asyncio.sleep(0.01)
            yield _sse("[DONE]")

    def relay(**over):
        client, _ = _client(
            lambda r: _event_stream(stream=Trickle()),
            monkeypatch,
            **over,
        )
        _, chunks, done = _forward(client, "completions", {"model": "ours", "prompt": "x", "stream": True})
        assert done[0][1] is True
        return chunks

    one_by_one = relay()
    batched = relay(batch_interval_ms=50)
    assert len(one_by_one) == n + 1
    # The same bytes, fewer messages; the first event alone, not held for an interval.
    assert "".join(batched) == "".join(one_by_one)
    assert batched[0] == one_by_one[0]
    assert len(batched) <= n // 3


def _chunk(text: str | None = None, finish: str | None = None) -> dict:
    return {
        "object": "chat.completion.chunk",
        "model": "their/model",
        "choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}],
    }


def _streamed(monkeypatch, content: bytes, **kw):
    client, seen = _client(lambda r: _event_stream(content=content), monkeypatch, **kw)
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    _, chunks, done = _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    return [c[len("data: ") :].strip() for c in "".join(chunks).split("\n\n") if c.strip()], done, seen


def test_a_finished_stream_without_done_still_ends_with_done(monkeypatch):
    events, done, _ = _streamed(monkeypatch, _sse(_chunk("hi"), _chunk(finish="stop")))
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    ((_, ok),) = done
    assert ok


def test_a_stream_cut_before_its_end_gets_an_error_event_then_done_and_its_tokens_are_counted(monkeypatch):
    events, done, _ = _streamed(monkeypatch, _sse(_chunk("12345678"), _chunk("abcd")))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "fallback_failed"
    ((usage, ok),) = done
    # No usage event came: 12 characters relayed count as 3 completion tokens (4 a token).
    assert not ok and usage.completion_tokens == 3


def test_keep_alive_comments_do_not_hold_the_first_event_past_the_answers_deadline(monkeypatch):
    async def comments():
        for _ in range(100):
            yield b": keep-alive\n\n"
            await asyncio.sleep(0.05)

    client, _ = _client(
        lambda r: _event_stream(content=comments()),
        monkeypatch,
        timeout_s=0.3,  # the provider's whole answer; the comments keep coming for 5 s
        first_token_timeout_s=0.001,  # the cluster's bound: not the provider's
    )
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(FallbackError) as err:
        _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    assert err.value.status == 504 and "no event in time" in err.value.message


def test_a_provider_that_stalls_after_its_first_event_is_cut_at_the_answers_deadline(monkeypatch):
    async def stalls():
        yield _sse(_chunk("hi"))
        await asyncio.sleep(5)  # far past the answer's deadline
        yield _sse(_chunk("late", "stop"), "[DONE]")

    client, _ = _client(
        lambda r: _event_stream(content=stalls()),
        monkeypatch,
        timeout_s=0.3,
    )
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    _, chunks, done = _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    # Cut at the deadline, not after the stall: the event that ends the stall never arrives.
    events = [line[len("data: ") :] for line in "".join(chunks).splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hi" and "late" not in "".join(chunks)
    assert json.loads(events[-2])["error"]["message"] == "The fallback did not finish the answer in time."
    assert events[-1] == "[DONE]"
    ((_, ok),) = done
    assert not ok


def test_a_provider_that_refuses_stream_options_is_asked_again_without_it(monkeypatch):
    calls = []

    def provider(r):
        calls.append(json.loads(r.content))
        if "stream_options" in calls[-1]:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument: stream_options"}})
        return _event_stream(content=_sse(_chunk("hi", "stop"), "[DONE]"))

    client, _ = _client(provider, monkeypatch)
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    resp, chunks, _done = _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    assert resp.status_code == 200 and len(calls) == 2 and "stream_options" not in calls[1]
    assert "".join(chunks).rstrip().endswith("data: [DONE]")


def test_reconfiguring_retires_the_client_without_cutting_a_live_stream(monkeypatch):
    release = asyncio.Event()

    async def slow_stream():
        yield _sse(_chunk("a"))
        await release.wait()
        yield _sse(_chunk("b", "stop"), "[DONE]")

    client, _ = _client(
        lambda r: _event_stream(content=slow_stream()),
        monkeypatch,
    )

    async def go():
        body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        resp = await client.forward(
            "chat", body, model="ours", reason="unavailable", client_asked_usage=True, on_done=lambda u, ok: None
        )
        it = resp.body_iterator.__aiter__()
        first = await it.__anext__()
        client.retire()  # a new configuration arrived mid-stream
        await asyncio.sleep(0.05)
        assert not client.closed and client.active == 1
        release.set()
        rest = [c async for c in it]
        await asyncio.sleep(0.05)
        return first, rest

    first, rest = asyncio.run(go())
    assert '"a"' in first and '"b"' in "".join(rest) and "".join(rest).rstrip().endswith("[DONE]")
    assert client.closed and client.active == 0


def test_the_clusters_first_token_bound_does_not_apply_to_the_provider(monkeypatch):
    # fallback.firstTokenTimeoutS sends a slow cluster request to the provider; a provider
    # that answers later than that (but within timeoutS) is still relayed.
    async def slow_first():
        await asyncio.sleep(0.05)
        yield _sse(_chunk("hi", "stop"), "[DONE]")

    client, _ = _client(
        lambda r: _event_stream(content=slow_first()),
        monkeypatch,
        first_token_timeout_s=0.001,
    )
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    resp, chunks, _ = _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    assert resp.status_code == 200 and "".join(chunks).rstrip().endswith("data: [DONE]")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize(
    "choice", ["auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tools_and_tool_choice_go_to_the_provider_and_its_call_comes_back(monkeypatch, choice):
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    }
    client, seen = _client(
        lambda r: httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "model": "their/model",
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59},
            },
        ),
        monkeypatch,
    )
    body = {
        "model": "ours",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
    }
    resp, _, _ = _forward(client, "chat", body)
    assert json.loads(seen[0].content) == {**body, "model": "their/model"}
    answer = json.loads(resp.body)
    assert answer["choices"][0]["message"] == message and answer["choices"][0]["finish_reason"] == "tool_calls"


def test_a_streamed_tool_call_is_relayed_delta_by_delta_unchanged(monkeypatch):
    deltas = [
        {
            "role": "assistant",
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ],
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    events = [
        {"object": "chat.completion.chunk", "model": "their/model", "choices": [{"index": 0, "delta": d}]}
        for d in deltas
    ]
    events.append(
        {
            "object": "chat.completion.chunk",
            "model": "their/model",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
        }
    )
    client, _ = _client(
        lambda r: _event_stream(content=_sse(*events, "[DONE]")),
        monkeypatch,
    )
    body = {"model": "ours", "stream": True, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    _, chunks, done = _forward(client, "chat", body, asked_usage=ask_for_usage(body))
    relayed = [e for c in chunks for e in c.split("\n\n") if e.startswith("data: ")]
    assert relayed[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in relayed[:-1]]
    # Only the model name is ours; every delta is the provider's, in order.
    assert payloads == [{**e, "model": "ours"} for e in events]
    ((_, ok),) = done
    assert ok


def test_a_provider_answer_nested_past_the_parser_is_a_bad_gateway_not_a_crash(monkeypatch):
    """An answer nested past Python's recursion limit raises RecursionError in json, not
    ValueError: it is the provider's malformed answer (502), and its error text only unread."""
    deep = b"[" * 100_000
    client, _ = _client(lambda r: httpx.Response(200, content=deep), monkeypatch)
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    assert err.value.status == 502
    client, _ = _client(lambda r: httpx.Response(400, content=deep), monkeypatch)
    with pytest.raises(FallbackError) as err:
        _forward(client, "completions", {"model": "ours", "prompt": "x"})
    assert err.value.status == 400
