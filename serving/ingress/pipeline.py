"""The front door's request pipeline: each request walks it once, in order.

What flows through here, for /v1/chat/completions and /v1/completions:
  auth    the `Authorization` header -> the key id, or 401 (serving/ingress/auth.py)
  body    the JSON body, read up to `max_body_bytes` (413 past it, before it is read whole),
          nested at most MAX_JSON_DEPTH deep (400 past it, as for any body that is no JSON)
  fields  every field one we serve, or 400 naming it (fields.py)
  model   the model or adapter it names -> its route (catalog.py), or 404 (unknown, or not
          the key's) before any limit is charged; 503 while its application is not deployed
  typed   the engine request, validated once: the client's fields, plus what the path needs
          (usage in every streamed chunk, token ids and stop strings for a stream that can be
          continued: migration.py), or 400 naming the field pydantic refused; then our bounds
          on its values as the engine reads them, or 400 naming the field (fields.py BOUNDS);
          then vLLM's own checks of the sampling it asks for, or vLLM's 400
  salt    the key's prefix-cache salt, narrowed by the client's `cache_salt` (tenancy.py), in
          the cluster's copy of the request; 400 for a client salt vLLM would refuse
  limits  the key's budget, then its requests and tokens per minute on that model, the tokens
          sized from the validated request -> a reservation, or 429; past its budget, the
          model or the fallback its budget names instead, when it names one
  route   the cluster or the external fallback, then the usage (routing.py), through the
  call    resilient relay to the model's engines (relay.py)
  meter   usage per key and destination; the reservation settled exactly once, whatever
          the answer (an engine 400, a 503, a cut stream, the fallback, a client gone before
          its stream began: `_SettledStream`)
The state a request carries is one `RequestContext`, built by the steps that know each part;
every error is shaped once, at the end (errors.py). /tokenize and /detokenize walk the same
steps up to limits (one request, no tokens), then one engine call.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.core.calls import cancel_call
from serving.core.failures import EngineRefused
from serving.ingress.auth import ApiKeyAuth
from serving.ingress.catalog import ModelNotFound, ModelRoute, Models, redact_storage
from serving.ingress.context import RequestContext
from serving.ingress.dispatch import dispatch_call
from serving.ingress.errors import (
    SERVED_BY,
    answer_for,
    error_response,
    model_not_found,
    request_refusal,
    validation_error,
)
from serving.ingress.fields import as_read, cache_salt_problem, out_of_bounds, refused_field
from serving.ingress.limits import (
    BUDGET,
    ISOLATE_KEYS,
    OVER_BUDGET_FALLBACK,
    REFUSE,
    UNCHECKED,
    Decision,
    Limiter,
    Reservation,
    engine_view,
)
from serving.ingress.migration import StreamRecord
from serving.ingress.relay import Relay
from serving.ingress.routing import Router
from serving.ingress.tenancy import CacheSalts

logger = logging.getLogger("ray.serve")

# A request body larger than this is refused with 413 before it is read whole (the default of
# serving.ingress.maxBodyMiB).
DEFAULT_MAX_BODY_BYTES = 4 << 20
# How deep a request body's objects and arrays may nest. vLLM refuses a structured-output
# schema nested deeper than 64 levels (+16 for a structural tag; vLLM 0.32 sampling_params.py
# MAX_STRUCTURED_OUTPUT_JSON_NESTING), which sits a few levels inside the body; far deeper,
# Python's recursion limit (1000 frames) breaks the JSON parser, the encoders and pickling.
MAX_JSON_DEPTH = 128


class BodyError(Exception):
    def __init__(self, response: Response):
        self.response = response


class FrontDoor:
    """The pipeline of one ingress replica (serving/ingress/server.py builds it)."""

    def __init__(
        self,
        *,
        auth: ApiKeyAuth,
        models: Models,
        limiter: Limiter,
        router: Router,
        relay: Relay,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        salts: CacheSalts | None = None,
    ):
        self.auth = auth
        self.models = models
        self.limiter = limiter
        self.router = router
        self.relay = relay
        self.max_body_bytes = max_body_bytes
        # The keys' prefix-cache salts (None: the client's own salt, if any, goes as it came).
        self.salts = salts

    # --- chat and completions ------------------------------------------------------------------
    async def generate(self, request: Any, endpoint: str) -> Response:
        started = time.monotonic()
        try:
            ctx, typed, record = await self._admit(request, endpoint, started)
        except BodyError as err:
            return _served_by(err.response)
        except Exception as exc:
            return _served_by(self._error(exc))
        resp: Response | None = None
        try:
            resp = await self.router.handle(ctx, lambda: self._call(ctx, typed, record))
        except Exception as exc:
            resp = self._error(exc)
        finally:
            # Every admitted request is settled once: by its answer's usage, by its stream's
            # end, or here with nothing generated (refused, failed, or the client went away).
            if not isinstance(resp, StreamingResponse):
                ctx.reservation.settle(0)
        if isinstance(resp, StreamingResponse):
            resp = _SettledStream(resp, ctx.reservation)
        return _served_by(resp)

    async def _admit(self, request: Any, endpoint: str, started: float) -> tuple[RequestContext, Any, Any]:
        kid = self._key(request)
        body = await self._body(request, endpoint)
        route = await self._route(kid, body)
        stream = bool(body.get("stream"))
        asked_usage = True
        if stream:  # usage is metered: every stream asks for it, the client's view aside
            opts = body.get("stream_options")
            asked_usage = bool(isinstance(opts, Mapping) and opts.get("include_usage"))
            body["stream_options"] = {**(opts if isinstance(opts, Mapping) else {}), "include_usage": True}
        salt = self._salt(kid, body)
        typed, record, decision = await self._typed_and_admitted(kid, endpoint, body, route, salt)
        overflow = None
        if not decision.ok and decision.limit == BUDGET:
            # Past its budget: refused, or served where the key's budget sends it.
            route, overflow = await self._over_budget(kid, route, decision)
            typed, record, decision = await self._typed_and_admitted(kid, endpoint, body, route, salt, budget=False)
        if not decision.ok:
            raise BodyError(self._refusal(decision))
        reservation = Reservation(self.limiter, kid, route.model, decision)
        # The fallback is sent the client's fields as the engine read them ("12" is 12).
        ctx = RequestContext(
            request, endpoint, kid, route, as_read(body, typed), asked_usage, reservation, started, overflow
        )
        return ctx, typed, record

    async def _typed_and_admitted(
        self, kid: str, endpoint: str, body: dict[str, Any], route: ModelRoute, salt: str | None, budget: bool = True
    ) -> tuple[Any, StreamRecord | None, Decision]:
        """The engine request for `route` (validated, within bounds), its stream record, and
        the limits' decision on it."""
        cluster = self._cluster_fields(body, route, salt)
        record = self.relay.continuable(endpoint, cluster, route.context_len) if body.get("stream") else None
        engine = {**cluster, **record.engine_fields()} if record is not None else cluster
        typed = _adapter(_request_type(endpoint)).validate_python(engine)
        _check_bounds(typed)
        _check_sampling(typed, route.context_len)
        view = engine_view(body, typed)
        return typed, record, await self.limiter.admit(kid, route.model, view, route.context_len, budget=budget)

    def _salt(self, kid: str, body: Mapping[str, Any]) -> str | None:
        """The request's `cache_salt` for the cluster: the key's (serving/ingress/tenancy.py),
        narrowed by the client's own; 400 for a client salt vLLM would refuse."""
        problem = cache_salt_problem(body)
        if problem is not None:
            raise BodyError(error_response(400, problem, param="cache_salt"))
        client = body.get("cache_salt")
        if self.salts is None:
            return client
        cfg = self.limiter.config
        return self.salts.salt(kid, cfg.cache_isolation == ISOLATE_KEYS, cfg.cache_groups, client)

    async def _over_budget(self, kid: str, route: ModelRoute, refused: Decision) -> tuple[ModelRoute, str | None]:
        """Where a request of key `kid` past its budget goes: the model its budget names (the
        route of it) or the fallback ("fallback"); the 429 when it is refused instead."""
        cap = self.limiter.config.budgets.get(kid)
        to = cap.when_exceeded if cap is not None else REFUSE
        fallback = self.router.fallback
        if to == OVER_BUDGET_FALLBACK and fallback is not None and fallback.external_model(route.model):
            self.limiter.overflowed(kid, route.model, to)
            return route, to
        if to not in (REFUSE, OVER_BUDGET_FALLBACK) and self.limiter.config.may_use(kid, to):
            try:
                cheaper = await self.models.resolve(to)
            except Exception as exc:  # not deployed (yet): refused, as without an overflow
                logger.warning("budget overflow to %s unavailable: %r", to, exc)
            else:
                self.limiter.overflowed(kid, route.model, cheaper.model)
                return cheaper, None
        self.limiter.refused(kid, route.model, refused)
        raise BodyError(self._refusal(refused))

    def _key(self, request: Any) -> str:
        kid = self.auth.key_id(request)
        if isinstance(kid, Response):
            raise BodyError(kid)
        return kid

    async def _body(self, request: Any, endpoint: str) -> dict[str, Any]:
        """The JSON object of the request, read up to the bound, its fields checked."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise BodyError(self._too_large())
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise BodyError(self._too_large())
        body = _json_object(bytes(raw))
        if isinstance(body, Response):
            raise BodyError(body)
        refused = refused_field(endpoint, body)
        if refused is not None:
            raise BodyError(error_response(400, refused[1], param=refused[0], code="unsupported_parameter"))
        return body

    def _too_large(self) -> Response:
        return error_response(
            413, f"The request body is larger than {self.max_body_bytes} bytes.", code="request_too_large"
        )

    async def _route(self, kid: str, body: Mapping[str, Any]) -> ModelRoute:
        """The route of the body's model, when the key may use it (404 otherwise, in the same
        words as for a model that does not exist, before any limit is charged)."""
        model = body.get("model")
        named = model if isinstance(model, str) else self.models.only_model()
        if named is not None and not self.limiter.config.may_use(kid, named):
            raise ModelNotFound(named)
        return await self.models.resolve(model if isinstance(model, str) else None)

    @staticmethod
    def _cluster_fields(body: Mapping[str, Any], route: ModelRoute, salt: str | None = None) -> dict[str, Any]:
        """The fields the cluster gets: the client's, naming the model the route resolved
        (the only one when the client named none), with the request's prefix-cache salt in
        place of the client's (`_salt`), and for a stream usage in every chunk
        (continuous_usage_stats: the tokens of a stream that ends early are known; the
        router's rewriter strips it again). A stream that can be continued also asks for its
        token ids and leaves the stop strings to the ingress (StreamRecord.engine_fields)."""
        fields = {**body, "model": route.model}
        fields.pop("cache_salt", None)
        if salt is not None:
            fields["cache_salt"] = salt
        if body.get("stream"):
            fields["stream_options"] = {**body["stream_options"], "continuous_usage_stats": True}
        return fields

    async def _call(self, ctx: RequestContext, typed: Any, record: StreamRecord | None) -> Response:
        return await self.relay.answer(
            endpoint=ctx.endpoint,
            body=typed,
            fields=ctx.body,
            handle=ctx.route.handle,
            raw_request=ctx.request,
            model_id=ctx.route.model,
            started=ctx.started,
            record=record,
        )

    # --- requests that generate nothing -------------------------------------------------------
    async def counted(self, request: Any, endpoint: str) -> Response:
        """/tokenize, /detokenize: auth, fields, model and the key's access and requests per
        minute (one request, no tokens); then one engine call with the allow-listed headers."""
        try:
            kid = self._key(request)
            body = await self._body(request, endpoint)
            route = await self._route(kid, body)
            typed = _adapter(_request_type(endpoint)).validate_python({**body, "model": route.model})
            _check_bounds(typed)
            # Nothing generated, nothing spent: a key past its budget may still tokenize.
            decision = await self.limiter.admit(kid, route.model, {}, budget=False)
            if not decision.ok:
                return self._refusal(decision)
            Reservation(self.limiter, kid, route.model, decision).settle(0)
            stream = dispatch_call(route.handle(), typed, endpoint, request)
            answer = await stream.__anext__()
            cancel_call(stream)
        except BodyError as err:
            return err.response
        except Exception as exc:
            return self._error(exc)
        head = answer[0] if isinstance(answer, list) and answer else answer
        error = getattr(head, "error", None)
        if error is not None:
            return error_response(error.code or 500, redact_storage(str(error.message)))
        return JSONResponse(content=head.model_dump())

    # --- errors ----------------------------------------------------------------------------------
    def _refusal(self, decision: Decision) -> Response:
        unchecked = decision.limit == UNCHECKED  # the ledger is down and the policy refuses
        code = "limits_unavailable" if unchecked else "budget_exceeded" if decision.limit == BUDGET else None
        return error_response(
            503 if unchecked else 429,
            decision.message,
            code=code or "rate_limit_exceeded",
            headers={"Retry-After": str(decision.retry_after_s), SERVED_BY: "cluster"},
        )

    def _error(self, exc: BaseException) -> Response:
        if isinstance(exc, ModelNotFound):
            return model_not_found(exc.model)
        if isinstance(exc, ValidationError):
            return validation_error(exc)
        if isinstance(exc, EngineRefused):
            return error_response(exc.status_code, redact_storage(exc.message))
        return answer_for(exc, self.router.retry_after_s)


def _served_by(resp: Response) -> Response:
    """Every chat/completion answer says where it came from; the ingress's own are the cluster's."""
    if SERVED_BY not in resp.headers:
        resp.headers[SERVED_BY] = "cluster"
    return resp


def _check_bounds(typed: Any) -> None:
    over = out_of_bounds(typed)
    if over is not None:
        raise BodyError(error_response(400, over[1], param=over[0], code="integer_above_max_value"))


EMPTY_PROMPT = "The decoder prompt cannot be empty"  # vLLM's words (v1 engine input processor)


def _check_sampling(typed: Any, context_len: int | None) -> None:
    """vLLM's own checks of the sampling a request asks for (SamplingParams' argument checks,
    run by the request's `to_sampling_params`: `min_tokens` over the cap, ...) before the
    request is routed, so that what plain vLLM refuses is refused on every path, the
    fallback's too (the provider gets OpenAI's fields only and would serve it: `make
    conformance` found it). The cap is the request's own, or the context: what depends on the
    prompt's length stays the engine's to refuse. What is no client's error (another vLLM's
    signature) leaves the request to the engine."""
    if getattr(typed, "truncate_prompt_tokens", None) == 0:
        # Truncated to no token, whatever the prompt (vLLM 0.32 renderers/params.py: a
        # max_length of 0), which vLLM's engine refuses; the fallback would serve it whole.
        raise BodyError(error_response(400, EMPTY_PROMPT, param="truncate_prompt_tokens"))
    cap = getattr(typed, "max_completion_tokens", None) or getattr(typed, "max_tokens", None)
    if context_len is not None and (cap is None or cap > context_len):
        cap = context_len
    if cap is None:
        return
    try:
        typed.to_sampling_params(cap, default_sampling_params={})
    except Exception as exc:
        refusal = request_refusal(exc)
        if refusal is None and isinstance(exc, ValueError):  # vLLM 0.29's checks raise ValueError
            refusal = error_response(400, str(exc))
        if refusal is None:
            logger.debug("sampling not checked at the ingress: %r", exc)
            return
        raise BodyError(refusal) from exc


NOT_JSON = "We could not parse the JSON body of your request. Send a JSON object with 'Content-Type: application/json'."
TOO_DEEP = f"The JSON body of your request nests objects and arrays more than {MAX_JSON_DEPTH} levels deep."


def _json_object(raw: bytes) -> dict[str, Any] | Response:
    """The body as a JSON object, or the 400 for a body that is none. Any body that does not
    parse is the client's error, whatever the parser raises: a syntax error, bytes that are
    no UTF-8, an integer of more than 4300 digits (Python's int_max_str_digits: ValueError),
    or nesting past the recursion limit (RecursionError; what plain vLLM answers 400 for too:
    FastAPI's "There was an error parsing the body")."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return error_response(400, TOO_DEEP, code="invalid_json")
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, too many digits
        return error_response(400, NOT_JSON, code="invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "The request body must be a JSON object.", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        return error_response(400, TOO_DEEP, code="invalid_json")
    return body


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether `doc`'s objects and arrays nest more than `limit` levels (`doc` itself is one),
    walked a level at a time: no recursion, whatever the depth."""
    level = [doc]
    for _ in range(limit):
        children: list[Any] = []
        for node in level:
            children.extend(node.values() if isinstance(node, dict) else node)
        level = [c for c in children if isinstance(c, dict | list)]
        if not level:
            return False
    return True


class _SettledStream(StreamingResponse):
    """A streamed answer whose reservation is settled when its ASGI call ends, however it ends.
    The stream settles it with the usage it saw when it ends or is closed; a stream suspended
    at the client's departure is closed here, so that it does; one that never began (the
    client went away before the first chunk was asked for, as Starlette's StreamingResponse
    allows: it cancels the sending task at a disconnect) is settled with nothing generated
    since nothing was sent."""

    def __init__(self, inner: StreamingResponse, reservation: Reservation):
        super().__init__(
            inner.body_iterator, inner.status_code, media_type=inner.media_type, background=inner.background
        )
        self.raw_headers = inner.raw_headers
        self.reservation = reservation
        # The relay's stream: what frees its engine call if its generator never runs.
        self.release = getattr(inner, "release", None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            try:
                if close is not None and not self.reservation.settled:
                    await close()
            except Exception as exc:
                logger.warning("closing a stream the client left failed: %r", exc)
            finally:
                if self.release is not None:
                    self.release()  # a generator that never ran: cancel its engine call
                self.reservation.settle(0)


@cache
def _request_type(endpoint: str) -> Any:
    """vLLM's request model for `endpoint`, as Ray's ingress declares it for `body` (read from
    its signature: the vLLM-specific endpoints parse exactly as Ray's would)."""
    import inspect

    from ray.serve.llm.ingress import OpenAiIngress

    return inspect.signature(getattr(OpenAiIngress, endpoint)).parameters["body"].annotation


@cache
def _adapter(model_cls: Any) -> TypeAdapter:
    return TypeAdapter(model_cls)
