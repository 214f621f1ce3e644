"""The external fallback: an OpenAI-compatible API that answers when the cluster cannot.

What flows through here: a client's chat or completion body (a dict, already authenticated
and admitted by the ingress) plus the reason the cluster is skipped -> `FallbackClient.forward`
sends it to `<baseUrl>/chat/completions` or `<baseUrl>/completions` with `model` replaced by
the external model name and NOTHING of the client's request but its body: the headers are
built from scratch (the fallback's own key, content type, a user agent), so neither the
client's API key nor any internal header can leave -> the answer comes back, streamed
event by event when the client streams, with `model` rewritten to our model id and usage
read off for metering -> the first event at once, the rest joined per the streaming batch
interval (`serving.core.calls.eager_batches`, as the engines batch their tokens) -> a
starlette Response marked `x-served-by: fallback`.

Failures never pass the provider's body through: they become `FallbackError` (our status,
our message, the reason the cluster was skipped), which the ingress turns into an
OpenAI-style error. The HTTP client is httpx: pooled keep-alive connections, connect and
read timeouts, and transport-level retries of failed connections (never of a request the
provider has started to answer, so nothing is generated twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.core.calls import eager_batches, in_background, sse_error
from serving.ingress.errors import SERVED_BY
from serving.ingress.fields import openai_fields
from serving.ingress.sse import SseRewriter, Usage, estimated_usage
from serving.spec import FALLBACK_API_KEY_ENV, FallbackWhen

logger = logging.getLogger("ray.serve")

USER_AGENT = "pd-inference-fallback/1"
ENDPOINTS = {"chat": "chat/completions", "completions": "completions"}
# Called once when a relayed answer has ended: (its usage, whether it completed).
OnDone = Callable[[Usage, bool], None]


@dataclass(frozen=True)
class FallbackConfig:
    """The `fallback` part of the ingress's user_config (rendered by ServingSpec)."""

    base_url: str
    models: Mapping[str, str]
    when: frozenset[str]
    overflow_at: int | None
    first_token_timeout_s: float
    timeout_s: float
    connect_timeout_s: float
    retries: int
    api_key_env: str = FALLBACK_API_KEY_ENV
    # Relayed events are joined into one chunk per interval after the first (as Ray Serve
    # LLM batches the cluster's tokens): fewer messages through Serve's proxy per stream.
    batch_interval_ms: float = 0.0

    @classmethod
    def from_user_config(cls, cfg: Mapping[str, Any] | None) -> FallbackConfig | None:
        if not cfg:
            return None
        return cls(
            base_url=str(cfg["base_url"]).rstrip("/"),
            models=dict(cfg["models"]),
            when=frozenset(cfg.get("when") or ()),
            overflow_at=cfg.get("overflow_at"),
            first_token_timeout_s=float(cfg["first_token_timeout_s"]),
            timeout_s=float(cfg["timeout_s"]),
            connect_timeout_s=float(cfg["connect_timeout_s"]),
            retries=int(cfg["retries"]),
            api_key_env=str(cfg.get("api_key_env") or FALLBACK_API_KEY_ENV),
            batch_interval_ms=float(cfg.get("batch_interval_ms") or 0),
        )

    def wants(self, reason: FallbackWhen | str) -> bool:
        return (reason.value if isinstance(reason, FallbackWhen) else reason) in self.when


class FallbackError(Exception):
    """The fallback could not answer either; our error, with why the cluster was skipped."""

    def __init__(self, status: int, message: str, *, code: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s


# --- the external call ------------------------------------------------------------------------
def _retry_after(resp: httpx.Response, default: int = 5) -> int:
    try:
        return max(1, min(60, int(float(resp.headers.get("retry-after", default)))))
    except ValueError:
        return default


def _upstream_message(resp_body: bytes) -> str:
    """The provider's error text, for our log only (never the client's answer)."""
    try:
        err = json.loads(resp_body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300] if msg else ""
    except (ValueError, AttributeError, RecursionError):
        return ""


def _names_include_usage(resp_body: bytes) -> bool:
    text = _upstream_message(resp_body) or resp_body[:2000].decode(errors="replace")
    return "stream_options" in text or "include_usage" in text


class FallbackClient:
    """One per ingress configuration: a pooled httpx client to the fallback's /v1 root.

    A reconfiguration retires the client (`retire`); it closes when its last answer ends,
    so a live stream is never cut by a configuration change."""

    def __init__(self, config: FallbackConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self._active = 0
        self._retired = False
        key = os.environ.get(config.api_key_env, "")
        if not key:
            logger.warning("fallback configured but %s is empty: the provider will likely refuse", config.api_key_env)
        headers = {"user-agent": USER_AGENT, "accept": "application/json, text/event-stream"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        self._client = httpx.AsyncClient(
            base_url=config.base_url + "/",
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32, keepalive_expiry=30),
            transport=transport or httpx.AsyncHTTPTransport(retries=config.retries),
            follow_redirects=False,
            # Proxy settings from the pod's environment would route the fallback key elsewhere.
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    @property
    def active(self) -> int:
        """Answers still being relayed through this client."""
        return self._active

    @property
    def closed(self) -> bool:
        return self._client.is_closed

    def retire(self) -> None:
        """No new requests; close once the answers in flight have ended."""
        self._retired = True
        if self._active == 0:
            self._close_soon()

    def _begin(self) -> None:
        self._active += 1

    def _end(self) -> None:
        self._active -= 1
        if self._retired and self._active == 0:
            self._close_soon()

    def _close_soon(self) -> None:
        in_background(self.aclose())

    def external_model(self, model: str) -> str | None:
        return self.config.models.get(model)

    async def forward(
        self,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        model: str,
        reason: str,
        client_asked_usage: bool,
        on_done: OnDone,
    ) -> Response:
        """Send `body` upstream; `on_done(usage: Usage, ok: bool)` runs when the answer ends.

        Only OpenAI's documented fields go (serving.ingress.fields.openai_fields). The whole
        answer, first event included, must end within `timeout_s` (keep-alive comments do not
        extend it; `first_token_timeout_s` is the cluster's bound, not the provider's). A stream
        always ends with [DONE]; one the provider cut before its finish_reason ends with an
        error event first.
        """
        external = self.external_model(model)
        if external is None:
            raise FallbackError(
                503,
                f"The cluster cannot serve this request ({reason}) and no fallback model is configured for '{model}'.",
                code="fallback_unavailable",
                retry_after_s=5,
            )
        payload = openai_fields(endpoint, body)
        payload["model"] = external
        stream = bool(payload.get("stream"))
        rid = uuid.uuid4().hex[:12]  # ties our log lines to the client's error
        deadline = time.monotonic() + self.config.timeout_s
        self._begin()
        handed_off = False
        try:
            resp = await self._send(endpoint, payload, reason, rid, added_usage=stream and not client_asked_usage)
            if not stream:
                return await self._whole(resp, model, reason, rid, deadline, on_done)
            out = await self._stream(resp, model, reason, rid, deadline, client_asked_usage, on_done)
            handed_off = True
            return out
        finally:
            if not handed_off:
                self._end()

    async def _send(
        self, endpoint: str, payload: dict[str, Any], reason: str, rid: str, *, added_usage: bool
    ) -> httpx.Response:
        """POST, retried once without stream_options when a provider refuses the usage
        option we added (some OpenAI-compatible APIs do not know it)."""
        for attempt in (0, 1):
            req = self._client.build_request("POST", ENDPOINTS[endpoint], json=payload)
            try:
                resp = await self._client.send(req, stream=True)
            except httpx.TimeoutException as exc:
                raise self._failed(reason, f"the fallback did not answer in time ({type(exc).__name__})", 504) from exc
            except httpx.HTTPError as exc:
                raise self._failed(reason, f"the fallback could not be reached ({type(exc).__name__})", 503) from exc
            if resp.status_code == 200:
                return resp
            raw = await resp.aread()
            await resp.aclose()
            if attempt == 0 and added_usage and resp.status_code == 400 and _names_include_usage(raw):
                logger.info("fallback [%s] refused stream_options; retrying without it", rid)
                payload = {k: v for k, v in payload.items() if k != "stream_options"}
                continue
            raise self._from_status(resp, raw, reason, rid)
        raise AssertionError("unreachable")

    async def _whole(
        self, resp: httpx.Response, model: str, reason: str, rid: str, deadline: float, on_done: OnDone
    ) -> Response:
        t0 = time.monotonic()
        try:
            raw = await asyncio.wait_for(resp.aread(), max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise self._failed(reason, "the fallback did not answer in time", 504) from exc
        except httpx.HTTPError as exc:
            raise self._failed(reason, f"the fallback's answer broke off ({type(exc).__name__})", 502) from exc
        finally:
            await resp.aclose()
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser
            raise self._failed(reason, "the fallback answered with something that is not JSON", 502) from exc
        if isinstance(doc, dict) and "model" in doc:
            doc["model"] = model
        usage = Usage()
        usage.take(doc.get("usage") if isinstance(doc, dict) else None)
        if not usage.seen and isinstance(doc, dict):  # a provider without usage: estimate it
            seen = SseRewriter(model=None, keep_usage_event=False)
            seen._look(doc)
            usage = estimated_usage(seen)
        on_done(usage, True)
        logger.info("fallback [%s] (%s) answered in %.2fs", rid, reason, time.monotonic() - t0)
        return JSONResponse(doc, headers={SERVED_BY: "fallback"})

    async def _stream(
        self,
        resp: httpx.Response,
        model: str,
        reason: str,
        rid: str,
        deadline: float,
        client_asked_usage: bool,
        on_done: OnDone,
    ) -> Response:
        rewriter = SseRewriter(model=model, keep_usage_event=client_asked_usage)
        lines = resp.aiter_text()
        # Read until the first event, so a provider that fails before it is still an HTTP
        # error; keep-alive comments are dropped by the rewriter and do not extend the wait.
        first: list[str] = []
        try:
            while not first and not rewriter.done:
                chunk = await asyncio.wait_for(lines.__anext__(), max(0.0, deadline - time.monotonic()))
                first = rewriter.feed(chunk)
        except StopAsyncIteration:
            first = rewriter.flush()
        except TimeoutError as exc:
            await resp.aclose()
            raise self._failed(reason, "the fallback sent no event in time", 504) from exc
        except httpx.HTTPError as exc:
            await resp.aclose()
            raise self._failed(reason, f"the fallback's stream broke off ({type(exc).__name__})", 502) from exc
        if not first:
            await resp.aclose()
            raise self._failed(reason, "the fallback's stream ended without an event", 502)

        async def events() -> AsyncIterator[str]:
            ok = True
            problem = None
            try:
                for e in first:
                    yield e
                while True:
                    try:
                        # A timer on this task per chunk (asyncio.wait_for would run each read
                        # as a new task in Python 3.11; serving/ingress/relay.py `_next`).
                        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                            chunk = await lines.__anext__()
                    except StopAsyncIteration:
                        break
                    for e in rewriter.feed(chunk):
                        yield e
                for e in rewriter.flush():
                    yield e
                if not rewriter.done and not rewriter.finished:
                    problem = "The fallback's stream ended before the answer was complete."
            except TimeoutError:
                problem = "The fallback did not finish the answer in time."
            except httpx.HTTPError as exc:
                logger.warning("fallback [%s] stream broke off after the first event: %s", rid, exc)
                problem = "The fallback's stream broke off."
            finally:
                if problem is not None:
                    ok = False
                    logger.warning("fallback [%s] (%s): %s", rid, reason, problem)
                await resp.aclose()
                on_done(rewriter.usage if rewriter.usage.seen else estimated_usage(rewriter), ok)
                self._end()
            if problem is not None:
                yield sse_error(problem, "fallback_failed", done=False)
            if not rewriter.done:
                yield "data: [DONE]\n\n"

        async def batched() -> AsyncIterator[str]:
            # An interval of 0 gives every event its own chunk (Ray's Batcher, interval 0).
            async for batch in eager_batches(events(), self.config.batch_interval_ms):
                yield "".join(batch)

        return StreamingResponse(batched(), media_type="text/event-stream", headers={SERVED_BY: "fallback"})

    def _failed(self, reason: str, what: str, status: int) -> FallbackError:
        logger.warning("fallback failed (%s): %s", reason, what)
        status = 504 if reason == FallbackWhen.DEADLINE.value and status == 503 else status
        return FallbackError(
            status,
            f"The cluster cannot serve this request ({reason}) and {what}.",
            code="fallback_failed",
            retry_after_s=5,
        )

    def _from_status(self, resp: httpx.Response, raw: bytes, reason: str, rid: str) -> FallbackError:
        status = resp.status_code
        # The provider's words go to our log with the request id, never to the client: they
        # can name the provider, its account or its model.
        logger.warning("fallback [%s] answered HTTP %s (%s): %s", rid, status, reason, _upstream_message(raw))
        if status in (400, 404, 413, 422):
            return FallbackError(
                400,
                f"The cluster cannot serve this request ({reason}) and the fallback refused it "
                f"(HTTP {status}, reference {rid}).",
                code="fallback_rejected",
            )
        if status in (401, 403):
            # Our fallback key: the operator's problem, never the client's; say nothing about it.
            return self._failed(reason, "the fallback is misconfigured", 503)
        if status == 429:
            return FallbackError(
                503,
                f"The cluster cannot serve this request ({reason}) and the fallback is rate limited.",
                code="fallback_failed",
                retry_after_s=_retry_after(resp),
            )
        return self._failed(reason, f"the fallback failed (HTTP {status})", 502 if status < 500 else 503)
