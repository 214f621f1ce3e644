"""bench/goodput_load.py: the seeded workload, and one window against a stand-in server (an
httpx MockTransport: no server, no Ray)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx

from bench.goodput_load import (
    FIRST_TOKEN_ID,
    PROMPT,
    STREAM,
    Workload,
    arrivals,
    prompt_bodies,
    run_window,
    stream_bodies,
)
from bench.role_scaling import PROMPT_TOKENS
from local.config import MAX_MODEL_LEN


def test_arrivals_are_seeded_poisson_within_the_window():
    a = arrivals(2.0, 60.0, "seed-1")
    assert a == arrivals(2.0, 60.0, "seed-1")  # the same for every target
    assert a != arrivals(2.0, 60.0, "seed-2")
    assert a == sorted(a) and all(0 <= t < 60.0 for t in a)
    # Over a long window the count is rate x duration within five standard deviations (Poisson).
    n = len(arrivals(5.0, 10_000.0, "seed-1"))
    assert abs(n - 50_000) < 5 * math.sqrt(50_000)
    assert arrivals(0.0, 60.0, "seed-1") == []


def test_the_workload_is_long_prompts_and_decode_streams_of_exact_lengths():
    wl = Workload()
    assert wl.prompt_tokens == PROMPT_TOKENS  # most of the tiny model's context, as make bench-scaling's
    longs = prompt_bodies(wl, "m", "s")
    first = [next(longs) for _ in range(3)]
    for b in first:
        assert len(b["prompt"]) == wl.prompt_tokens and b["max_tokens"] == wl.prompt_output_tokens
        assert all(FIRST_TOKEN_ID <= t < wl.vocab for t in b["prompt"])
        assert b["ignore_eos"] and b["stream"] and b["return_token_ids"]
    assert wl.prompt_tokens + wl.prompt_output_tokens <= MAX_MODEL_LEN
    assert wl.stream_prompt_tokens + wl.stream_output_tokens <= MAX_MODEL_LEN
    assert wl.prompt_tokens > 0.8 * MAX_MODEL_LEN and wl.stream_output_tokens > 4 * wl.stream_prompt_tokens
    # Every prompt is new (no prefix-cache hit), and the same seed gives the same prompts.
    assert len({tuple(b["prompt"][:8]) for b in first}) == 3
    assert [next(prompt_bodies(wl, "m", "s"))["prompt"]] == [first[0]["prompt"]]
    s = next(stream_bodies(wl, "m", "s:0"))
    assert len(s["prompt"]) == wl.stream_prompt_tokens and s["max_tokens"] == wl.stream_output_tokens
    assert s["prompt"] != next(stream_bodies(wl, "m", "s:1"))["prompt"]


def _sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_a_window_sends_every_arrival_and_keeps_each_stream_busy():
    wl = Workload(streams=2, stream_output_tokens=3, prompt_output_tokens=2)
    seen: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        b = json.loads(request.content)
        seen.append(b)
        await asyncio.sleep(0.02)
        tokens = [{"choices": [{"index": 0, "text": "x", "token_ids": [7]}]} for _ in range(b["max_tokens"])]
        return httpx.Response(200, content=_sse(*tokens))

    sent = asyncio.run(
        run_window("http://t/v1", {}, "m", wl, 20.0, 0.5, "s", drain_s=5.0, transport=httpx.MockTransport(handler))
    )
    prompts = [s for s in sent if s.kind == PROMPT]
    streams = [s for s in sent if s.kind == STREAM]
    assert len(prompts) == len(arrivals(20.0, 0.5, "s")) > 0
    assert len(streams) >= wl.streams  # closed loop: each stream sent at least once
    assert all(s.got.ok for s in sent)
    assert sorted(sum(n for _, n in s.got.chunk_tokens) for s in prompts) == [2] * len(prompts)
    assert {len(b["prompt"]) for b in seen} == {wl.prompt_tokens, wl.stream_prompt_tokens}
