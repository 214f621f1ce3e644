"""bench/conformance.py's runner: what each path is compared against, and what the shrinker
may drop (a body whose answer may differ by design is no finding)."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.conformance import Runner, _comparable
from bench.conformance_bodies import Case
from bench.conformance_compare import Answer


def test_a_shrunk_body_stays_one_whose_answer_is_fixed():
    greedy = {"messages": [], "stream": True, "temperature": 0}
    assert _comparable("migration", "chat", greedy)
    # without temperature 0 and without a seed, sampling differs run to run
    assert not _comparable("disaggregated", "chat", {"messages": []})
    assert _comparable("disaggregated", "chat", {"messages": [], "seed": 3})
    # a seeded sampler restarts with a continuation: a cut stream compares only greedy
    assert not _comparable("migration", "chat", {"messages": [], "stream": True, "seed": 3})
    # a request the ingress does not continue is not compared under a cut
    assert not _comparable("migration", "chat", {**greedy, "presence_penalty": 0.5})
    assert _comparable("aggregated", "chat", {**greedy, "presence_penalty": 0.5})


class _Runner(Runner):
    """The oracle answers as plain vLLM: a vLLM-only field with a bad value is refused whole,
    the OpenAI part alone is served; ours answers what the test says."""

    def __init__(self, ours_status: int):
        self.ours_status = ours_status
        self.oracle_bodies: list[dict[str, Any]] = []

    async def oracle(self, endpoint: str, body: dict[str, Any]) -> Answer:
        self.oracle_bodies.append(body)
        if "structured_outputs" in body:
            return Answer(400, {"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
        return Answer(200, {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})

    async def ours(self, path: str, endpoint: str, body: dict[str, Any], cut_after: int = 0) -> Answer:
        if self.ours_status != 200:
            return Answer(self.ours_status, {"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
        return Answer(200, {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}, served_by="fallback")


def test_the_fallback_is_held_to_vllms_refusal_of_the_whole_body():
    body = {"prompt": "x", "structured_outputs": {}}
    case = Case("completions", body, 1)
    refused = _Runner(400)
    assert asyncio.run(refused.compare("fallback", case, "completions", body)) == []
    served = _Runner(200)
    assert asyncio.run(served.compare("fallback", case, "completions", body)) != []


def test_the_fallback_is_compared_with_the_openai_part_when_vllm_serves_the_body():
    body = {"prompt": "x", "top_k": 3}  # a vLLM extension the provider is not sent
    runner = _Runner(200)
    assert asyncio.run(runner.compare("fallback", Case("completions", body, 1), "completions", body)) == []
    assert runner.oracle_bodies[-1] == {"prompt": "x"}


class _StreamRefusingRunner(_Runner):
    """Plain vLLM refuses this streamed body inside its stream (a 200, one error event)."""

    async def oracle(self, endpoint: str, body: dict[str, Any]) -> Answer:
        self.oracle_bodies.append(body)
        if "truncate_prompt_tokens" in body:
            err = {"error": {"message": "The decoder prompt cannot be empty", "code": 400}}
            return Answer(200, events=[err], done=1)
        return Answer(200, events=[{"choices": [{"index": 0, "text": "a"}]}], done=1)


def test_the_fallback_is_held_to_a_refusal_vllm_makes_inside_its_stream():
    body = {"prompt": "x", "stream": True, "truncate_prompt_tokens": 0}
    runner = _StreamRefusingRunner(400)
    assert asyncio.run(runner.compare("fallback", Case("completions", body, 1), "completions", body)) == []
    assert runner.oracle_bodies == [body]  # the OpenAI part was never the reference
