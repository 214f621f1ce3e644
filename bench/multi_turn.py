"""`make bench-prefix PREFIX_WORKLOAD=multi-turn`: chat sessions whose every turn resends the conversation.

What flows through here: a seed and a `Sessions` shape -> per session a seeded system prompt
and seeded user messages (text decoded from random ids of the model's own tokenizer, so each
is about its stated length in tokens) -> `run()`: `concurrency` sessions in flight at once,
each sending its turns one after another as a chat client does: turn k's messages are the
system prompt, every earlier user message with the answer the client read for it, then the
new user message, streamed from /v1/chat/completions (bench/sse.py reads it) -> one
`bench.stats.RequestResult` per turn. Turn k's prompt therefore starts with all of turn k-1's
prompt: a prefill replica that computed turn k-1 holds its full blocks, the others hold
nothing of the session (the answer itself was generated on decode). vLLM's benchmark client
sends independent prompts only (its prefix_repetition workload shares a prefix between
unrelated requests), hence this client.

The same seed gives every application the same sessions; answers are greedy (temperature 0)
and of a fixed length (ignore_eos), so the conversations match too.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.goodput_load import FIRST_TOKEN_ID, REQUEST_TIMEOUT_S
from bench.sse import Streamed, stream_request
from bench.stats import RequestResult


@dataclass(frozen=True)
class Sessions:
    """What one round sends: `sessions` conversations of `turns` turns, `concurrency` at once.
    With the defaults the last turn's prompt is about 300 + 4 x 64 + 3 x 32 = 650 tokens, well
    inside the local engines' 1,024."""

    sessions: int = 16
    turns: int = 4
    concurrency: int = 4
    system_tokens: int = 300
    user_tokens: int = 64
    answer_tokens: int = 32


Send = Callable[[list[dict[str, str]]], Awaitable[tuple[RequestResult, str]]]


def texts(shape: Sessions, seed: int, decode: Callable[[list[int]], str], vocab: int) -> list[list[str]]:
    """Per session: its system prompt, then one user message per turn (seeded)."""
    rng = random.Random(f"{seed}:multi-turn")

    def text(n: int) -> str:
        return decode([rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)])

    return [
        [text(shape.system_tokens), *(text(shape.user_tokens) for _ in range(shape.turns))]
        for _ in range(shape.sessions)
    ]


async def session(parts: list[str], send: Send) -> list[RequestResult]:
    """One conversation: each turn sent once the last one's answer is read, carrying it."""
    messages = [{"role": "system", "content": parts[0]}]
    results = []
    for user in parts[1:]:
        messages.append({"role": "user", "content": user})
        result, answer = await send(list(messages))
        results.append(result)
        if not result.ok:
            break  # a client does not go on with a conversation whose answer it never got
        messages.append({"role": "assistant", "content": answer})
    return results


async def sessions(all_parts: list[list[str]], concurrency: int, send: Send) -> list[RequestResult]:
    """Every session, at most `concurrency` in flight; a session's turns in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(parts: list[str]) -> list[RequestResult]:
        async with gate:
            return await session(parts, send)

    done = await asyncio.gather(*(one(p) for p in all_parts))
    return [r for results in done for r in results]


def result_of(s: Streamed) -> RequestResult:
    """A streamed turn as the bench's statistics take it."""
    if not s.ok or not s.token_times:
        return RequestResult(ok=False, error=s.error or s.kind)
    usage = s.usage or {}
    times = s.token_times
    return RequestResult(
        ok=True,
        ttft_s=s.ttft_s or 0.0,
        latency_s=s.latency_s,
        itl_s=[b - a for a, b in itertools.pairwise(times)],
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or len(times)),
    )


async def run(
    base_url: str, model: str, shape: Sessions, parts: list[list[str]], api_key: str | None = None
) -> list[RequestResult]:
    """One round of `parts`' sessions against `base_url` (the application's root, without /v1)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    url = f"{base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:

        async def send(messages: list[dict[str, str]]) -> tuple[RequestResult, str]:
            body: dict[str, Any] = {
                "model": model,
                "messages": messages,
                "max_tokens": shape.answer_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            streamed = await stream_request(client, url, body, headers=headers)
            return result_of(streamed), streamed.text

        return await sessions(parts, shape.concurrency, send)
