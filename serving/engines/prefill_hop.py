"""The decode side's prefill hop: call prefill under its deadlines, or prefill locally.

What flows through here: one P/D request on a decode replica (serving/engines/pd_server.py) -> the
prefill call through Serve (`remote_prefill`: a queue bound until a prefill replica takes the
call, then the prefill deadline from that moment, longer for a longer prompt
(`prefill_deadline_s`); retries on another replica; the circuit of serving/engines/circuit.py
consulted and told the verdict of the tier's own failures, never of the request's) -> the
decode engine with the KV handed over, the request's own error as the client's answer, or the
request prefilled locally on decode when the remote path failed (`orchestrate`), its first
item awaited within the KV-ready deadline -> the stream of engine items, and one `on_path`
report of how it was prefilled (remote, remote_retry, local and why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serving.core.calls import aclose_quietly, assigned, cancel_call, client_error_response, first_item
from serving.core.failures import Reason, prefill_failure
from serving.core.metrics import PrefillPath as Path
from serving.engines.circuit import Circuit
from serving.spec import ResilienceSpec

logger = logging.getLogger("ray.serve")


class CircuitOpened(Exception):
    """Another request found the remote prefill broken while this one waited."""


class QueueTimeout(TimeoutError):
    """No prefill replica took the call within prefill_queue_timeout_s (busy, not broken)."""


async def _race(aw: Awaitable[Any], timeout_s: float, circuit: Circuit) -> Any:
    """`aw`'s result within `timeout_s`, unless the circuit opens first (CircuitOpened)."""
    nxt = asyncio.ensure_future(aw)
    trip = asyncio.ensure_future(circuit.tripped())
    try:
        done, _ = await asyncio.wait({nxt, trip}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        nxt.cancel()
        raise
    finally:
        trip.cancel()
    if nxt in done:
        return nxt.result()
    nxt.cancel()
    if trip in done:
        raise CircuitOpened
    raise TimeoutError


async def _prefill_answer(stream: Any, cfg: ResilienceSpec, circuit: Circuit, timeout_s: float) -> Any:
    """The prefill call's first (only) chunk. Two clocks: a replica must take the call within
    prefill_queue_timeout_s (else QueueTimeout: the prefill tier is busy), and then answer
    within `timeout_s` (`prefill_deadline_s`), timed from when it took the call, so queueing
    under load is never mistaken for a broken replica."""
    try:
        await _race(assigned(stream), cfg.prefill_queue_timeout_s, circuit)
    except TimeoutError:
        raise QueueTimeout from None
    return await _race(stream.__anext__(), timeout_s, circuit)


def prefill_deadline_s(cfg: ResilienceSpec, prompt_tokens: int) -> float:
    """How long a prefill replica may take to answer a call of `prompt_tokens` prompt tokens:
    prefillTimeoutS plus prefillTimeoutPerTokenMs per token (a long valid prompt takes longer
    to prefill; past its deadline it would count as a stalled tier), at most totalTimeoutS."""
    scaled = cfg.prefill_timeout_s + cfg.prefill_timeout_per_token_ms * max(prompt_tokens, 0) / 1000
    return min(scaled, cfg.total_timeout_s)


def prompt_tokens_bound(request: Any) -> int:
    """At most how many tokens the prompt of `request` (a chat or completion request) has, read
    from the request alone, before any tokenizer: a token-id prompt's ids, and one token per
    UTF-8 byte of text (a byte-level BPE token spans one byte or more; a chat template adds a
    few tokens of its own, few next to a prompt long enough for the bound to matter). Text
    only: images and audio parts are not counted."""
    prompt = getattr(request, "prompt", None)
    if prompt is not None:
        return _tokens_in(prompt)
    total = 0
    for message in getattr(request, "messages", None) or ():
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if isinstance(content, str):
            total += len(content.encode())
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
                total += len(text.encode()) if isinstance(text, str) else 0
    return total


def _tokens_in(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    if isinstance(prompt, list):
        return sum(1 if isinstance(p, int) else _tokens_in(p) for p in prompt)
    return 0


# --- decode side: the prefill hop ------------------------------------------------------
@dataclass
class PrefillOutcome:
    chunk: Any = None
    reason: Reason | None = None  # set when falling back to local prefill
    attempts: int = 0  # prefill calls made
    # The prefill engine refused the request itself (a 4xx: a parameter it rejects): the
    # client's answer, sent back as it is; the tier is not at fault.
    refusal: Any = None

    @property
    def path(self) -> Path:
        if self.reason is not None:
            return Path.LOCAL
        return Path.REMOTE if self.attempts <= 1 else Path.REMOTE_RETRY


async def remote_prefill(
    call: Callable[[], Any],
    *,
    is_error: Callable[[Any], bool],
    is_refusal: Callable[[Any], bool] = lambda _: False,
    refusal_of: Callable[[BaseException], Any] = client_error_response,
    cfg: ResilienceSpec,
    circuit: Circuit,
    on_retry: Callable[[Reason], None],
    no_replica: Callable[[], bool] = lambda: False,
    prompt_tokens: int = 0,
) -> PrefillOutcome:
    """Run the prefill call under its deadlines, retrying; the outcome says fall back or not.

    `call()` starts one prefill request (a Serve response stream, with .cancel()); a failed or
    late call is cancelled so the engine drops it. Only the tier's own failures count against
    the circuit and are retried: a replica death, Serve failing the call, an engine error
    answer, or a stall (no answer within `prefill_deadline_s(cfg, prompt_tokens)` after a
    replica took it). A stall while another call was answered is retried, not counted (a
    busy tier: it queued in a prefill engine; counted, 16 calls on a loaded tier opened the
    circuit and sent 30% to decode); a call no replica takes in time, or back-pressure, is
    a busy tier too: no retry, no verdict (but the probe, never retried, must prove the
    tier works). `no_replica()` (none running, says Serve): local prefill at once, counted.
    The request's own failures are neither counted nor retried: an `is_refusal` answer (the
    engine's 4xx), or a 4xx the replica's code raised (`refusal_of`), is the outcome's
    refusal; anything else it raised (`prefill_failure`: REQUEST_ERROR) goes to decode."""
    if not circuit.allow():
        return PrefillOutcome(reason=Reason.CIRCUIT_OPEN)
    probe = circuit.probing  # allowed while not closed: this request is the half-open probe
    timeout_s = prefill_deadline_s(cfg, prompt_tokens)
    reason = Reason.ERROR
    verdict = False
    attempts = 0
    try:
        for attempt in range(cfg.prefill_attempts):
            if attempt and circuit.is_open:
                reason = Reason.CIRCUIT_OPEN
                break
            if no_replica():
                reason = Reason.NO_REPLICA
                circuit.failure(probe=probe)
                verdict = probe
                break
            attempts += 1
            started = circuit.now()
            chunk, failed, exc = await _answer(call(), cfg, circuit, timeout_s)
            if failed is Reason.CIRCUIT_OPEN:
                reason = failed
                break
            if failed is Reason.REQUEST_ERROR:
                return _request_error(exc, refusal_of, attempts)
            if failed is not None:
                reason = failed
                if exc is not None:
                    logger.warning("prefill attempt %d failed (%s): %r", attempt + 1, reason.value, exc)
            elif is_refusal(chunk):
                return PrefillOutcome(refusal=chunk, attempts=attempts)
            elif not is_error(chunk):
                circuit.success()
                verdict = True
                return PrefillOutcome(chunk=chunk, attempts=attempts)
            else:
                reason = Reason.ERROR
                logger.warning("prefill attempt %d returned an error: %s", attempt + 1, chunk)
            if reason is Reason.OVERLOADED and not probe:
                break
            busy = reason is Reason.TIMEOUT and not probe and circuit.answered_since(started)
            if not busy:
                circuit.failure(probe=probe)
            if probe:
                verdict = True
                break
            if attempt + 1 < cfg.prefill_attempts and not circuit.is_open:
                on_retry(reason)
        return PrefillOutcome(reason=reason, attempts=attempts)
    finally:
        if probe and not verdict:
            circuit.release()


async def _answer(
    stream: Any, cfg: ResilienceSpec, circuit: Circuit, timeout_s: float
) -> tuple[Any, Reason | None, BaseException | None]:
    """One prefill call's answer, or why it has none (and what it raised); a call without an
    answer is cancelled, so the engine drops it."""
    try:
        return await _prefill_answer(stream, cfg, circuit, timeout_s), None, None
    except asyncio.CancelledError:
        cancel_call(stream)
        raise
    except CircuitOpened:
        cancel_call(stream)
        return None, Reason.CIRCUIT_OPEN, None
    except QueueTimeout:
        cancel_call(stream)
        return None, Reason.OVERLOADED, None
    except Exception as exc:
        cancel_call(stream)
        return None, prefill_failure(exc), exc


def _request_error(
    exc: BaseException | None, refusal_of: Callable[[BaseException], Any], attempts: int
) -> PrefillOutcome:
    """The outcome of a prefill call whose replica raised the request's own error: its 4xx
    answer when it carries one, else local prefill (decode then answers the request as an
    aggregated engine would). Only the error's type is logged: its text may quote the request."""
    logger.info("prefill raised the request's own error (%s): not a fault of the tier", type(exc).__name__)
    refusal = None if exc is None else refusal_of(exc)
    if refusal is not None:
        return PrefillOutcome(refusal=refusal, attempts=attempts)
    return PrefillOutcome(reason=Reason.REQUEST_ERROR, attempts=attempts)


async def first_then_rest(gen: AsyncIterator[Any], timeout_s: float | None) -> tuple[Any, AsyncIterator[Any]]:
    """The first item of `gen` within `timeout_s` (None: no limit), and the rest."""
    if timeout_s is None:
        first = await gen.__anext__()
    else:
        first = await asyncio.wait_for(gen.__anext__(), timeout_s)
    return first, gen


async def orchestrate(
    *,
    prefill: Callable[[], Awaitable[PrefillOutcome]],
    decode_with: Callable[[Any], Awaitable[AsyncIterator[Any]]],
    decode_local: Callable[[], Awaitable[AsyncIterator[Any]]],
    is_server_error: Callable[[Any], bool],
    kv_ready_timeout_s: Callable[[], float | None],
    on_path: Callable[[Path, Reason | None], None],
    local_reason: Reason | None = None,
) -> AsyncIterator[Any]:
    """Remote prefill then decode; local prefill on decode when the remote path fails.

    `kv_ready_timeout_s()` is asked when the decode request starts: the time its first item
    may take (KV pulled from prefill), or None for no bound. `local_reason` set: prefill
    locally straight away (a request the remote path cannot serve well). `on_path` is told
    once how the request was prefilled. Nothing is yielded before the decode engine
    produced its first item, so a fallback never duplicates output.
    """
    if local_reason is not None:
        outcome = PrefillOutcome(reason=local_reason)
    else:
        outcome = await prefill()
    if outcome.refusal is not None:
        yield outcome.refusal  # the request's own error: the client's answer, as decode would give it
        return
    if outcome.reason is None:
        gen = await decode_with(outcome.chunk)
        try:
            first, gen = await first_then_rest(gen, kv_ready_timeout_s())
        except StopAsyncIteration:
            on_path(outcome.path, None)
            return
        except asyncio.CancelledError:
            await aclose_quietly(gen)
            raise
        except TimeoutError:
            await aclose_quietly(gen)  # aborts the engine request: vLLM frees its KV blocks
            outcome.reason = Reason.KV_TIMEOUT
        else:
            if is_server_error(first_item(first)):
                await aclose_quietly(gen)
                outcome.reason = Reason.KV_LOAD_ERROR
            else:
                on_path(outcome.path, None)
                yield first
                async for item in gen:
                    yield item
                return
    assert outcome.reason is not None
    on_path(Path.LOCAL, outcome.reason)
    logger.warning("prefill locally on decode (%s)", outcome.reason.value)
    async for item in await decode_local():
        yield item
