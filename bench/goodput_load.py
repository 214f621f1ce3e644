"""`make bench-goodput`'s workload: decode-heavy streams, and long prompts arriving at a rate.

What flows through here: a seed, a `Workload` (how many streams, each kind's prompt and output
tokens) and an arrival rate -> seeded bodies (prompts of random token ids of the tiny model,
so every request is its prompt's exact length and no two share a prefix) and seeded Poisson
arrival times -> `run_window()`: for `duration_s`, `streams` closed-loop clients each sending a
short-prompt, long-output request as soon as its last one ends, while the long prompts (most of
the 1,024-token context, a few output tokens) arrive open-loop at their times; every request a
streamed /v1/completions read by bench/sse.py, which stamps each event and counts its tokens
(`return_token_ids`) -> one `Sent` per request: its kind, when it left (seconds after the window
opened) and what the client saw. Requests still running `drain_s` after the window are cut and
recorded as such. The same seed gives every target the same prompts at the same times.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from bench.role_scaling import PROMPT_TOKENS
from bench.sse import Streamed, stream_request
from local.tiny_model import ARCHITECTURE

STREAM = "stream"  # a decode-heavy stream: short prompt, long output
PROMPT = "prompt"  # a long prompt: most of the context, a short output
FIRST_TOKEN_ID = 10  # past the tiny tokenizer's special tokens (local/tiny_model.py)
REQUEST_TIMEOUT_S = 120.0  # no byte for this long: the request hung
DRAIN_S = 60.0  # after the window: how long the last requests may take


@dataclass(frozen=True)
class Workload:
    """What each window sends (the defaults: `make bench-goodput`'s)."""

    streams: int = 4
    stream_prompt_tokens: int = 32
    stream_output_tokens: int = 256
    prompt_tokens: int = PROMPT_TOKENS  # of the tiny model's 1,024-token context
    prompt_output_tokens: int = 16
    vocab: int = ARCHITECTURE["vocab_size"]


@dataclass
class Sent:
    """One request of a window."""

    kind: str  # STREAM | PROMPT
    at_s: float  # when it left, seconds after the window opened
    got: Streamed


def arrivals(rate: float, duration_s: float, seed: str) -> list[float]:
    """Poisson arrival times in [0, duration_s): exponential gaps of mean 1 / rate, seeded."""
    rng = random.Random(f"{seed}:arrivals")
    out: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration_s
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def body(rng: random.Random, model: str, prompt_tokens: int, output_tokens: int, vocab: int) -> dict[str, Any]:
    """A streamed completion of `prompt_tokens` random token ids, exactly `output_tokens` out."""
    return {
        "model": model,
        "prompt": [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(prompt_tokens)],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        # Every event carries its token ids: the client counts the tokens of each chunk.
        "return_token_ids": True,
    }


def stream_bodies(wl: Workload, model: str, seed: str) -> Iterator[dict[str, Any]]:
    """One stream's successive requests, seeded."""
    rng = random.Random(f"{seed}:stream")
    while True:
        yield body(rng, model, wl.stream_prompt_tokens, wl.stream_output_tokens, wl.vocab)


def prompt_bodies(wl: Workload, model: str, seed: str) -> Iterator[dict[str, Any]]:
    """The long prompts, in arrival order, seeded."""
    rng = random.Random(f"{seed}:prompts")
    while True:
        yield body(rng, model, wl.prompt_tokens, wl.prompt_output_tokens, wl.vocab)


async def run_window(
    url: str,
    headers: Mapping[str, str],
    model: str,
    wl: Workload,
    rate: float,
    duration_s: float,
    seed: str,
    drain_s: float = DRAIN_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Sent]:
    """One window against one target (`url`: its OpenAI base, ending in /v1); module doc.
    `transport`: httpx's, for a stand-in server."""
    sent: list[Sent] = []
    t0 = time.monotonic()
    end = t0 + duration_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=wl.streams + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:

        async def one(kind: str, b: dict[str, Any]) -> None:
            at = time.monotonic() - t0
            try:
                got = await stream_request(client, f"{url}/completions", b, headers=dict(headers))
            except asyncio.CancelledError:
                sent.append(Sent(kind, at, Streamed(start=t0 + at, end=time.monotonic(), error="cut after the drain")))
                raise
            sent.append(Sent(kind, at, got))

        async def stream_loop(i: int) -> None:
            bodies = stream_bodies(wl, model, f"{seed}:{i}")
            while time.monotonic() < end:
                await one(STREAM, next(bodies))

        async def prompt_loop() -> None:
            started = []
            for at, b in zip(arrivals(rate, duration_s, seed), prompt_bodies(wl, model, seed), strict=False):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                started.append(asyncio.create_task(one(PROMPT, b)))
            await asyncio.gather(*started)

        tasks = [asyncio.create_task(stream_loop(i)) for i in range(wl.streams)]
        tasks.append(asyncio.create_task(prompt_loop()))
        _, pending = await asyncio.wait(tasks, timeout=duration_s + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return sent


async def sequential(
    url: str, headers: Mapping[str, str], bodies: list[dict[str, Any]], concurrency: int = 1
) -> list[Streamed]:
    """`bodies` sent `concurrency` at a time, each group after the last ended (the profile's runs)."""
    out: list[Streamed] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)) as client:
        for i in range(0, len(bodies), concurrency):
            group = bodies[i : i + concurrency]
            out += await asyncio.gather(
                *(stream_request(client, f"{url}/completions", b, headers=dict(headers)) for b in group)
            )
    return out
