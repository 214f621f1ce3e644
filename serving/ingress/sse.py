"""OpenAI server-sent events, re-emitted: each event decoded once, edited, encoded once.

What flows through here: the text of an OpenAI-style event stream (the cluster's answer in
the ingress, or an external provider's in the fallback relay) -> its events, each one's JSON
decoded once (`decode_packet`, `SseDecoder`) -> the steps that read or edit that one dict:
the stream-migration record (serving/ingress/migration.py: token ids noted and stripped) and the
rewriter (`SseRewriter`: `model` rewritten to ours where asked, usage read off for limits
and metering and removed again where the client did not ask for it, engine-internal fields
(kv_transfer_params, ec_transfer_params) dropped, keep-alive comments dropped) -> each kept
event encoded once, compact -> the text to send. When a stream ends without usage,
`estimated_usage` counts the completion from the text relayed.

`EventPipeline` is that walk for the ingress's streams (serving/ingress/relay.py
`guarded_stream` drives it; serving/ingress/routing.py adds the rewriter to it through
`EventStreamResponse` instead of reading the stream a second time).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

# Rough size of a token for estimates (~4 characters in English), as serving.ingress.limits reserves.
CHARS_PER_TOKEN = 4

DONE = "[DONE]"
DONE_PACKET = "data: [DONE]\n\n"
# The one decoder and encoder of the streamed events, built once: msgspec's (vLLM's own
# dependency, in every image that runs an engine), about 3x faster than the standard
# library's to decode and 8x to encode one chunk. It writes UTF-8 rather than \u escapes and a
# NaN as null, as vLLM's server (pydantic) does. The standard library's stay for what msgspec
# refuses (an integer past 64 bits, a NaN literal, a value that is not plain JSON), so every
# event still reads as it did.
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
_STD_DECODER = json.JSONDecoder()
_STD_ENCODER = json.JSONEncoder(separators=(",", ":"))


class _NotJson:
    def __repr__(self) -> str:
        return "NOT_JSON"


NOT_JSON: Any = _NotJson()  # an event whose data is not JSON (or that has no data)


@dataclass(slots=True)
class Event:
    """One server-sent event: its text as it came, its data lines, and their JSON."""

    raw: str  # the event's lines, without the blank line that ended it
    data: str | None  # the data lines' values joined by "\n"; None: no data line (a comment)
    doc: Any  # the data decoded: a dict (or another JSON value), DONE, or NOT_JSON


def parse_event(raw: str) -> Event:
    """One event's text -> its Event, the JSON decoded (the one decode of this event)."""
    lines = [ln[5:].lstrip() for ln in raw.split("\n") if ln.startswith("data:")]
    if not lines:
        return Event(raw, None, NOT_JSON)
    data = "\n".join(lines)
    if data.strip() == DONE:
        return Event(raw, data, DONE)
    try:
        doc = _DECODER.decode(data)
    except msgspec.DecodeError:
        try:
            doc = _STD_DECODER.decode(data)
        except (ValueError, RecursionError):
            doc = NOT_JSON
    except RecursionError:  # nested past the parser's depth (msgspec and json alike): no JSON
        doc = NOT_JSON
    return Event(raw, data, doc)


def decode_packet(packet: str) -> list[Event]:
    """The events of a packet of whole events (Ray's openai_sse_packet makes one
    `data: ...\\n\\n` per chunk); a trailing piece without its blank line is an event too."""
    return [parse_event(raw) for raw in packet.replace("\r\n", "\n").split("\n\n") if raw.strip()]


def encode(doc: Any) -> str:
    """An event's JSON, compact (what json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    writes)."""
    try:
        return _ENCODER.encode(doc).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        return _STD_ENCODER.encode(doc)


def packet_of(doc: Any) -> str:
    return f"data: {encode(doc)}\n\n"


class SseDecoder:
    """Events of a stream whose chunks may split an event: the rest waits for the next chunk."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text.replace("\r\n", "\n")
        if "\n\n" not in self._buf:
            return []
        *whole, self._buf = self._buf.split("\n\n")
        return [parse_event(raw) for raw in whole if raw.strip()]

    def flush(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        return [parse_event(rest)] if rest.strip() else []


def cached_tokens(usage: Any) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of an OpenAI usage object (0 when absent)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return int(cached) if isinstance(cached, int | float) and not isinstance(cached, bool) and cached > 0 else 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seen: bool = False
    # Prompt tokens served from a prefix cache (vLLM's prompt_tokens_details, which the spec
    # turns on; a provider's the same way): what a request's cost leaves out.
    cached_tokens: int = 0

    def take(self, usage: Any) -> None:
        if isinstance(usage, Mapping):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.cached_tokens = cached_tokens(usage)
            self.seen = True


# --- server-sent events ---------------------------------------------------------------------
@dataclass
class SseRewriter:
    """Re-emits an OpenAI event stream: `model` set to ours, usage read, usage-only event
    dropped when the client did not ask for it (we ask upstream so we can count)."""

    model: str | None
    keep_usage_event: bool
    # Usage carried by chunks that also carry choices (vLLM's continuous_usage_stats, or a
    # provider's last chunk): kept for the client when None (the usage-event rule decides).
    keep_chunk_usage: bool | None = None
    usage: Usage = field(default_factory=Usage)
    done: bool = False
    finished: bool = False  # a choice carried a finish_reason
    text_chars: int = 0  # generated text seen, for an estimate when no usage arrives
    _decoder: SseDecoder = field(default_factory=SseDecoder)

    def feed(self, text: str) -> list[str]:
        return self.render(self._decoder.feed(text))

    def flush(self) -> list[str]:
        return self.render(self._decoder.flush())

    def render(self, events: Iterable[Event]) -> list[str]:
        out = []
        for ev in events:
            text = self.rewrite(ev, ev.doc)
            if text is not None:
                out.append(text)
        return out

    def rewrite(self, ev: Event, doc: Any) -> str | None:
        """The text the client gets for `ev`, whose JSON (possibly edited by a step before
        this one) is `doc`; None: nothing (a comment, a usage event it did not ask for)."""
        if ev.data is None:
            return None  # comments / keep-alives: nothing the client needs
        if doc is DONE:
            self.done = True
            return DONE_PACKET
        if isinstance(doc, dict):
            kept = self.edit(doc)
            return None if kept is None else packet_of(kept)
        return f"data: {ev.data}\n\n"

    def edit(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Reads and edits one event's JSON in place; None: the client does not get it."""
        self._look(msg)
        # Engine-internal coordinates (vLLM puts kv_transfer_params on answers) never leave.
        msg.pop("kv_transfer_params", None)
        msg.pop("ec_transfer_params", None)
        if msg.get("usage"):
            self.usage.take(msg["usage"])
            keep_chunk = self.keep_usage_event if self.keep_chunk_usage is None else self.keep_chunk_usage
            if not msg.get("choices"):
                if not self.keep_usage_event:
                    return None
            elif not keep_chunk:
                msg["usage"] = None
        if self.model is not None and "model" in msg:
            msg["model"] = self.model
        return msg

    def _look(self, msg: dict[str, Any]) -> None:
        for choice in msg.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finished = True
            delta = choice.get("delta") or choice.get("message")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                self.text_chars += len(text)


# --- the ingress's one pass over a stream ---------------------------------------------------
# A step reads one event's JSON object and edits it in place, or returns another, or None to
# drop the event.
Step = Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class OwnEvents:
    """Events the ingress writes itself (a migrated answer's finish, the error event,
    [DONE]): their JSON values, and `text`, the same written out for a stream no step reads."""

    docs: list[Any]
    text: Callable[[], str]


DONE_EVENTS = OwnEvents([DONE], lambda: DONE_PACKET)


class EventPipeline:
    """The events of one streamed answer in the ingress, each decoded once, through every
    step that reads or edits it, encoded once.

    `step` (serving/ingress/migration.py's record: the original stream, then a continuation's) sees
    the engine's JSON objects that are not error events, and may drop one; the events it
    does not read go on as they came. `rewriter` (serving/ingress/routing.py's metering) sees every
    event the client would get, the ingress's own included, and writes the text sent. With
    neither, a packet is sent as it came, unread.
    """

    def __init__(self) -> None:
        self.step: Step | None = None
        self.rewriter: SseRewriter | None = None
        self._on_close: list[Callable[[], None]] = []

    @property
    def reads(self) -> bool:
        return self.step is not None or self.rewriter is not None

    def meter(self, rewriter: SseRewriter, on_close: Callable[[], None]) -> None:
        """Adds the rewriter; `on_close` runs when the stream has ended or was closed."""
        self.rewriter = rewriter
        self._on_close.append(on_close)

    def close(self) -> None:
        callbacks, self._on_close = self._on_close, []
        for fn in callbacks:
            fn()

    def engine(self, packet: str, events: list[Event]) -> tuple[str, bool]:
        """(text to send, whether what the step let through ends with [DONE]) for one packet
        of the engine's stream, decoded as `events`."""
        out = []
        last_raw: str | None = None  # the last event let through unread: the [DONE] check
        for ev in events:
            doc = ev.doc
            read = self.step is not None and isinstance(doc, dict) and "error" not in doc
            if read:
                assert self.step is not None
                doc = self.step(doc)
                if doc is None:
                    continue  # a chunk that exists only to carry token ids
                last_raw = None
            else:
                last_raw = ev.raw
            if self.rewriter is not None:
                text = self.rewriter.rewrite(ev, doc)
                if text is not None:
                    out.append(text)
            else:
                out.append(packet_of(doc) if read else ev.raw + "\n\n")
        if self.step is None:
            done = packet.rstrip().endswith("data: [DONE]")
        else:
            done = last_raw is not None and last_raw.rstrip().endswith("data: [DONE]")
        return "".join(out), done

    def own(self, events: OwnEvents) -> str:
        """The ingress's own events: through the rewriter when there is one (each encoded
        once, there), else as they are written."""
        if self.rewriter is None:
            return events.text()
        out = []
        for doc in events.docs:
            sent = self.rewriter.rewrite(Event("", DONE if doc is DONE else "", doc), doc)
            if sent is not None:
                out.append(sent)
        return "".join(out)


class EventStreamResponse(StreamingResponse):
    """A streamed answer whose events pass through `events` (an EventPipeline): a layer above
    adds its rewriter there instead of reading the stream a second time. `release`: what
    frees the stream's resources if its generator never runs (serving.ingress.relay.Abandon),
    called when the response's ASGI call ends, however it ends."""

    def __init__(
        self, content: Any, *, events: EventPipeline, release: Callable[[], None] | None = None, **kwargs: Any
    ):
        super().__init__(content, **kwargs)
        self.events = events
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.release is not None:
                self.release()


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streamed body ask for the final usage event; True if the client had asked."""
    if not body.get("stream"):
        return True
    opts = body.get("stream_options")
    asked = bool(isinstance(opts, dict) and opts.get("include_usage"))
    if not asked:
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return asked


def estimated_usage(rewriter: SseRewriter) -> Usage:
    """Usage of a stream cut before its usage event: the completion from the text relayed
    (~4 characters a token, serving.ingress.limits' estimate), so the tokens are still limited."""
    return Usage(completion_tokens=-(-rewriter.text_chars // CHARS_PER_TOKEN), seen=False)
