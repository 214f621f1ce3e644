"""Request bodies for `make conformance`: generated, seeded, over every field the ingress allows.

What flows through here: a seed and a count -> hypothesis strategies, one per field of the
ingress's registry (serving.ingress.fields.ALLOWED, chat and completions), each drawing the
value classes clients really send: ints as floats or strings, nulls, empty lists, unicode,
long stop strings, lists of prompts, token-id prompts, tools with every `tool_choice`,
structured output, logprobs 0..5, `n`, `echo`, streams with and without `stream_options` ->
a list of `Case`s: the endpoint, the body, and the token after which the harness cuts the
stream of the forced-migration path. tests/bench/test_conformance_bodies.py holds that every
allowed field has a strategy and that vLLM's own request models take what is drawn (or
refuse it, as a client's bad value is refused: the harness compares both answers).

Why bounded values: every body is answered by five servers on two cores; `max_tokens` is
small, and a chat without a cap gets a prompt that leaves little of the context, so that it
still ends (and the continuation's cap, the context left, is exercised).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from serving.ingress.fields import ALLOWED, CHAT, COMPLETIONS

MODEL = "tiny-llama"
# The tiny model's context (local/config.py MAX_MODEL_LEN): a prompt that leaves LEFT_TOKENS.
CONTEXT_TOKENS = 1024
WORDS = ("the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "tool", "call", "weather", "ok")
UNICODE = ("é", "ß", "日本", "🙂", "\u200b", "Ω", "\\n", '"', "{", "}")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}},
    },
]
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@dataclass(frozen=True)
class Case:
    """One generated request: where it goes, what it says, and where the migration path cuts it."""

    endpoint: str  # "chat" or "completions"
    body: dict[str, Any]
    cut_after: int  # the forced-migration path cuts the stream after this many tokens

    def key(self) -> str:
        return json.dumps([self.endpoint, self.body], sort_keys=True, ensure_ascii=False)


# --- value classes ------------------------------------------------------------------------------
def as_client_sends(ints: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    """An int as clients send it: mostly an int, sometimes 3.0, "3" or null."""
    return st.one_of(
        ints,
        ints,
        ints,
        ints.map(float),
        ints.map(str),
        st.none(),
    )


def _floats(lo: float, hi: float) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.floats(lo, hi, allow_nan=False).map(lambda f: round(f, 3)), st.integers(int(lo), int(hi)), st.none()
    )


def text(min_words: int = 1, max_words: int = 12) -> st.SearchStrategy[str]:
    piece = st.one_of(st.sampled_from(WORDS), st.sampled_from(WORDS), st.sampled_from(UNICODE))
    return st.lists(piece, min_size=min_words, max_size=max_words).map(" ".join)


def _stop() -> st.SearchStrategy[Any]:
    one = st.one_of(st.sampled_from(WORDS), st.sampled_from(["\n", ".", " the", "at"]), text(1, 3), st.just("x" * 40))
    return st.one_of(st.none(), one, st.lists(one, min_size=0, max_size=4))


def _long_prompt(left: int) -> str:
    """Words that take all but about `left` tokens of the context (one word, about one token)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(CONTEXT_TOKENS - left - 40))


# --- the fields ---------------------------------------------------------------------------------
def common_fields() -> dict[str, st.SearchStrategy[Any]]:
    """Chat's and completions' sampling and output fields (the registry's shared part)."""
    return {
        "model": st.sampled_from([MODEL, MODEL, None]),
        "frequency_penalty": _floats(-2, 2),
        "presence_penalty": _floats(-2, 2),
        "logit_bias": st.one_of(
            st.none(), st.dictionaries(st.integers(0, 4095).map(str), _floats(-100, 100), max_size=3)
        ),
        "seed": as_client_sends(st.integers(0, 2**31)),
        "stop": _stop(),
        "temperature": st.one_of(st.just(0), st.just(0.0), st.just(0), st.floats(0.1, 2.0).map(lambda f: round(f, 2))),
        "top_p": _floats(0.1, 1),
        "user": st.one_of(st.none(), text(1, 2)),
        "stream_options": st.one_of(
            st.none(), st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), st.just({})
        ),
        "max_tokens": as_client_sends(st.integers(1, 24)),
        "stream": st.one_of(st.booleans(), st.none()),
        "n": as_client_sends(st.integers(1, 3)),
        "top_k": as_client_sends(st.sampled_from([-1, 0, 1, 5, 40])),
        "min_p": _floats(0, 1),
        "repetition_penalty": _floats(1, 2),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 4095), max_size=3)),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "bad_words": st.one_of(st.just([]), st.lists(st.sampled_from(WORDS), max_size=2)),
        "cache_salt": st.one_of(st.none(), text(1, 2)),
        "min_tokens": as_client_sends(st.integers(0, 30)),
        "return_token_ids": st.one_of(st.none(), st.booleans()),
        "structured_outputs": st.one_of(
            st.none(), st.just({"choice": ["yes", "no"]}), st.just({"regex": "[a-z]{1,8}"}), st.just({})
        ),
        "truncate_prompt_tokens": st.one_of(st.none(), st.integers(-1, 64)),
        "add_special_tokens": st.booleans(),
    }


def _message() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system"]), "content": text()})


def _tool_choice() -> st.SearchStrategy[Any]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    return st.sampled_from([None, "none", "auto", "required", named])


def chat_fields() -> dict[str, st.SearchStrategy[Any]]:
    fields = {
        **common_fields(),
        "messages": st.lists(_message(), min_size=1, max_size=3).map(_ends_with_user),
        "logprobs": st.one_of(st.none(), st.booleans()),
        "top_logprobs": as_client_sends(st.integers(0, 5)),
        "max_completion_tokens": as_client_sends(st.integers(1, 24)),
        "tools": st.one_of(st.none(), st.just(TOOLS), st.just([])),
        "tool_choice": _tool_choice(),
        "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}, JSON_SCHEMA]),
        "parallel_tool_calls": st.one_of(st.none(), st.booleans()),
        "reasoning_effort": st.sampled_from([None, "low", "high"]),
        "chat_template_kwargs": st.one_of(st.none(), st.just({}), st.just({"enable_thinking": False})),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.just(False),
        "documents": st.one_of(st.none(), st.just([{"title": "t", "text": "the cat"}])),
        "include_reasoning": st.booleans(),
        "echo": st.booleans(),
    }
    return fields


def _ends_with_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*messages[:-1], {**messages[-1], "role": "user"}]


def completion_fields() -> dict[str, st.SearchStrategy[Any]]:
    ids = st.lists(st.integers(1, 4095), min_size=1, max_size=24)
    return {
        **common_fields(),
        "prompt": st.one_of(
            text(), text(), st.lists(text(), min_size=1, max_size=3), ids, st.lists(ids, min_size=1, max_size=2)
        ),
        "logprobs": as_client_sends(st.integers(0, 5)),
        "suffix": st.one_of(st.none(), st.just("")),
        "echo": st.one_of(st.none(), st.booleans()),
    }


FIELDS = {CHAT: chat_fields, COMPLETIONS: completion_fields}
# The fields every body of the endpoint has (the rest are drawn optional).
REQUIRED = {CHAT: ("messages",), COMPLETIONS: ("prompt",)}


# Fields a body sets more often than the rest: streams, caps and greedy decoding are what
# most requests carry (and what migration and the comparison need).
FREQUENT = {"stream": 50, "max_tokens": 70, "temperature": 60, "stream_options": 30}


def reproducible(body: dict[str, Any]) -> bool:
    """Sampling is compared where it is reproducible: greedy, or with a seed."""
    return body.get("temperature") in (0, 0.0) or body.get("seed") is not None


@st.composite
def cases(draw: Any) -> Case:
    """One Case: the frequent fields at their rates, and up to five more (as clients do)."""
    endpoint = draw(st.sampled_from([CHAT, COMPLETIONS]))
    fields = FIELDS[endpoint]()
    frequent = [n for n, pct in FREQUENT.items() if draw(st.integers(0, 99)) < pct]
    names = sorted(n for n in fields if n not in REQUIRED[endpoint] and n not in FREQUENT)
    chosen = draw(st.lists(st.sampled_from(names), max_size=5, unique=True))
    body = {n: draw(fields[n]) for n in (*REQUIRED[endpoint], *frequent, *chosen)}
    if "stream" in frequent:
        body["stream"] = True
    body = {k: v for k, v in body.items() if not (v is None and draw(st.booleans()))}  # some nulls kept
    uncapped = endpoint == CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if uncapped and draw(st.integers(0, 2)) > 0:
        body["max_tokens"] = draw(st.integers(1, 24))  # most chat clients' bodies have a cap
    elif uncapped:
        # No cap: to the context's end. A prompt that leaves about 24 tokens of it.
        body["messages"] = [{"role": "user", "content": _long_prompt(24)}]
    if not reproducible(body):
        body["seed"] = draw(st.integers(0, 2**31))
    return Case(endpoint, body, draw(st.integers(1, 20)))


def generate(count: int, seed_value: int) -> list[Case]:
    """`count` distinct cases, the same for the same seed."""
    out: dict[str, Case] = {}

    @seed(seed_value)
    @settings(
        max_examples=count * 2,
        database=None,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def collect(case: Case) -> None:
        if len(out) < count:
            out.setdefault(case.key(), case)

    collect()
    return list(out.values())


def allowed_without_strategy() -> dict[str, set[str]]:
    """Allowed fields (per endpoint) no strategy draws: empty when every one is covered."""
    return {e: set(ALLOWED[e]) - set(FIELDS[e]()) for e in (CHAT, COMPLETIONS)}
