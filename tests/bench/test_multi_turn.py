"""bench/multi_turn.py: chat sessions that resend the conversation, turn by turn."""

from __future__ import annotations

import asyncio

from bench import multi_turn
from bench.sse import Streamed
from bench.stats import RequestResult

SHAPE = multi_turn.Sessions(sessions=5, turns=3, concurrency=2, system_tokens=6, user_tokens=4, answer_tokens=2)


def _decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_the_same_seed_sends_the_same_sessions_and_each_part_has_its_length():
    a = multi_turn.texts(SHAPE, 7, _decode, vocab=500)
    assert a == multi_turn.texts(SHAPE, 7, _decode, vocab=500)
    assert a != multi_turn.texts(SHAPE, 8, _decode, vocab=500)
    assert len(a) == SHAPE.sessions and all(len(parts) == 1 + SHAPE.turns for parts in a)
    assert {len(parts[0].split()) for parts in a} == {SHAPE.system_tokens}
    assert {len(p.split()) for parts in a for p in parts[1:]} == {SHAPE.user_tokens}
    # no two sessions share a system prompt: a session's prefix is its own
    assert len({parts[0] for parts in a}) == SHAPE.sessions


def test_each_turn_resends_the_conversation_with_the_answers_read_and_sessions_run_bounded():
    parts = multi_turn.texts(SHAPE, 1, _decode, vocab=500)
    sent: list[list[dict[str, str]]] = []
    in_flight = {"now": 0, "most": 0}

    async def send(messages):
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        sent.append(messages)
        await asyncio.sleep(0.001)
        in_flight["now"] -= 1
        return RequestResult(ok=True, output_tokens=2), f"answer {len(messages)} to {messages[-1]['content']}"

    results = asyncio.run(multi_turn.sessions(parts, SHAPE.concurrency, send))
    assert len(results) == SHAPE.sessions * SHAPE.turns
    assert in_flight["most"] == SHAPE.concurrency  # sessions overlap, never more than asked
    for session in parts:
        turns = [m for m in sent if m[0]["content"] == session[0]]
        assert [len(m) for m in turns] == [2, 4, 6]  # system + (user, answer) per earlier turn + user
        last = turns[-1]
        assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert [m["content"] for m in last if m["role"] == "user"] == session[1:]
        # each answer is the one the client read for the turn before it
        assert last[2]["content"] == f"answer 2 to {session[1]}" and last[4]["content"] == f"answer 4 to {session[2]}"


def test_a_turn_without_an_answer_ends_its_session():
    parts = multi_turn.texts(SHAPE, 1, _decode, vocab=500)[:1]
    calls = []

    async def send(messages):
        calls.append(messages)
        return RequestResult(ok=len(calls) == 1, error="" if len(calls) == 1 else "http_503"), "a"

    results = asyncio.run(multi_turn.sessions(parts, 1, send))
    assert [r.ok for r in results] == [True, False] and len(calls) == 2


def test_a_streamed_turn_is_timed_from_its_start():
    s = Streamed(start=10.0, end=10.5, status=200, done=True, token_times=[10.2, 10.3, 10.45])
    s.usage = {"prompt_tokens": 40, "completion_tokens": 3}
    r = multi_turn.result_of(s)
    assert r.ok and round(r.ttft_s, 3) == 0.2 and round(r.latency_s, 3) == 0.5
    assert [round(g, 3) for g in r.itl_s] == [0.1, 0.15] and (r.prompt_tokens, r.output_tokens) == (40, 3)
    failed = Streamed(start=1.0, end=2.0, status=503, error="busy")
    assert not multi_turn.result_of(failed).ok
