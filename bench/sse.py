"""One streamed OpenAI request, read event by event: the SSE client of the benches and e2e tests.

What flows through here: an httpx client, a URL (`/completions` or `/chat/completions`) and a
request body with `stream: true` -> the response's status and headers (`x-served-by`,
`Retry-After`) and its `data:` events as they arrive (OpenAI's streamed format, vLLM's and
the ingress's error events) -> a `Streamed`: when each content event came, whether the
stream ended with `[DONE]` or an error event, the usage event, and how the request ended
(`kind`). Used by bench/chaos.py, bench/hybrid.py and tests/serving/ingress/test_routing_e2e.py, so
a figure in a bench and an assertion in a test read the stream alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Streamed:
    """How one streamed request went. Times are time.monotonic() readings."""

    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0: no response (connection error, or no headers in time)
    served_by: str | None = None  # the ingress's x-served-by: cluster | fallback
    retry_after: str | None = None
    first_event_at: float | None = None  # the first `data:` line, whatever it holds
    token_times: list[float] = field(default_factory=list)  # each event that carried text
    # Each event that carried tokens: (when, how many: its `token_ids` when the server sent them,
    # as vLLM does for `return_token_ids`; else 1 for an event with text).
    chunk_tokens: list[tuple[float, int]] = field(default_factory=list)
    text: str = ""
    done: bool = False  # `data: [DONE]` arrived
    error_event: dict[str, Any] | None = None  # an in-stream error event (OpenAI's shape)
    usage: dict[str, Any] | None = None  # the usage event, when the client asked for it
    error: str | None = None  # the HTTP body of a non-200, or the transport error
    timed_out: bool = False  # no byte for the read timeout: the request hung

    @property
    def ok(self) -> bool:
        """200, ended with [DONE], no error event."""
        return self.status == 200 and self.done and self.error_event is None and self.error is None

    @property
    def kind(self) -> str:
        """ok | http_<status> | stream_error | hung | conn_error."""
        if self.timed_out:
            return "hung"
        if self.status in (0, 200) and self.error is not None:
            # Headers came and then nothing: hung; no answer, or cut mid-stream: connection.
            return "hung" if self.status == 200 and self.first_event_at is None else "conn_error"
        if self.status != 200:
            return f"http_{self.status}"
        return "ok" if self.ok else "stream_error"

    @property
    def ttft_s(self) -> float | None:
        """Request sent -> first event with text."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def ttfb_s(self) -> float | None:
        """Request sent -> first `data:` event."""
        return self.first_event_at - self.start if self.first_event_at is not None else None

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def event_tokens(event: Any) -> int:
    """How many tokens a streamed completion or chat event carries (module doc: `chunk_tokens`)."""
    if not isinstance(event, dict) or not event.get("choices"):
        return 0
    ids = event["choices"][0].get("token_ids")
    return len(ids) if isinstance(ids, list) else 1 if event_text(event) else 0


def event_text(event: Any) -> str:
    """The text a streamed completion or chat event carries ("" for usage and role events)."""
    if not isinstance(event, dict) or not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    timeout: httpx.Timeout | float | None = None,
) -> Streamed:
    """POST `body` to `url` and read the whole stream; never raises for HTTP or stream faults."""
    out = Streamed(start=time.monotonic())
    kwargs: dict[str, Any] = {"json": body, "headers": headers}
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        async with client.stream("POST", url, **kwargs) as resp:
            out.status = resp.status_code
            out.served_by = resp.headers.get("x-served-by")
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                out.error = (await resp.aread())[:500].decode(errors="replace")
            else:
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        _event(out, line[5:].strip())
    except httpx.ReadTimeout as exc:
        out.timed_out = True
        out.error = f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.end = time.monotonic()
    return out


def _event(out: Streamed, payload: str) -> None:
    now = time.monotonic()
    if out.first_event_at is None:
        out.first_event_at = now
    if payload == "[DONE]":
        out.done = True
        return
    try:
        event = json.loads(payload)
    except ValueError:
        out.error_event = {"error": {"message": f"not JSON: {payload[:200]}"}}
        return
    if isinstance(event, dict) and "error" in event:
        out.error_event = event
        return
    if isinstance(event, dict) and event.get("usage"):
        out.usage = event["usage"]
    if text := event_text(event):
        out.token_times.append(now)
        out.text += text
    if n := event_tokens(event):
        out.chunk_tokens.append((now, n))
