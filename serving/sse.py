"""OpenAI server-sent events, re-emitted: our model id, usage read, internals dropped.

What flows through here: the text of an OpenAI-style event stream (the cluster's answer in
the ingress, or an external provider's in the fallback relay) -> one event at a time: `model`
rewritten to ours (the provider's name never reaches the client), usage read off (for limits
and metering) and removed again where the client did not ask for it, engine-internal fields
(kv_transfer_params) dropped, keep-alive comments dropped -> the events to send. When a stream
ends without usage, `estimated_usage` counts the completion from the text relayed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Rough size of a token for estimates (~4 characters in English), as serving.limits reserves.
CHARS_PER_TOKEN = 4


@dataclass
@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seen: bool = False

    def take(self, usage: Any) -> None:
        if isinstance(usage, Mapping):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
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
    _buf: str = ""
    done: bool = False
    finished: bool = False  # a choice carried a finish_reason
    text_chars: int = 0  # generated text seen, for an estimate when no usage arrives

    def feed(self, text: str) -> list[str]:
        self._buf += text.replace("\r\n", "\n")
        out = []
        while "\n\n" in self._buf:
            event, self._buf = self._buf.split("\n\n", 1)
            rewritten = self._event(event)
            if rewritten is not None:
                out.append(rewritten)
        return out

    def flush(self) -> list[str]:
        rest, self._buf = self._buf, ""
        if rest.strip():
            r = self._event(rest)
            return [r] if r is not None else []
        return []

    def _event(self, event: str) -> str | None:
        data_lines = [ln[5:].lstrip() for ln in event.split("\n") if ln.startswith("data:")]
        if not data_lines:
            return None  # comments / keep-alives: nothing the client needs
        data = "\n".join(data_lines)
        if data.strip() == "[DONE]":
            self.done = True
            return "data: [DONE]\n\n"
        try:
            msg = json.loads(data)
        except json.JSONDecodeError:
            return f"data: {data}\n\n"
        if isinstance(msg, dict):
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
            return f"data: {json.dumps(msg, separators=(',', ':'))}\n\n"
        return f"data: {data}\n\n"

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
    (~4 characters a token, serving.limits' estimate), so the tokens are still limited."""
    return Usage(completion_tokens=-(-rewriter.text_chars // CHARS_PER_TOKEN), seen=False)
