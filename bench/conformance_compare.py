"""What `make conformance` compares: two answers to one body, as a client reads them.

What flows through here: an HTTP answer (status, JSON body or SSE stream) -> `view`, the
answer as a client reads it, with what may differ between two servers left out (response
and tool-call ids, `created`, `model`, `system_fingerprint`; the engine-internal transfer
fields must be absent from ours and are dropped from the oracle's) and a stream joined:
per choice, the text, reasoning, tool calls (arguments joined), finish and stop reasons,
logprobs and token ids in order; the final usage; how many `[DONE]`; whether every chunk
carries one id -> `differences(oracle, ours)`: each place the two views differ, logprobs
within `LOGPROB_TOLERANCE`. The status class decides first: two refusals are the same
answer when their status is (their messages are each server's own words).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# float32 on CPU: two engines computing one prompt agree to far better than this; a different
# token is never within it (the harness compares the tokens themselves as well).
LOGPROB_TOLERANCE = 1e-3
# Never compared: each server's own identity of the answer.
VOLATILE = frozenset({"id", "created", "model", "system_fingerprint", "service_tier"})
# Never in our answers (the P/D handshake); the oracle shows them as null.
INTERNAL = frozenset({"kv_transfer_params", "ec_transfer_params"})


@dataclass
class Answer:
    """One server's answer to one body."""

    status: int
    doc: Any = None  # the JSON body: a whole answer or an error
    events: list[dict[str, Any]] | None = None  # a stream's events' JSON ([DONE] apart)
    done: int = 0  # how many `data: [DONE]`
    text: str = ""  # the raw body, for the report
    served_by: str | None = None  # our `x-served-by` (cluster or fallback)


def parse_stream(raw: str) -> tuple[list[dict[str, Any]], int]:
    """(the events' JSON objects, the number of [DONE]) of an SSE body."""
    events: list[dict[str, Any]] = []
    done = 0
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in block.split("\n") if line.startswith("data:"))
        if not data:
            continue
        if data == "[DONE]":
            done += 1
            continue
        try:
            events.append(json.loads(data))
        except json.JSONDecodeError:
            events.append({"unparsable": data})
    return events, done


def answer_of(status: int, content_type: str, raw: str) -> Answer:
    if "text/event-stream" in content_type and status == 200:
        events, done = parse_stream(raw)
        return Answer(status, events=events, done=done, text=raw)
    try:
        doc = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        doc = {"unparsable": raw[:200]}
    return Answer(status, doc=doc, text=raw)


def _message_view(msg: dict[str, Any]) -> dict[str, Any]:
    calls = [
        {"type": c.get("type"), "name": (c.get("function") or {}).get("name"), "arguments": _args(c)}
        for c in msg.get("tool_calls") or []
    ]
    return {
        "role": msg.get("role"),
        "content": msg.get("content") or "",
        "reasoning": msg.get("reasoning") or msg.get("reasoning_content") or "",
        "tool_calls": calls,
    }


def _args(call: dict[str, Any]) -> Any:
    raw = (call.get("function") or {}).get("arguments")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def _choice_view(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = {
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "logprobs": choice.get("logprobs"),
        "token_ids": choice.get("token_ids"),
        "prompt_token_ids": choice.get("prompt_token_ids"),
    }
    if chat:
        out.update(_message_view(choice.get("message") or {}))
    else:
        out["text"] = choice.get("text") or ""
    return out


def _whole_view(doc: dict[str, Any]) -> dict[str, Any]:
    chat = doc.get("object") == "chat.completion"
    choices = sorted(doc.get("choices") or [], key=lambda c: c.get("index", 0))
    return {
        "object": doc.get("object"),
        "choices": [_choice_view(c, chat) for c in choices],
        "usage": _usage(doc.get("usage")),
        "prompt_token_ids": doc.get("prompt_token_ids"),
        "prompt_logprobs": doc.get("prompt_logprobs"),
        "internal": sorted(k for k in INTERNAL if doc.get(k) is not None),
    }


def _usage(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    return {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


class _Joined:
    """One choice of a stream, its deltas joined."""

    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: Any = None
        self.stop_reason: Any = None
        self.logprobs: list[Any] | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: Any = None

    def take(self, choice: dict[str, Any], chat: bool) -> None:
        if chat:
            delta = choice.get("delta") or {}
            self.content += delta.get("content") or ""
            self.reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(call.get("index", 0), {"type": None, "name": None, "arguments": ""})
                slot["type"] = call.get("type") or slot["type"]
                fn = call.get("function") or {}
                slot["name"] = fn.get("name") or slot["name"]
                slot["arguments"] += fn.get("arguments") or ""
        else:
            self.content += choice.get("text") or ""
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.stop_reason = choice.get("stop_reason") if choice.get("stop_reason") is not None else self.stop_reason
        lp = choice.get("logprobs")
        if lp is not None:
            self.logprobs = (self.logprobs or []) + _logprob_items(lp)
        if choice.get("token_ids") is not None:
            self.token_ids = (self.token_ids or []) + list(choice["token_ids"])
        if choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = choice["prompt_token_ids"]

    def view(self, chat: bool) -> dict[str, Any]:
        calls = [
            {"type": c["type"], "name": c["name"], "arguments": _args({"function": c})}
            for _, c in sorted(self.calls.items())
        ]
        out = {
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": self.logprobs,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
        }
        if chat:
            out.update(content=self.content, reasoning=self.reasoning, tool_calls=calls)
        else:
            out["text"] = self.content
        return out


def _logprob_items(lp: dict[str, Any]) -> list[Any]:
    """A chunk's logprobs as a list of per-token entries (chat: `content`; completions: the
    parallel lists zipped), so chunks of any size join the same."""
    if "content" in lp:
        return list(lp.get("content") or [])
    tokens = lp.get("tokens") or []
    keys = ("tokens", "token_logprobs", "top_logprobs")
    return [{k: (lp.get(k) or [None] * len(tokens))[i] for k in keys} for i in range(len(tokens))]


def _whole_logprobs(view: dict[str, Any]) -> None:
    """A whole answer's logprobs in the same per-token form as a joined stream's."""
    for choice in view["choices"]:
        if isinstance(choice.get("logprobs"), dict):
            choice["logprobs"] = _logprob_items(choice["logprobs"])


def _stream_view(events: list[dict[str, Any]], done: int) -> dict[str, Any]:
    chat = any(e.get("object") == "chat.completion.chunk" for e in events)
    joined: dict[int, _Joined] = {}
    usage = None
    errors = []
    for ev in events:
        if "error" in ev or "unparsable" in ev:
            errors.append(ev.get("error", {}).get("code") if isinstance(ev.get("error"), dict) else "unparsable")
            continue
        for choice in ev.get("choices") or []:
            joined.setdefault(choice.get("index", 0), _Joined()).take(choice, chat)
        if not ev.get("choices") and ev.get("usage") is not None:
            usage = _usage(ev["usage"])
    ids = {e.get("id") for e in events if "id" in e}
    return {
        "object": "chat.completion.chunk" if chat else "text_completion",
        "choices": [j.view(chat) for _, j in sorted(joined.items())],
        "usage": usage,
        "usage_on_choice_chunks": any(e.get("usage") is not None and e.get("choices") for e in events),
        "errors": errors,
        "done": done,
        "one_id": len(ids) <= 1,
        "internal": sorted({k for e in events for k in INTERNAL if e.get(k) is not None}),
    }


def view(answer: Answer) -> dict[str, Any]:
    """The answer as a client reads it (what `differences` compares)."""
    if answer.status != 200:
        return {"status": answer.status}
    if answer.events is not None:
        return {"status": 200, "stream": _stream_view(answer.events, answer.done)}
    if not isinstance(answer.doc, dict):
        return {"status": 200, "unparsable": answer.text[:200]}
    v = _whole_view(answer.doc)
    _whole_logprobs(v)
    return {"status": 200, "whole": v}


def refusal_status(answer: Answer) -> int | None:
    """The status of a refusal: a 4xx answer, or a 200 stream that is nothing but one error
    event with a 4xx code and `[DONE]` (how plain vLLM refuses a streamed prompt its engine's
    input processing rejects: the error is raised inside its stream generator, after the
    headers). On P/D the prompt is prefilled before the first byte, so the same refusal comes
    as the status itself (docs/conformance.md, the documented deviations). None otherwise."""
    if 400 <= answer.status < 500:
        return answer.status
    if answer.status != 200 or answer.events is None or len(answer.events) != 1 or answer.done != 1:
        return None
    error = answer.events[0].get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 500 else None


def differences(oracle: Answer, ours: Answer) -> list[str]:
    """Every place our answer differs from the oracle's, as `path: oracle != ours` lines (only
    the status when that differs: the rest then says nothing more)."""
    refused = refusal_status(oracle)
    if refused is not None and refused == refusal_status(ours):
        return []  # one refusal, as a status or as a stream of its one error event
    a, b = view(oracle), view(ours)
    if a["status"] != b["status"]:
        if b["status"] == 599:  # no answer: what the transport said
            return [f"status: {a['status']} != 599 ({ours.text[:300]})"]
        return [f"status: {a['status']} != {b['status']}"]
    for body in (a.get("whole"), a.get("stream")):
        if body is not None:
            body["internal"] = []  # the oracle's own transfer fields, null or not: not ours to judge
    out: list[str] = []
    _diff("", a, b, out)
    return out


def _diff(path: str, a: Any, b: Any, out: list[str]) -> None:
    if len(out) >= 20:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in VOLATILE:
                continue
            _diff(f"{path}.{k}" if path else k, a.get(k), b.get(k), out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items != {len(b)} items ({_short(a)} != {_short(b)})")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(f"{path}[{i}]", x, y, out)
    elif _numbers(a, b):
        if not math.isclose(float(a), float(b), abs_tol=LOGPROB_TOLERANCE, rel_tol=0):
            out.append(f"{path}: {a!r} != {b!r}")
    elif a != b:
        out.append(f"{path}: {_short(a)} != {_short(b)}")


def _numbers(a: Any, b: Any) -> bool:
    kinds = (int, float)
    return isinstance(a, kinds) and isinstance(b, kinds) and not isinstance(a, bool) and not isinstance(b, bool)


def _short(v: Any, n: int = 120) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
