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
it did not see may differ from the cut stream (it was never sent). Penalties that look at
generated tokens only (presence/frequency) see the continuation's output only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.ingress.sse import EventPipeline, decode_packet

# Fields sent on to the continuation unchanged: they steer sampling of every token.
CARRIED = frozenset(
    {
        "model",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "bad_words",
        "logit_bias",
        "seed",
        "user",
        "cache_salt",
        "stream_options",
    }
)
# Fields whose value the continuation recomputes (what is left), or sets itself.
RECOMPUTED = frozenset({"max_tokens", "max_completion_tokens", "min_tokens", "stream", "return_token_ids"})
# Fields already applied: they shaped the prompt (its token ids are the continuation's
# prompt) or the first chunk (echo), and must not be applied twice.
APPLIED = frozenset(
    {
        "messages",
        "prompt",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "add_special_tokens",
        "truncate_prompt_tokens",
        "reasoning_effort",
        "echo",
        # Only shape output when tools are given; tools make the request not continuable.
        "parallel_tool_calls",
        # Only shapes output with a reasoning parser; reasoning in the stream stops migration.
        "include_reasoning",
    }
)


def _set(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


# Fields that, when set, make a request not continuable, with the reason.
NOT_CONTINUED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v not in (None, 1), "n > 1"),
    "logprobs": (_set, "logprobs"),
    "top_logprobs": (_set, "logprobs"),
    "tools": (_set, "tools"),
    "tool_choice": (lambda v: v not in (None, "none"), "tools"),
    "response_format": (
        lambda v: isinstance(v, Mapping) and v.get("type") not in (None, "text"),
        "structured output",
    ),
    "structured_outputs": (_set, "structured output"),
    "suffix": (_set, "suffix"),
}

OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def not_continuable(endpoint: str, fields: Mapping[str, Any]) -> str | None:
    """Why a request with these (client-set) fields cannot be continued, else None."""
    if endpoint not in OBJECT:
        return f"endpoint {endpoint}"
    for name, value in fields.items():
        rule = NOT_CONTINUED.get(name)
        if rule is not None and rule[0](value):
            return rule[1]
    return None


class ClientFields(Mapping[str, Any]):
    """The fields a client set on a typed request (pydantic's `model_dump(exclude_unset=True)`),
    dumped when first read. Only a cut stream reads them whole (its continuation, or the
    finish written for it); before dispatch `among` dumps the few that decide whether the
    request can be continued, and only those the client set."""

    def __init__(self, body: Any):
        self._body = body
        self._dump: dict[str, Any] | None = None

    def _fields(self) -> dict[str, Any]:
        if self._dump is None:
            self._dump = self._body.model_dump(exclude_unset=True)
        return self._dump

    def __getitem__(self, name: str) -> Any:
        return self._fields()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields())

    def __len__(self) -> int:
        return len(self._fields())

    def among(self, names: Iterable[str]) -> dict[str, Any]:
        """Those of `names` the client set, valued as in the whole dump."""
        wanted = set(names) & set(self._body.model_fields_set)
        if not wanted:
            return {}
        if self._dump is not None:
            return {k: v for k, v in self._dump.items() if k in wanted}
        return dict(self._body.model_dump(include=wanted, exclude_unset=True))


@dataclass
class StreamRecord:
    """What a continuation needs of one streamed answer (choice 0), and its client view."""

    endpoint: str
    # The original request as the client set it (pydantic exclude_unset; ClientFields dumps
    # it when first read), and its max_tokens after the server's defaults (chat: none;
    # completions: 16).
    fields: Mapping[str, Any]
    max_tokens: int | None
    client_ids: bool = False  # the client itself asked for return_token_ids
    response_id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    kept: list[int] = field(default_factory=list)  # generated ids whose text the client has
    pending: list[int] = field(default_factory=list)  # generated ids whose text it has not yet
    finish_reason: str | None = None  # the finish the client has (or must get: `finish`)
    finish_sent: bool = False
    parsed_output: str | None = None  # tool calls or reasoning in the stream: not continuable
    # completion tokens counted before the current continuation (its usage starts at 0)
    _base: int = 0
    usage_sent: bool = False  # the final usage event (no choices) went out

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

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

    def _take(self, choice: Mapping[str, Any], text: Any) -> None:
        ids = [int(i) for i in choice.get("token_ids") or []]
        if self.client_ids:
            self.kept.extend(ids)  # the client has every id, whatever the text
        else:
            self.pending.extend(ids)
            if text:
                self.kept.extend(self.pending)
                self.pending.clear()
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.finish_sent = True
            self.kept.extend(self.pending)
            self.pending.clear()

    def relay_event(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """One event of the original stream: noted, its token ids removed unless the client
        asked for them; None for a chunk that exists only to carry token ids."""
        self.response_id = self.response_id or data.get("id")
        self.created = self.created or data.get("created")
        self.model = self.model or data.get("model")
        if data.get("prompt_token_ids") is not None:  # chat: on the first chunk
            self.prompt_ids = [int(i) for i in data["prompt_token_ids"]]
        usage = data.get("usage")
        if isinstance(usage, Mapping):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.usage_sent = self.usage_sent or not data.get("choices")
        keep = False
        for choice in data.get("choices") or []:
            if choice.get("prompt_token_ids") is not None:  # completions
                self.prompt_ids = [int(i) for i in choice["prompt_token_ids"]]
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                for key in ("tool_calls", "reasoning", "reasoning_content"):
                    if delta.get(key):
                        self.parsed_output = key
                keep = keep or bool(set(delta) - {"content"}) or bool(text)
            else:
                text = choice.get("text")
                keep = True
            keep = keep or bool(choice.get("finish_reason")) or choice.get("logprobs") is not None
            self._take(choice, text)
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
        body: dict[str, Any] = {k: v for k, v in self.fields.items() if k in CARRIED}
        body.update(prompt=self.prompt_ids + self.kept, stream=True, return_token_ids=True)
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = self.fields.get("min_tokens")
        if min_tokens:
            body["min_tokens"] = max(0, int(min_tokens) - len(self.kept))
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
        choices = []
        for choice in data.get("choices") or []:
            text = choice.get("text") or ""
            self._take(choice, text)
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
        """The end of an answer whose tokens were all generated before the cut, as events'
        JSON: its finish chunk (unless the client has it) and, when the stream was asked for
        usage, the usage event; no [DONE] (the driver sends it)."""
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
