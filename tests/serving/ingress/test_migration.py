"""Stream migration (serving/ingress/migration.py, guarded_stream in serving/ingress/relay.py).

The engine here is a stand-in with a fixed answer (greedy decoding: the answer depends only
on the tokens so far), speaking vLLM 0.32's streamed wire format for chat and completions
with `return_token_ids` (vllm/entrypoints/openai/chat_completion/serving.py and
completion/serving.py: prompt ids on the first chunk, each chunk's token ids, an empty
chat chunk for a token whose text is held back, usage in every chunk with
continuous_usage_stats, a final usage event, [DONE]). A decode death anywhere in the
stream must leave the client with the no-fault answer: same text, one id, one finish, one
usage that counts every token once.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.exceptions import RayActorError

from serving.core.calls import sse_error
from serving.core.failures import Reason, overloaded
from serving.ingress.fields import ALLOWED
from serving.ingress.migration import (
    APPLIED,
    CARRIED,
    NOT_CONTINUED,
    RECOMPUTED,
    Migration,
    StreamRecord,
    not_continuable,
    stop_strings,
)
from serving.ingress.relay import guarded_stream
from tests.serving.fakes import FakeStream, collect, run

PROMPT = [101, 102, 103, 104]
# The answer: (token id, its text). A text ending in "+" is held back by vLLM's detokenizer
# (a multi-byte character split over tokens): it comes out with the next token's text, and a
# continuation whose prompt already holds that token never emits it.
PIECES = ["The", " cat", " \xc3+", "\xa9", "t", " sat", " on", " \xe6+", "\x97+", "\xa5", " mat", "."]
ANSWER = [(500 + i, p.rstrip("+")) for i, p in enumerate(PIECES)]
HELD = {500 + i for i, p in enumerate(PIECES) if p.endswith("+")}


def full_text() -> str:
    return "".join(p for _, p in ANSWER)


def engine_events(endpoint, prompt, *, rid, max_tokens, return_ids=True, usage=True, stop=(), include=False):
    """The events a vLLM engine streams for `prompt` (ids), continuing the fixed answer; with
    `stop` strings, vLLM's rule (vllm/v1/engine/detokenizer.py: hold back max(len) - 1
    characters unless `include`, search the new text, truncate at the first match)."""
    start = len(prompt) - len(PROMPT)
    assert prompt[: len(PROMPT)] == PROMPT and [t for t, _ in ANSWER[:start]] == prompt[len(PROMPT) :]
    rest = ANSWER[start:]
    if max_tokens is not None:
        rest = rest[:max_tokens]
    finish = "stop" if start + len(rest) == len(ANSWER) else "length"
    if stop:
        return _stop_engine_events(endpoint, prompt, rest, finish, rid, return_ids, usage, list(stop), include)
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    base = {"id": rid, "object": obj, "created": 7, "model": "m"}
    P = len(prompt)

    def u(n):
        return {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}

    out = []
    if endpoint == "chat":
        first = {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        if return_ids:
            first["prompt_token_ids"] = list(prompt)
        if usage:
            first["usage"] = u(0)
        out.append(first)
    held = ""
    for i, (tid, piece) in enumerate(rest):
        last = i == len(rest) - 1
        held += piece
        text = "" if tid in HELD and not last else held
        if text:
            held = ""
        choice = {"index": 0, "logprobs": None, "finish_reason": finish if last else None}
        if endpoint == "chat":
            if not text and not last and not return_ids:
                continue  # vLLM: no chunk without text unless token ids were asked for
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
            if i == 0 and return_ids:
                choice["prompt_token_ids"] = list(prompt)
        if return_ids:
            choice["token_ids"] = [tid]
        ev = {**base, "choices": [choice]}
        if usage:
            ev["usage"] = u(i + 1)
        out.append(ev)
    if usage:
        out.append({**base, "choices": [], "usage": u(len(rest))})
    return [f"data: {json.dumps(e)}\n\n" for e in out] + ["data: [DONE]\n\n"]


def _stop_engine_events(endpoint, prompt, rest, finish, rid, return_ids, usage, stop, include):
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    base = {"id": rid, "object": obj, "created": 7, "model": "m"}
    P = len(prompt)
    hold = 0 if include else max(len(s) for s in stop) - 1
    out, output, sent, held = [], "", 0, ""
    if endpoint == "chat":
        first = {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        if return_ids:
            first["prompt_token_ids"] = list(prompt)
        if usage:
            first["usage"] = {"prompt_tokens": P, "completion_tokens": 0, "total_tokens": P}
        out.append(first)
    for i, (tid, piece) in enumerate(rest):
        last = i == len(rest) - 1
        held += piece
        new = "" if tid in HELD and not last else held
        if new:
            held = ""
        output += new
        done, reason = (finish if last else None), None
        if new:
            for s in stop:
                at = output.find(s, max(0, len(output) - len(new) - len(s) + 1))
                if at >= 0:
                    output = output[: at + (len(s) if include else 0)]
                    done, reason = "stop", s
                    break
        upto = len(output) if done else len(output) - hold
        text = output[sent:upto] if upto > sent else ""
        sent = max(sent, upto)
        choice = {"index": 0, "logprobs": None, "finish_reason": done}
        if reason is not None:
            choice["stop_reason"] = reason
        if endpoint == "chat":
            if not text and not done and not return_ids:
                continue
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
            if i == 0 and return_ids:
                choice["prompt_token_ids"] = list(prompt)
        if return_ids:
            choice["token_ids"] = [tid]
        ev = {**base, "choices": [choice]}
        if usage:
            ev["usage"] = {"prompt_tokens": P, "completion_tokens": i + 1, "total_tokens": P + i + 1}
        out.append(ev)
        if done:
            n = i + 1
            break
    else:
        n = len(rest)
    if usage:
        out.append(
            {**base, "choices": [], "usage": {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}}
        )
    return [f"data: {json.dumps(e)}\n\n" for e in out] + ["data: [DONE]\n\n"]


def client_view(packets):
    """(text, ids seen, finishes, final usage, [DONE] count, error events) of a client's stream."""
    text, ids, finishes, usage, done, errors = "", set(), [], None, 0, []
    for raw in "".join(packets).split("\n\n"):
        if not raw.startswith("data:"):
            continue
        payload = raw[5:].strip()
        if payload == "[DONE]":
            done += 1
            continue
        doc = json.loads(payload)
        if "error" in doc:
            errors.append(doc["error"])
            continue
        ids.add(doc["id"])
        assert "prompt_token_ids" not in doc
        for c in doc["choices"]:
            assert c["index"] == 0 and "token_ids" not in c
            text += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
        if not doc["choices"] and doc.get("usage"):
            usage = doc["usage"]
    return text, ids, finishes, usage, done, errors


def make_migration(endpoint, fields, max_tokens, *, attempts=2, die_again_after=None, resume_fails=False, busy=0):
    record = StreamRecord(endpoint, fields, max_tokens)
    sent, outcomes = [], []
    if record._stop is not None:
        assert record.engine_fields()["include_stop_str_in_output"] is True

    async def resume(body):
        sent.append(body)
        if resume_fails:
            raise RuntimeError("no decode replica")
        if len(sent) <= busy:  # Serve's back-pressure on the surviving replicas
            raise overloaded(1)
        packets = engine_events(
            "completions",
            body["prompt"],
            rid="cmpl-cont",
            max_tokens=body.get("max_tokens"),
            stop=stop_strings(body),
            include=bool(body.get("include_stop_str_in_output")),
        )
        if die_again_after is not None and len(sent) == 1:
            packets = [*packets[:die_again_after], RayActorError()]
        stream = FakeStream(packets)
        return await stream.__anext__(), stream

    m = Migration(record, None, attempts, 5.0, resume, lambda cut, outcome: outcomes.append((cut, outcome)))
    return m, sent, outcomes


def relay(first_and_rest, migration, deadline_s=30.0):
    first, stream = first_and_rest[0], FakeStream(first_and_rest[1:])
    return run(
        collect(
            guarded_stream(
                first, stream, deadline_at=asyncio.run(_now()) + deadline_s, to_packet=lambda x: x, migration=migration
            )
        )
    ), stream


async def _now():
    return asyncio.get_running_loop().time()


USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@settings(max_examples=150, deadline=None)
@given(
    endpoint=st.sampled_from(["chat", "completions"]),
    cut=st.integers(min_value=1, max_value=len(ANSWER) + 2),
    max_tokens=st.sampled_from([None, 5, 9, len(ANSWER), 40]),
)
def test_a_decode_death_anywhere_leaves_the_client_the_no_fault_answer(endpoint, cut, max_tokens):
    fields = {"model": "m", "temperature": 0, "stream": True, **USAGE}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    limit = max_tokens if endpoint == "chat" or max_tokens is not None else 16
    reference = engine_events(endpoint, PROMPT, rid="r", max_tokens=limit, return_ids=False)
    original = engine_events(endpoint, PROMPT, rid="r", max_tokens=limit)
    cut = min(cut, len(original) - 1)
    m, sent, outcomes = make_migration(endpoint, fields, limit)
    out, _ = relay([*original[:cut], RayActorError()], m)
    want = client_view(reference)
    got = client_view(out)
    assert got[0] == want[0]  # the same text, nothing repeated or lost
    assert got[1] == {"r"}  # one response id
    assert got[2] == want[2]  # one finish, the same reason
    assert got[3] == want[3]  # usage: prompt once, every generated token once
    assert got[4] == 1 and got[5] == []
    assert [o for _, o in outcomes] == ["continued"]
    for body in sent:  # the continuation's prompt is ids: the prompt plus what the client has
        assert body["prompt"][: len(PROMPT)] == PROMPT and body["return_token_ids"] is True
        if limit is not None:
            assert body["max_tokens"] == limit - (len(body["prompt"]) - len(PROMPT))


def test_a_second_death_is_continued_again_within_the_bound():
    fields = {"model": "m", "stream": True, **USAGE}
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None)
    m, sent, outcomes = make_migration("chat", fields, None, die_again_after=3)
    out, _ = relay([*original[:4], RayActorError()], m)
    text, ids, finishes, usage, _done, errors = client_view(out)
    assert text == full_text() and ids == {"r"} and finishes == ["stop"] and errors == []
    assert usage["completion_tokens"] == len(ANSWER) and usage["prompt_tokens"] == len(PROMPT)
    assert len(sent) == 2 and len(sent[1]["prompt"]) > len(sent[0]["prompt"])
    assert [o for _, o in outcomes] == ["continued", "continued"]


def test_past_the_bound_the_stream_ends_with_the_error_event():
    fields = {"model": "m", "stream": True, **USAGE}
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None)
    m, _sent, outcomes = make_migration("chat", fields, None, attempts=1, die_again_after=3)
    out, _ = relay([*original[:4], RayActorError()], m)
    text, _, finishes, _, done, errors = client_view(out)
    assert finishes == [] and len(errors) == 1 and done == 1
    assert full_text().startswith(text) and text != full_text()
    assert [o for _, o in outcomes] == ["continued", "failed"]


def test_when_no_replica_can_take_the_continuation_the_stream_ends_with_the_error_event():
    m, _sent, outcomes = make_migration("chat", {"model": "m", "stream": True}, None, resume_fails=True)
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None)
    out, _ = relay([*original[:3], RayActorError()], m)
    assert len(client_view(out)[5]) == 1 and outcomes == [(Reason.REPLICA_DIED, "failed")]


def test_an_engine_error_event_and_a_stall_are_cuts_too():
    fields = {"model": "m", "stream": True}
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None, usage=False)
    error = sse_error("KV load failed", 500, done=False)
    for bad, why in ((error, Reason.ENGINE_ERROR), ("hang", Reason.STALL)):
        m, _sent, outcomes = make_migration("chat", fields, None)
        m.stall_timeout_s = 0.05
        out, stream = relay([*original[:5], bad], m)
        assert client_view(out)[0] == full_text(), why
        assert outcomes == [(why, "continued")] and stream.cancelled


def test_a_death_after_the_finish_ends_the_stream_without_a_continuation():
    fields = {"model": "m", "stream": True, **USAGE}
    original = engine_events("completions", PROMPT, rid="r", max_tokens=None)
    m, sent, _outcomes = make_migration("completions", fields, 16)
    out, _ = relay([*original[:-2], RayActorError()], m)  # finish sent, usage event not
    text, _, finishes, usage, done, errors = client_view(out)
    assert text == full_text() and finishes == ["stop"] and done == 1 and errors == [] and sent == []
    assert usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(ANSWER),
        "total_tokens": len(PROMPT) + len(ANSWER),
    }


def test_a_request_that_cannot_be_continued_keeps_the_error_event_and_is_counted():
    outcomes = []
    m = Migration(None, "tools", 2, 0.01, None, lambda c, o: outcomes.append(o))  # type: ignore[arg-type]
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None, return_ids=False)
    out, _ = relay([*original[:3], "hang", RayActorError()], m, deadline_s=0.3)
    # a stall is not a cut here (nothing could follow it): the deadline ends the stream
    assert json.loads("".join(out).split("data: ")[-2])["error"]["code"] == 504
    out, _ = relay([*original[:3], RayActorError()], m)
    assert len(client_view(out)[5]) == 1 and outcomes == ["not_migratable"]


def test_token_ids_reach_the_client_only_when_it_asked_for_them():
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None)
    record = StreamRecord("chat", {"return_token_ids": True}, None, client_ids=True)
    out = "".join(record.relay(p) for p in original)
    assert '"prompt_token_ids"' in out and '"token_ids"' in out
    record = StreamRecord("chat", {}, None)
    out = "".join(record.relay(p) for p in original)
    assert "token_ids" not in out
    # and the chunks that carried only ids are gone: the client sees what vLLM sends it
    plain = engine_events("chat", PROMPT, rid="r", max_tokens=None, return_ids=False)
    assert out.count("data:") == "".join(plain).count("data:")


def test_continuation_carries_the_sampling_values_and_what_is_left():
    fields = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 3,
        "max_completion_tokens": 10,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"x": 1},
    }
    record = StreamRecord("chat", fields, 10)
    for p in engine_events("chat", PROMPT, rid="r", max_tokens=10)[:4]:
        record.relay(p)
    body = record.continuation()
    assert body is not None
    kept = body["prompt"][len(PROMPT) :]
    assert body["prompt"] == PROMPT + kept and kept == [t for t, _ in ANSWER[: len(kept)]]
    assert body["max_tokens"] == 10 - len(kept) and body["min_tokens"] == max(0, 4 - len(kept))
    for k in ("temperature", "top_p", "stop", "seed", "stream_options", "model"):
        assert body[k] == fields[k]
    assert "messages" not in body and "chat_template_kwargs" not in body and "max_completion_tokens" not in body
    # the body is one Ray's ingress takes (vLLM's CompletionRequest, validated)
    from ray.serve.llm.openai_api_models import CompletionRequest

    req = CompletionRequest.model_validate(body)
    assert req.prompt == body["prompt"] and req.return_token_ids and req.stream


def test_every_field_a_client_may_send_has_a_migration_class():
    classes = [CARRIED, RECOMPUTED, APPLIED, frozenset(NOT_CONTINUED)]
    for i, a in enumerate(classes):
        for b in classes[i + 1 :]:
            assert not a & b
    for endpoint, allowed in ALLOWED.items():
        if endpoint not in ("chat", "completions"):
            continue  # tokenize/detokenize generate nothing
        unclassified = allowed - set().union(*classes)
        assert not unclassified, f"{endpoint}: decide how a continuation treats {sorted(unclassified)}"


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"n": 2}, "n > 1"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "structured output"),
        ({"n": 1, "response_format": {"type": "text"}, "logprobs": False, "tool_choice": "none"}, None),
    ],
)
def test_requests_whose_output_is_shaped_whole_are_not_continued(fields, why):
    assert not_continuable("chat", fields) == why


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({}, None),
        ({"n": 2}, "n > 1"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "structured output"),
        ({"n": 1, "response_format": {"type": "text"}, "logprobs": False, "tool_choice": "none"}, None),
    ],
)
def test_the_fields_that_decide_a_continuation_are_the_clients_own(fields, why):
    """The ingress decides from the body the client sent (the same answer the typed request's
    dump gives), and the record a continuation reads later holds the request as the client set
    it, not the engine request the ingress dispatched (token ids, stop strings added)."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "seed": 3, **fields}
    whole = ChatCompletionRequest.model_validate(body).model_dump(exclude_unset=True)
    assert not_continuable("chat", body) == why
    assert not_continuable("chat", whole) == why
    if why is None:
        record = StreamRecord("chat", dict(body), None)
        engine = {**body, **record.engine_fields()}
        assert engine["return_token_ids"] is True and "return_token_ids" not in record.fields
        assert ChatCompletionRequest.model_validate(engine).return_token_ids


def test_a_chat_stream_with_tool_calls_or_reasoning_is_not_continued():
    record = StreamRecord("chat", {}, None)
    ev = {
        "id": "r",
        "created": 1,
        "model": "m",
        "prompt_token_ids": PROMPT,
        "choices": [{"index": 0, "delta": {"reasoning": "hm"}, "token_ids": [1]}],
    }
    record.relay(f"data: {json.dumps(ev)}\n\n")
    assert record.not_continuable() == "reasoning"


def test_a_continuation_waits_out_back_pressure_within_the_stall_bound():
    """Right after a death the survivors get its streams and the new requests at once: Serve
    refuses some for back-pressure. The continuation tries again (not a new migration)."""
    fields = {"model": "m", "stream": True, **USAGE}
    original = engine_events("chat", PROMPT, rid="r", max_tokens=None)
    m, sent, outcomes = make_migration("chat", fields, None, attempts=1, busy=3)
    out, _ = relay([*original[:4], RayActorError()], m)
    assert client_view(out)[0] == full_text() and outcomes == [(Reason.REPLICA_DIED, "continued")]
    assert len(sent) == 4  # three refusals, then taken
    # Past the stall bound it gives up with the error event.
    m, sent, outcomes = make_migration("chat", fields, None, busy=10**6)
    m.stall_timeout_s = 0.6
    out, _ = relay([*original[:4], RayActorError()], m)
    assert len(client_view(out)[5]) == 1 and outcomes == [(Reason.REPLICA_DIED, "failed")]
    assert 2 <= len(sent) <= 4


TEXT = "".join(p.rstrip("+") for p in PIECES)
# Where a held piece ends: inside one character split over tokens ("\xc3" + "\xa9" stand for
# one "é"). A real stop string is made of whole characters, so none starts or ends there
# (one ending there would match half a character, which vLLM's detokenizer never emits).
INSIDE_A_CHARACTER = {
    len("".join(q.rstrip("+") for q in PIECES[: i + 1])) for i, q in enumerate(PIECES) if q.endswith("+")
}
STOPS = st.one_of(
    st.tuples(st.integers(0, len(TEXT) - 1), st.integers(1, 6))
    .filter(lambda a: a[0] not in INSIDE_A_CHARACTER and min(a[0] + a[1], len(TEXT)) not in INSIDE_A_CHARACTER)
    .map(lambda a: TEXT[a[0] : a[0] + a[1]]),
    st.sampled_from(["zz", "cat sat", " on", "\n\n"]),
).filter(bool)


@settings(max_examples=200, deadline=None)
@given(
    endpoint=st.sampled_from(["chat", "completions"]),
    cut=st.integers(min_value=1, max_value=len(ANSWER) + 2),
    stops=st.lists(STOPS, min_size=1, max_size=3),
    include=st.booleans(),
)
def test_a_cut_with_stop_strings_leaves_the_client_the_no_fault_answer(endpoint, cut, stops, include):
    """vLLM holds back text while it may become a stop string, but every chunk carries all its
    token ids: a continuation from those ids lost the held-back text, and a stop string across
    the cut was never matched (the continuation's engine sees its first half as prompt). The
    ingress asks the engines to hold nothing back and applies the stop strings itself: after a
    cut anywhere the client has exactly the answer it would have had without the fault."""
    fields = {"model": "m", "stream": True, "stop": stops, **USAGE}
    if include:
        fields["include_stop_str_in_output"] = True
    reference = engine_events(endpoint, PROMPT, rid="r", max_tokens=None, return_ids=False, stop=stops, include=include)
    original = engine_events(endpoint, PROMPT, rid="r", max_tokens=None, stop=stops, include=True)
    cut = min(cut, len(original) - 1)
    m, _sent, outcomes = make_migration(endpoint, fields, None)
    out, _ = relay([*original[:cut], RayActorError()], m)
    want, got = client_view(reference), client_view(out)
    assert got[0] == want[0]  # the same text, nothing lost, repeated, or past a stop string
    assert got[2] == want[2] and got[4] == 1 and got[5] == []
    assert got[3] == want[3]  # every generated token counted once
    assert all(o in ("continued",) for _, o in outcomes)


def test_a_streamed_echo_is_not_traded_for_continuability():
    """vLLM blanks the echoed prompt when return_token_ids is set: an echo stream keeps its
    prompt and is not continued (instead of losing the prompt to be continuable)."""
    assert not_continuable("completions", {"echo": True}) == "echo"
    assert not_continuable("completions", {"echo": False}) is None


def test_text_without_token_ids_makes_the_stream_not_continuable():
    """With a tool or reasoning parser and include_reasoning false, vLLM 0.32 sends chunks
    without token_ids (entrypoints/openai/chat_completion/serving.py): a continuation would
    restart the answer, so the record refuses to continue it."""
    record = StreamRecord("chat", {}, None)
    record.relay_event({"id": "r", "prompt_token_ids": PROMPT, "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    assert record.not_continuable() == "text without token ids"


def test_a_chat_without_a_cap_is_continued_to_the_contexts_end():
    """vLLM runs a chat with no max_tokens to the end of the model's context, but a
    completion with none stops after 16 tokens (CompletionRequest's default): the
    continuation must carry the context that is left, or a migrated chat ends 16 tokens on."""
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    record = StreamRecord("chat", fields, None, context_len=64)
    for p in engine_events("chat", PROMPT, rid="r", max_tokens=None)[:5]:
        record.relay(p)
    body = record.continuation()
    assert body is not None and body["max_tokens"] == 64 - len(body["prompt"])
    assert len(body["prompt"]) > len(PROMPT)  # the cut came after generated tokens


def test_a_chat_without_a_cap_on_a_model_of_unknown_context_is_not_continued():
    from serving.ingress.relay import Relay
    from serving.spec import ResilienceSpec

    relay_ = Relay(ResilienceSpec())
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert relay_.continuable("chat", fields, None) is None
    assert relay_.continuable("chat", fields, 1024) is not None
    # a cap as clients send it (pydantic's lax mode reads all three as 5)
    for cap in (5, 5.0, "5"):
        record = relay_.continuable("chat", {**fields, "max_tokens": cap}, None)
        assert record is not None and record.max_tokens == 5
    assert relay_.continuable("completions", {"model": "m", "prompt": "x", "max_tokens": None}).max_tokens == 16


def test_completions_logprobs_zero_is_logprobs():
    """`logprobs: 0` asks for each token's own logprob (vLLM CompletionRequest: an int, the
    number of alternatives): a continuation would drop it, so such a stream is not continued."""
    assert not_continuable("completions", {"logprobs": 0}) == "logprobs"
    assert not_continuable("completions", {"logprobs": None}) is None
    assert not_continuable("chat", {"logprobs": False}) is None


def test_text_held_for_a_stop_string_reaches_the_client_when_the_stream_ends_on_eos():
    """With a tool or reasoning parser, vLLM builds a parser per chat request and the chunk
    that ends a stream on EOS carries an empty delta `{}` (vllm 0.32
    chat_completion/serving.py, parser/abstract_parser.py): the characters held back while
    they might begin a stop string go out in that chunk, not lost with it."""
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "stop": ["xyz"]}
    record = StreamRecord("chat", fields, 10)
    base = {"id": "r", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    events = [
        {**base, "prompt_token_ids": PROMPT, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "hello x"}, "token_ids": [500, 501]}]},
        {**base, "choices": [{"index": 0, "delta": {}, "token_ids": [2], "finish_reason": "stop"}]},
    ]
    text = ""
    for ev in events:
        for packet in [record.relay(f"data: {json.dumps(ev)}\n\n")]:
            for c in json.loads(packet[5:])["choices"] if packet.strip() else []:
                text += c["delta"].get("content") or ""
    assert text == "hello x"


def _hooked_relay(monkeypatch, hooks: bool, header: str | None):
    from serving.ingress.relay import CUT_AFTER_HEADER, Relay
    from serving.spec import TEST_HOOKS_ENV, ResilienceSpec

    if hooks:
        monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    else:
        monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    request = type("R", (), {"headers": {CUT_AFTER_HEADER: header} if header is not None else {}})()
    record = StreamRecord("completions", {"model": "m", "stream": True, **USAGE}, 16)
    return Relay(ResilienceSpec())._migration("completions", record.fields, record, lambda: None, request, "m", 0.0)


def test_the_test_hook_cuts_a_stream_only_in_a_replica_started_with_it(monkeypatch):
    """The conformance harness cuts a stream after k tokens by a header (no process killed):
    honoured only where TEST_HOOKS_ENV is "1"; a client's header does nothing elsewhere."""
    assert _hooked_relay(monkeypatch, False, "3").cut_after is None
    assert _hooked_relay(monkeypatch, True, "3").cut_after == 3
    assert _hooked_relay(monkeypatch, True, "x").cut_after is None


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_forced_cut_after_k_tokens_is_continued_into_the_no_fault_answer(k):
    """The hook's cut is a stall at a packet boundary: the stream goes on on a continuation,
    and the client gets the no-fault answer (the same check as a replica death)."""
    fields = {"model": "m", "temperature": 0, "stream": True, "max_tokens": 10, **USAGE}
    reference = engine_events("completions", PROMPT, rid="r", max_tokens=10, return_ids=False)
    original = engine_events("completions", PROMPT, rid="r", max_tokens=10)
    m, sent, outcomes = make_migration("completions", fields, 10)
    m.cut_after = k
    out, _ = relay(original, m)
    assert client_view(out)[:5] == client_view(reference)[:5]
    assert [(c.value, o) for c, o in outcomes] == [("stall", "continued")]
    # cut once k tokens were generated: the continuation's prompt holds those whose text the
    # client has (a held-back token is generated again)
    kept = len(sent[0]["prompt"]) - len(PROMPT)
    assert len(sent) == 1 and k - 1 <= kept <= k


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"presence_penalty": 0.1}, "penalties on generated tokens"),
        ({"frequency_penalty": "-2"}, "penalties on generated tokens"),
        ({"presence_penalty": 0, "frequency_penalty": "0.0"}, None),
        ({"presence_penalty": None, "repetition_penalty": 1.3}, None),
    ],
)
def test_penalties_on_generated_tokens_are_not_continued(fields, why):
    """vLLM applies presence and frequency penalties to the generated tokens only
    (vllm/model_executor/layers/utils.py apply_penalties, 0.32): a continuation's engine would
    read the tokens kept before the cut as prompt and answer otherwise (the conformance run
    found it at temperature 0). A repetition penalty covers prompt and output alike: continued."""
    for endpoint in ("chat", "completions"):
        assert not_continuable(endpoint, fields) == why
