"""Stream migration: a decode stream cut after its first byte continues on another replica.

What flows through here, for a streamed chat or completion that the ingress sent to decode:
  1. `not_continuable(endpoint, fields)` decides once, before dispatch, whether the request
     can be continued, from the few fields that decide it (`ClientFields.among`; the rest of
     the request is dumped only when a continuation needs it). Every field a client may send
     (serving.ingress.fields.ALLOWED) is either carried to the continuation, already inside
     the prompt's token ids (or already sent), recomputed, or makes the request one that is
     not continued: tools, structured output, logprobs, n > 1 and a completion suffix shape
     or parse the whole answer, and a restart in the middle would change it.
     tests/serving/ingress/test_migration.py fails when an allowed field has no class here.
  2. `StreamRecord.relay_event` reads every SSE event of the original stream (a step of the
     ingress's one pass over the events, serving.ingress.sse.EventPipeline): the response id,
     created and model, the prompt's token ids and each chunk's token ids (vLLM's
     `return_token_ids`, which the ingress sets), the text the client has, the finish.
     It returns the events as the client would have had them without `return_token_ids`
     (ids removed, the empty chunks vLLM adds for them dropped), unless the client asked.
  3. When the decode replica dies, answers a 5xx error event, or sends nothing for
     `stallTimeoutS`, `StreamRecord.continuation` is a /v1/completions body whose prompt is
     the prompt's ids plus the generated ids whose text the client already has (token ids,
     never re-tokenised text), with the same sampling values and what is left of
     max_tokens and min_tokens. The ingress dispatches it like any request: through
     prefill and NIXL, or prefilled on decode, as the spec and the circuit allow.
  4. `StreamRecord.reframe_event` turns the continuation's events into the original
     stream's: the same id, created and model, chat deltas or completion text, index 0, and a
     usage that counts the prompt once and every generated token once.
The bounds (`migrations` per request, the request's total deadline) and the driver that
uses this record live in serving/ingress/relay.py (`guarded_stream`).

Why our own code: no serving library continues a cut stream (Ray Serve LLM, llm-d, AIBrix
and production-stack end it; NVIDIA Dynamo migrates in its own Rust frontend).

Exactness: a token whose text vLLM has not emitted yet (a multi-byte character split over
tokens, or text held back while it may still become a stop string) is not part of the
continuation's prompt: it is generated again. What the client saw is never repeated; what
it did not see may differ from the cut stream (it was never sent). A request with presence
or frequency penalties is not continued: vLLM applies them to generated tokens only, and the
continuation's engine would see the kept tokens as prompt (`make conformance` found it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.core.calls import sse_error, sse_error_doc
from serving.core.failures import Reason, Unservable
from serving.core.metrics import MigrationOutcome
from serving.ingress.fields import GENERATE, Continuation, blocking_rules, continuation_class
from serving.ingress.sse import DONE, DONE_PACKET, EventPipeline, OwnEvents, decode_packet, packet_of

logger = logging.getLogger("ray.serve")

# The registry's classes (serving/ingress/fields.py), for every generating endpoint.
CARRIED = continuation_class(Continuation.CARRIED)
RECOMPUTED = continuation_class(Continuation.RECOMPUTED)
APPLIED = continuation_class(Continuation.APPLIED)
NOT_CONTINUED = continuation_class(Continuation.BLOCKS)

OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def not_continuable(endpoint: str, fields: Mapping[str, Any]) -> str | None:
    """Why a request with these (client-set) fields cannot be continued, else None."""
    if endpoint not in GENERATE:
        return f"endpoint {endpoint}"
    rules = blocking_rules(endpoint)
    for name, value in fields.items():
        rule = rules.get(name)
        if rule is not None and rule[0](value):
            return rule[1]
    return None


def whole_number(value: Any) -> int | None:
    """A count field as vLLM's request model reads it (pydantic's lax mode: 5, 5.0 and "5"
    are 5); None when unset or not a whole number (the engine refuses those itself)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None


def stop_strings(fields: Mapping[str, Any]) -> list[str]:
    """The request's stop strings (OpenAI: a string or a list of them)."""
    stop = fields.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop or () if isinstance(s, str) and s]


class StopMatcher:
    """vLLM's stop-string rule (vllm/v1/engine/detokenizer.py, 0.29 and 0.32: hold back
    max(len(stop)) - 1 characters while they may still become a stop string, search the new
    text for each stop string in order, truncate at the first match, and match nothing while
    the generated tokens are at most min_tokens), applied by the ingress to a stream that may
    be continued. The engine is asked for `include_stop_str_in_output` instead, so it holds
    nothing back: the text it generated is all in the stream, the record's token ids match
    the text the ingress holds, and a stop string that straddles a cut is still found (the
    continuation's engine never sees the first half as output)."""

    def __init__(self, stops: list[str], include: bool, min_tokens: int = 0):
        self.stops = stops
        self.include = include
        self.min_tokens = min_tokens
        longest = max(len(s) for s in stops)
        self.hold = 0 if include else longest - 1  # unsent characters
        self.context = longest - 1 if include else 0  # sent characters a match may start in
        self.unsent = ""
        self.sent_tail = ""  # the last sent characters (include: a match may start there)

    def feed(self, text: str, generated: int) -> tuple[str, str | None]:
        """(text the client gets now, the stop string matched or None)."""
        pending = self.unsent + text
        window = self.sent_tail + pending
        if generated > self.min_tokens and text:
            start = len(window) - len(text)  # a match must end in the new text
            for stop in self.stops:
                at = window.find(stop, max(0, start - len(stop) + 1))
                if at >= 0:
                    end = at + len(stop) if self.include else at
                    self.unsent = ""
                    return window[len(self.sent_tail) : max(end, len(self.sent_tail))], stop
        cut = len(pending) - self.hold if self.hold else len(pending)
        out, self.unsent = pending[: max(cut, 0)], pending[max(cut, 0) :]
        self.sent_tail = (self.sent_tail + out)[-self.context :] if self.context else ""
        return out, None

    def flush(self) -> str:
        out, self.unsent = self.unsent, ""
        return out


@dataclass
class StreamRecord:
    """What a continuation needs of one streamed answer (choice 0), and its client view."""

    endpoint: str
    # The fields the client set (its JSON body, allow-listed), and its max_tokens after the
    # server's defaults (chat: none; completions: 16).
    fields: Mapping[str, Any]
    max_tokens: int | None
    client_ids: bool = False  # the client itself asked for return_token_ids
    # The model's context: a chat with no cap runs to its end, and so does its continuation.
    context_len: int | None = None
    response_id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    kept: list[int] = field(default_factory=list)  # generated ids whose text the client has (or the matcher holds)
    pending: list[int] = field(default_factory=list)  # generated ids whose text it has not yet
    finish_reason: str | None = None  # the finish the client has (or must get: `finish`)
    finish_sent: bool = False
    # Why the stream cannot be continued after all: tool calls or reasoning in it, or text
    # whose token ids the engine did not send (a tool or reasoning parser drops them).
    parsed_output: str | None = None
    # completion tokens counted before the current continuation (its usage starts at 0)
    _base: int = 0
    usage_sent: bool = False  # the final usage event (no choices) went out
    stopped: bool = False  # the ingress matched a stop string: the answer is complete
    _stop: StopMatcher | None = None

    def __post_init__(self) -> None:
        stops = stop_strings(self.fields)
        if stops:
            include = bool(self.fields.get("include_stop_str_in_output"))
            self._stop = StopMatcher(stops, include, whole_number(self.fields.get("min_tokens")) or 0)

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    @property
    def generated(self) -> int:
        """The tokens of choice 0 generated so far (whether or not the client has their text)."""
        return len(self.kept) + len(self.pending)

    def engine_fields(self) -> dict[str, Any]:
        """What the engine request carries beyond the client's fields so that the stream can
        be continued: every chunk's token ids, and nothing held back while it may become a
        stop string (the ingress applies the stop strings itself, StopMatcher)."""
        extra: dict[str, Any] = {"return_token_ids": True}
        if self._stop is not None:
            extra["include_stop_str_in_output"] = True
        return extra

    # --- the original stream ---------------------------------------------------------------
    # relay_event and reframe_event are steps of serving.ingress.sse.EventPipeline: they read one
    # event's JSON object (not an error event: [DONE], comments and a 4xx error event go on
    # as they came), edit it in place or return another, or None to drop the event.
    def relay(self, packet: str) -> str:
        """The original stream's packet as the client gets it; the record takes note (one
        packet through relay_event alone: what the record's own tests drive)."""
        pipe = EventPipeline()
        pipe.step = self.relay_event
        return pipe.engine(packet, decode_packet(packet))[0]

    def _take(self, choice: dict[str, Any], text: Any) -> str:
        """Notes the choice's token ids and finish; returns the text the client gets now
        (the stop strings applied), and sets the choice's finish when one matched."""
        if text and "token_ids" not in choice:
            self.parsed_output = self.parsed_output or "text without token ids"
        ids = [int(i) for i in choice.get("token_ids") or []]
        if self.client_ids:
            self.kept.extend(ids)  # the client has every id, whatever the text
        else:
            self.pending.extend(ids)
            if text:
                self.kept.extend(self.pending)
                self.pending.clear()
        out = text or ""
        if self._stop is not None:
            out, matched = self._stop.feed(out, len(self.kept) + len(self.pending))
            if matched is not None:
                self.stopped = True
                choice["finish_reason"], choice["stop_reason"] = "stop", matched
            elif choice.get("finish_reason"):
                out += self._stop.flush()
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.finish_sent = True
            self.kept.extend(self.pending)
            self.pending.clear()
        return out

    def relay_event(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """One event of the original stream: noted, its token ids removed unless the client
        asked for them; None for a chunk that exists only to carry token ids, or that comes
        after the ingress matched a stop string."""
        self.response_id = self.response_id or data.get("id")
        self.created = self.created or data.get("created")
        self.model = self.model or data.get("model")
        if data.get("prompt_token_ids") is not None:  # chat: on the first chunk
            self.prompt_ids = [int(i) for i in data["prompt_token_ids"]]
        usage = data.get("usage")
        if isinstance(usage, Mapping):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.usage_sent = self.usage_sent or not data.get("choices")
        if self.stopped and data.get("choices"):
            return None
        keep = False
        for choice in data.get("choices") or []:
            if choice.get("prompt_token_ids") is not None:  # completions
                self.prompt_ids = [int(i) for i in choice["prompt_token_ids"]]
            if self.chat:
                delta = choice.get("delta") or {}
                for key in ("tool_calls", "reasoning", "reasoning_content"):
                    if delta.get(key):
                        self.parsed_output = key
                text = self._take(choice, delta.get("content"))
                if delta.get("content") is not None or text:
                    # (text held back for a stop string comes out with the finish, whose
                    # delta after an EOS is `{}` where a tool or reasoning parser runs)
                    choice["delta"] = delta = {**delta, "content": text}
                keep = keep or bool(set(delta) - {"content"}) or bool(text)
            else:
                choice["text"] = self._take(choice, choice.get("text"))
                keep = True
            keep = keep or bool(choice.get("finish_reason")) or choice.get("logprobs") is not None
        if self.client_ids:
            return data
        for choice in data.get("choices") or []:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        data.pop("prompt_token_ids", None)
        if data.get("choices") and not keep:
            return None  # a chunk that exists only to carry token ids
        return data

    # --- the continuation ------------------------------------------------------------------
    def not_continuable(self) -> str | None:
        if self.parsed_output:
            return self.parsed_output
        if self.prompt_ids is None or self.response_id is None:
            return "no prompt token ids in the stream"
        return None

    def continuation(self) -> dict[str, Any] | None:
        """The /v1/completions body that continues the answer, or None when the answer has
        nothing left to generate (finished, or max_tokens reached: then `finish` ends it)."""
        if self.finish_reason is not None:
            return None
        remaining = None if self.max_tokens is None else self.max_tokens - len(self.kept)
        if remaining is not None and remaining <= 0:
            self.finish_reason = "length"
            return None
        assert self.prompt_ids is not None
        prompt = self.prompt_ids + self.kept
        if remaining is None and self.context_len is not None:
            # A chat with no cap runs to the context's end; a completion's default is 16.
            remaining = self.context_len - len(prompt)
            if remaining <= 0:
                self.finish_reason = "length"
                return None
        body: dict[str, Any] = {k: v for k, v in self.fields.items() if k in CARRIED}
        body.update(prompt=prompt, stream=True, **self.engine_fields())
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = whole_number(self.fields.get("min_tokens"))
        if min_tokens:
            body["min_tokens"] = max(0, min_tokens - len(self.kept))
        self.pending.clear()  # generated again by the continuation
        self._base = len(self.kept)
        return body

    def _usage(self, usage: Mapping[str, Any]) -> dict[str, int]:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or [])
        completion = self._base + int(usage.get("completion_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _frame(self, choices: list[dict[str, Any]], usage: Mapping[str, Any] | None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": self.response_id,
            "object": OBJECT[self.endpoint],
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            doc["usage"] = self._usage(usage)
            self.usage_sent = self.usage_sent or not choices
        return doc

    def reframe_event(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """One event of a continuation, as a part of the original stream (None: dropped)."""
        usage = data.get("usage") if isinstance(data.get("usage"), Mapping) else None
        if self.stopped and data.get("choices"):
            return None
        choices = []
        for choice in data.get("choices") or []:
            text = self._take(choice, choice.get("text") or "")
            fr = choice.get("finish_reason")
            out: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": fr}
            if self.chat:
                out["delta"] = {"content": text} if text else {}
            else:
                out["text"] = text
            if choice.get("stop_reason") is not None:
                out["stop_reason"] = choice["stop_reason"]
            if self.client_ids:
                out["token_ids"] = choice.get("token_ids") or []
            elif self.chat and not text and not fr:
                continue  # chat sends no chunk without text unless ids were asked for
            choices.append(out)
        if data.get("choices") and not choices:
            return None
        return self._frame(choices, usage)

    def finish(self) -> list[dict[str, Any]]:
        """The end of an answer that is complete before its stream is (every token generated
        before a cut, or a stop string the ingress matched), as events' JSON: its finish chunk
        (unless the client has it) and, when the stream was asked for usage, the usage event;
        no [DONE] (the driver sends it)."""
        out = []
        if not self.finish_sent:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason or "length"}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            out.append(self._frame([choice], None))
            self.finish_sent = True
        opts = self.fields.get("stream_options")
        if isinstance(opts, Mapping) and opts.get("include_usage") and not self.usage_sent:
            self._base = len(self.kept)
            out.append(self._frame([], {"completion_tokens": 0}))
        return out


# --- the driver's continuation (serving/ingress/relay.py guarded_stream) ---------------------
# Between two tries of a continuation that Serve refused for back-pressure.
CONTINUATION_BACKOFF_S = 0.25


@dataclass
class Migration:
    """What `guarded_stream` needs to continue a stream cut after its first byte
    (serving/ingress/migration.py). `record` is None when the request cannot be continued
    (`blocked` says why): its cut still ends with the error event, and is counted."""

    record: StreamRecord | None
    blocked: str | None
    attempts: int  # continuations left (resilience.migrations)
    stall_timeout_s: float
    # dispatches a continuation body like a new request: (first chunk, stream) or raises
    resume: Callable[[dict[str, Any]], Awaitable[tuple[Any, Any]]]
    on_outcome: Callable[[Reason, MigrationOutcome], None]  # (why the stream was cut, what became of it)
    # A test hook (TEST_HOOKS_ENV only): cut the stream once, as a stall, after the packet that
    # brings its generated tokens to this many, so a harness can exercise migration at any k.
    cut_after: int | None = None

    def forced_cut(self) -> bool:
        """Whether the test hook cuts the stream now (once)."""
        if self.cut_after is None or self.record is None or self.record.generated < self.cut_after:
            return False
        self.cut_after = None
        return True


def error_events(message: str, code: int, type_: str = "server_error") -> OwnEvents:
    return OwnEvents([sse_error_doc(message, code, type_), DONE], lambda: sse_error(message, code, type_))


def finish_events(record: StreamRecord) -> OwnEvents:
    docs = record.finish()
    return OwnEvents([*docs, DONE], lambda: "".join(packet_of(d) for d in docs) + DONE_PACKET)


async def continue_stream(migration: Migration, cut: Reason) -> tuple[Any, Any] | OwnEvents:
    """After a cut: (first chunk, stream) of the continuation, or the events that end the
    stream (the answer's finish when nothing was left to generate, else the error event)."""
    record = migration.record
    why = migration.blocked or (record.not_continuable() if record else "no record")
    failed = error_events("The model stream failed; the answer is incomplete.", 500)
    if record is None or why is not None:
        migration.on_outcome(cut, MigrationOutcome.NOT_MIGRATABLE)
        logger.warning("stream cut (%s), not continued: %s", cut.value, why)
        return failed
    body = record.continuation()
    if body is None:  # every token was generated before the cut
        migration.on_outcome(cut, MigrationOutcome.CONTINUED)
        return finish_events(record)
    if migration.attempts <= 0:
        migration.on_outcome(cut, MigrationOutcome.FAILED)
        logger.warning("stream cut (%s): no continuation left", cut.value)
        return failed
    migration.attempts -= 1
    # Serve's back-pressure right after a replica died (its streams and the new requests all
    # land on the survivors at once) is waited out for up to stallTimeoutS: the client already
    # holds part of this answer, so its continuation queues where a new request is refused.
    patience = time.monotonic() + migration.stall_timeout_s
    while True:
        try:
            resumed = await migration.resume(body)
            break
        except Exception as exc:  # Unservable (no replica, overload, the deadline), an engine refusal
            busy = isinstance(exc, Unservable) and exc.reason is Reason.OVERLOADED
            if busy and time.monotonic() + CONTINUATION_BACKOFF_S < patience:
                await asyncio.sleep(CONTINUATION_BACKOFF_S)
                continue
            migration.on_outcome(cut, MigrationOutcome.FAILED)
            logger.warning("stream cut (%s), continuation failed: %r", cut.value, exc)
            return failed
    migration.on_outcome(cut, MigrationOutcome.CONTINUED)
    logger.info("stream cut (%s) continued on another replica after %d tokens", cut.value, len(record.kept))
    return resumed
