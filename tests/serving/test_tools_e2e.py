"""Tool calling on the running local stack (the shared e2e stack), through the openai client.

The tiny model has a tool parser in its spec as a cloud model would (local/config.py
LOCAL_TOOLS: hermes, auto choice on, a template that renders tools). Its weights are random,
so what it says is noise: but with tool_choice `required` or a named function vLLM's
structured outputs force a call that matches the tool's schema, whatever the model, and that
is what these tests hold the stack to, under P/D and aggregated, streamed and not, through
the openai client's typed objects. The same requests to a plain vLLM server of the same model
(the stand-in provider's, with the same flags) give the same calls: P/D adds nothing to them.
`auto` and `none` are answered (no 400), and the fallback sends tools to the provider and
relays its tool-call deltas as they came.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from local.provider import EXTERNAL_MODEL
from serving.ingress.sse import decode_packet
from tests.conftest import E2E_KEY
from tests.serving.ingress.test_routing_e2e import (  # noqa: F401 - fixtures
    base_user_config,
    restore,
    set_user_config,
    with_fallback,
)

pytestmark = pytest.mark.e2e

CITIES, UNITS = ["Paris", "Tokyo", "Lima"], ["celsius", "fahrenheit"]
# Bounded values only: a free string is as long as the model makes it, and random weights
# never close one; an enum or a boolean always ends.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}, "unit": {"type": "string", "enum": UNITS}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}, "exact": {"type": "boolean"}},
    "required": ["city", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a city.", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
ASK = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 96}
ROUTES = ["disaggregated", "aggregated"]


def _client(url: str, key: str = E2E_KEY):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=180)


def _matches(name: str, arguments: str) -> dict[str, Any]:
    """The arguments parsed, checked against the tool's schema (every key, enum values only)."""
    args = json.loads(arguments)
    schema = SCHEMAS[name]
    assert set(args) == set(schema["required"]), args
    for key, value in args.items():
        prop = schema["properties"][key]
        assert value in prop["enum"] if "enum" in prop else isinstance(value, bool), (key, value)
    return args


def _calls(message) -> list[tuple[str, dict[str, Any]]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        out.append((call.function.name, _matches(call.function.name, call.function.arguments)))
    return out


def _streamed_calls(chunks) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The calls a stream's tool-call deltas assemble (by index, as the openai docs say), and
    its finish reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names[delta.index] = delta.function.name
                if delta.function and delta.function.arguments:
                    arguments[delta.index] = arguments.get(delta.index, "") + delta.function.arguments
            finish = choice.finish_reason or finish
    assert names, "no tool call in the stream"
    return [(names[i], _matches(names[i], arguments.get(i, ""))) for i in sorted(names)], finish


def _create(client, model: str, **kw):
    return client.chat.completions.create(model=model, **{**ASK, **kw})


@pytest.mark.parametrize("route", ROUTES)
def test_a_named_tool_choice_gets_a_call_of_that_tool_matching_its_schema(stack, route):
    client = _client(stack.urls[route])
    answer = _create(client, stack.model, tool_choice=NAMED)
    choice = answer.choices[0]
    calls = _calls(choice.message)
    assert [name for name, _ in calls] == ["get_weather"]
    # OpenAI: a forced function ends with "stop" (vLLM answers so too).
    assert choice.finish_reason == "stop"
    streamed, finish = _streamed_calls(_create(client, stack.model, tool_choice=NAMED, stream=True))
    assert streamed == calls and finish == "stop"


@pytest.mark.parametrize("route", ROUTES)
def test_required_gets_at_least_one_call_of_a_given_tool(stack, route):
    client = _client(stack.urls[route])
    answer = _create(client, stack.model, tool_choice="required")
    choice = answer.choices[0]
    calls = _calls(choice.message)
    assert calls and all(name in SCHEMAS for name, _ in calls)
    assert choice.finish_reason == "tool_calls"
    streamed, finish = _streamed_calls(_create(client, stack.model, tool_choice="required", stream=True))
    assert streamed == calls and finish == "tool_calls"
    # parallel_tool_calls false: exactly one call.
    one = _create(client, stack.model, tool_choice="required", parallel_tool_calls=False)
    assert len(_calls(one.choices[0].message)) == 1


@pytest.mark.parametrize("route", ROUTES)
def test_auto_and_none_are_answered(stack, route):
    """auto: the model decides (random weights write text; a call it wrote would be parsed);
    none: no call. Neither is the 400 a stack without a parser gave."""
    client = _client(stack.urls[route])
    for choice_kw in ({}, {"tool_choice": "auto"}):
        answer = _create(client, stack.model, max_tokens=16, **choice_kw)
        message = answer.choices[0].message
        if message.tool_calls:
            _calls(message)
        else:
            assert isinstance(message.content, str)
    none = _create(client, stack.model, tool_choice="none", max_tokens=16)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    chunks = list(_create(client, stack.model, tool_choice="none", max_tokens=16, stream=True))
    assert not any(d.delta.tool_calls for c in chunks for d in c.choices)


def test_pd_gives_the_calls_a_plain_vllm_server_gives(stack, provider):
    """The same model on vLLM's own OpenAI server with the same flags (the stand-in
    provider's vLLM, asked directly): the same calls, streamed and not."""
    pd, plain = _client(stack.urls["disaggregated"]), _client(provider.vllm_url, "none")
    for tool_choice in (NAMED, "required"):
        ours = _calls(_create(pd, stack.model, tool_choice=tool_choice).choices[0].message)
        theirs = _calls(_create(plain, EXTERNAL_MODEL, tool_choice=tool_choice).choices[0].message)
        assert ours == theirs, tool_choice
        ours_streamed = _streamed_calls(_create(pd, stack.model, tool_choice=tool_choice, stream=True))
        theirs_streamed = _streamed_calls(_create(plain, EXTERNAL_MODEL, tool_choice=tool_choice, stream=True))
        assert ours_streamed == theirs_streamed, tool_choice


def _deltas(chunks: list[dict[str, Any]]) -> list[list[tuple[int, str | None, str | None]]]:
    """Each chunk's tool-call deltas (chunks as JSON objects), without the ids a server makes up
    per request."""
    return [
        [(d["index"], (d.get("function") or {}).get("name"), (d.get("function") or {}).get("arguments"))]
        for c in chunks
        for ch in c.get("choices") or []
        for d in (ch.get("delta") or {}).get("tool_calls") or []
    ]


def test_the_fallback_sends_tools_and_relays_the_providers_call(stack, provider, restore):  # noqa: F811
    # A first-token deadline no engine can meet: every stream goes to the provider.
    set_user_config(stack, with_fallback(stack, provider, when=["deadline"], first_token_timeout_s=0.001))
    provider.clear()
    client = _client(stack.urls["disaggregated"])
    with client.chat.completions.with_streaming_response.create(
        model=stack.model, stream=True, tool_choice=NAMED, parallel_tool_calls=False, **ASK
    ) as raw:
        assert raw.headers["x-served-by"] == "fallback"
        relayed = list(raw.parse())
    (sent,) = [r.body for r in provider.records]
    assert sent["model"] == EXTERNAL_MODEL
    assert (sent["tools"], sent["tool_choice"], sent["parallel_tool_calls"]) == (TOOLS, NAMED, False)
    assert {c.model for c in relayed} == {stack.model}
    calls, finish = _streamed_calls(relayed)
    assert [name for name, _ in calls] == ["get_weather"] and finish == "stop"
    # What the provider sent for this request: the same tool-call deltas, in order. (Not a
    # second request's: vLLM merges a stream's outputs while its reader lags, so two streams of
    # the same answer can split the arguments differently.)
    deadline = time.monotonic() + 10  # the provider records an answer once its stream has ended
    while not provider.answers and time.monotonic() < deadline:
        time.sleep(0.1)
    (answer,) = provider.answers
    answered = [e.doc for e in decode_packet(answer.decode()) if isinstance(e.doc, dict)]
    assert _deltas([c.model_dump() for c in relayed]) == _deltas(answered)
