"""serving/ingress/routing.py: the routing rules and the metering, with the cluster and the provider faked.

Each request goes through the front door's pipeline (serving/ingress/pipeline.py: auth,
fields, model, limits, then the router) with the relay replaced by the test's `call(body)`,
which gets the engine request as a dict. The real thing (Ray Serve LLM engines, a vLLM server
as the provider) runs in test_routing_e2e.py; here each rule is driven directly and quickly.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from serving.core.cluster_watch import ClusterState, ClusterWatch
from serving.core.failures import REFUSALS, Reason, Unservable, as_unservable
from serving.ingress import routing as hybrid
from serving.ingress.auth import ApiKeyAuth
from serving.ingress.catalog import ModelNotFound, ModelRoute
from serving.ingress.errors import SERVED_BY
from serving.ingress.fallback import FallbackClient, FallbackConfig
from serving.ingress.limits import Decision, Limiter, LimitsConfig
from serving.ingress.pipeline import FrontDoor
from serving.spec import base_model_id


class _Meter:
    """Records what UsageMeter would count."""

    def __init__(self):
        self.calls, self.fallbacks, self.limited, self.costs, self.overflows = [], [], [], [], []

    def served(self, kid, model, destination, prompt, completion, cached=0, cost=None):
        self.calls.append((kid, model, destination, prompt, completion))
        self.costs.append((cached, cost))

    def over_budget(self, kid, model, to):
        self.overflows.append((kid, model, to))

    def fallback(self, reason, outcome):
        self.fallbacks.append((reason, outcome))

    def rate_limited(self, kid, model, limit):
        self.limited.append((kid, model, limit))

    def limiter_error(self):
        pass


class _Request:
    """A client's request: its key, and the body the door reads."""

    def __init__(self, key="sk-client", body=None):
        self.headers = {"authorization": f"Bearer {key}"}
        self.body = body

    def starlette(self) -> Request:
        raw = json.dumps(self.body).encode()
        sent = False

        async def receive():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


class _Watch(ClusterWatch):
    """The real watch with Serve's answer given (always fresh) instead of polled."""

    def __init__(self, running):
        super().__init__("llm", "Ingress")
        self.state = ClusterState(running=running, updated=time.monotonic())
        self.running = self.state.running

    def fresh(self, max_age_s: float = 10.0) -> bool:
        return True


def _route(model: str | None) -> ModelRoute:
    model = model or "ours"
    return ModelRoute(model=model, base=base_model_id(model), handle=lambda: None, engine="Decode", context_len=None)


class _Models:
    """Every model (and adapter) is served, by the deployment `Decode`; `ours` is the only one."""

    catalog = None

    def only_model(self):
        return "ours"

    async def resolve(self, model):
        if model == "":
            raise ModelNotFound(model)
        return _route(model)


class _Relay:
    """The relay, replaced by the test's `call(engine body as a dict)`."""

    def __init__(self):
        self.call = None

    def continuable(self, endpoint, fields, context_len=None):
        return None

    async def answer(self, *, body, **_):
        return await self.call(body.model_dump(exclude_unset=True))


class _Door:
    """The front door under test, with the router's names the rules' tests read."""

    def __init__(self, router: hybrid.Router, meter: _Meter):
        self.router, self.meter = router, meter
        self.limiter = Limiter(LimitsConfig.from_user_config(None), lambda: None, meter)
        self.relay = _Relay()
        self.front = FrontDoor(
            auth=ApiKeyAuth("api-key", ("sk-client", "sk-other")),
            models=_Models(),
            limiter=self.limiter,
            router=router,
            relay=self.relay,
        )

    @property
    def inflight(self):
        return self.router.inflight

    @property
    def watch(self):
        return self.router.watch

    @watch.setter
    def watch(self, w):
        self.router.watch = w

    @property
    def fallback(self):
        return self.router.fallback

    @property
    def cold_start_retry_after_s(self):
        return self.router.cold_start_retry_after_s

    @cold_start_retry_after_s.setter
    def cold_start_retry_after_s(self, s):
        self.router.cold_start_retry_after_s = s

    async def reconfigure(self, user_config):
        self.router.reconfigure(user_config.get("fallback"))

    def pre_route(self, model):
        return self.router.pre_route(_route(model))

    def may_use(self, request, model):
        kid = self.front.auth.key_id(request)
        return self.limiter.config.may_use(kid, model)

    @property
    def auth_enabled(self):
        return self.front.auth.enabled

    @auth_enabled.setter
    def auth_enabled(self, on):
        self.front.auth.enabled = on

    def wake_with(self, fn):
        self.router._wake = lambda route: fn(route.model)

    async def handle(self, request, body, endpoint, call_cluster):
        self.relay.call = call_cluster
        return await self.front.generate(_Request(request.headers["authorization"][7:], body).starlette(), endpoint)


PROVIDER_ANSWER = {
    "id": "p",
    "object": "text_completion",
    "model": "their/model",
    "choices": [{"index": 0, "text": "from the provider"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
}


def _routing(
    monkeypatch,
    *,
    fallback=True,
    when=("unavailable", "overloaded", "deadline"),
    provider=None,
    watch=None,
    overflow_at=2,
):
    monkeypatch.setenv("PD_FALLBACK_API_KEY", "sk-provider")
    meter = _Meter()
    router = hybrid.Router(app_name="llm", own_deployment="Ingress", meter=meter)
    r = _Door(router, meter)
    calls = []
    if fallback:
        cfg = FallbackConfig.from_user_config(
            {
                "base_url": "https://provider.example/v1",
                "models": {"ours": "their/model", "a": "their/a", "b": "their/b"},
                "when": list(when),
                "overflow_at": overflow_at,
                "first_token_timeout_s": 0.3,
                "timeout_s": 5,
                "connect_timeout_s": 1,
                "retries": 0,
            }
        )

        def handler(req):
            calls.append(req)
            return provider(req) if provider else httpx.Response(200, json=PROVIDER_ANSWER)

        router.fallback = FallbackClient(cfg, transport=httpx.MockTransport(handler))
        router.watch = watch
    return r, meter, calls


def _run(r, body, call_cluster, endpoint="completions", key="sk-client"):
    async def go():
        resp = await r.handle(_Request(key), body, endpoint, call_cluster)
        chunks = []
        if isinstance(resp, StreamingResponse):
            async for c in resp.body_iterator:
                chunks.append(c)
        return resp, chunks

    return asyncio.run(go())


def _error(resp) -> dict:
    return json.loads(resp.body)["error"]


def _cluster_json(usage=(2, 5)):
    async def call(body):
        return JSONResponse(
            {
                "model": "ours",
                "choices": [{"text": "from the cluster"}],
                "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
            }
        )

    return call


def test_cluster_answer_is_marked_and_metered(monkeypatch):
    r, meter, calls = _routing(monkeypatch)
    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, _cluster_json())
    assert resp.headers[SERVED_BY] == "cluster" and calls == []
    from serving.spec import key_id

    assert meter.calls == [(key_id("sk-client"), "ours", "cluster", 2, 5)]
    assert r.inflight.count() == 0


def test_cluster_stream_hides_the_usage_event_it_asked_for_and_counts_it(monkeypatch):
    r, meter, _ = _routing(monkeypatch)
    seen = {}

    async def call(body):
        seen.update(body)

        async def gen():
            yield 'data: {"model":"ours","choices":[{"text":"a"}],"usage":null}\n\n'
            yield 'data: {"model":"ours","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\ndata: [DONE]\n\n'

        return StreamingResponse(gen(), media_type="text/event-stream")

    resp, chunks = _run(r, {"model": "ours", "prompt": "x", "stream": True}, call)
    # Usage asked for at the end and, from the engines only, in every chunk.
    assert seen["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert resp.headers[SERVED_BY] == "cluster"
    assert (
        len(chunks) == 2 and chunks[-1] == "data: [DONE]\n\n" and '"usage"' not in chunks[0].replace('"usage":null', "")
    )
    assert meter.calls[0][2:] == ("cluster", 4, 1)
    assert r.inflight.count() == 0


def test_a_cluster_stream_cut_before_its_usage_event_still_counts_the_tokens_generated(monkeypatch):
    """A client that disconnects early must not get its tokens free of limits and metering."""
    r, meter, _ = _routing(monkeypatch)
    settled = []
    r.limiter.settle = lambda kid, model, decision, used, spend=None: settled.append(used)

    async def call(body):
        async def gen():
            for i in range(1, 4):  # vLLM's continuous_usage_stats: cumulative usage per chunk
                yield (
                    f'data: {{"model":"ours","choices":[{{"text":"t{i}"}}],'
                    f'"usage":{{"prompt_tokens":4,"completion_tokens":{i}}}}}\n\n'
                )
            await asyncio.sleep(30)  # the client goes away here

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def go():
        resp = await r.handle(_Request(), {"model": "ours", "prompt": "x", "stream": True}, "completions", call)
        it = resp.body_iterator.__aiter__()
        got = [await it.__anext__() for _ in range(3)]
        await it.aclose()  # Starlette closes the body iterator when the client disconnects
        return got

    got = asyncio.run(go())
    assert all('"usage":null' in c for c in got)  # the client did not ask for per-chunk usage
    assert meter.calls[0][2:] == ("cluster", 4, 3) and settled == [7]


def test_back_pressure_goes_to_the_fallback_when_configured_for_overload(monkeypatch):
    from ray.serve.exceptions import BackPressureError

    r, meter, calls = _routing(monkeypatch)

    async def call(body):
        raise BackPressureError(num_queued_requests=3, max_queued_requests=2)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.status_code == 200 and resp.headers[SERVED_BY] == "fallback"
    assert json.loads(resp.body)["model"] == "ours"
    assert meter.fallbacks == [("overloaded", "ok")] and meter.calls[0][2:] == ("fallback", 3, 4)
    assert "authorization" in calls[0].headers and "sk-client" not in str(calls[0].headers)


def test_without_the_reason_in_when_the_cluster_error_stands(monkeypatch):
    from ray.serve.exceptions import BackPressureError

    r, _, calls = _routing(monkeypatch, when=("unavailable",))

    async def call(body):
        raise BackPressureError(num_queued_requests=3, max_queued_requests=2)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    # The cluster's refusal stands: Serve's back-pressure, answered as an overload.
    assert resp.status_code == 503 and _error(resp)["code"] == "overloaded" and "retry-after" in resp.headers
    assert calls == []


def test_no_fallback_configured_changes_nothing(monkeypatch):
    r, _, _ = _routing(monkeypatch, fallback=False)

    async def call(body):
        raise RuntimeError("boom")

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.status_code == 500 and _error(resp)["code"] == "internal_error"


def test_a_late_first_token_goes_to_the_fallback_and_the_cluster_request_is_cancelled(monkeypatch):
    r, meter, _ = _routing(
        monkeypatch,
        provider=lambda req: httpx.Response(
            200,
            content=b'data: {"model":"their/model","choices":[{"text":"p"}]}\n\ndata: [DONE]\n\n',
            headers={"content-type": "text/event-stream"},
        ),
    )
    cancelled = []

    async def call(body):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    resp, chunks = _run(r, {"model": "ours", "prompt": "x", "stream": True}, call)
    assert resp.headers[SERVED_BY] == "fallback" and cancelled == [True]
    assert json.loads(chunks[0][6:])["model"] == "ours"
    assert meter.fallbacks == [("deadline", "ok")]


def test_no_running_engine_skips_the_cluster_and_wakes_the_engines(monkeypatch):
    r, meter, _ = _routing(monkeypatch, watch=_Watch({"Decode": 0, "Prefill": 0, "Ingress": 1}))
    woken = []
    r.wake_with(woken.append)  # scaled to zero: only a request at the handle brings it back

    async def call(body):
        raise AssertionError("the cluster must not be called")

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.headers[SERVED_BY] == "fallback" and meter.fallbacks == [("unavailable", "ok")]
    assert woken == ["ours"]
    # Decode running: nothing is woken, the request stays on the cluster.
    r.watch = _Watch({"Decode": 1, "Prefill": 0, "Ingress": 1})
    woken.clear()
    assert r.pre_route("ours") is None and woken == []


def test_prefill_down_is_not_unavailable_decode_serves_it_and_no_provider_is_paid(monkeypatch):
    """Prefill with no replica: decode prefills locally (serving/engines/pd_server.py), so the
    request stays on the cluster and an in-flight one is not cancelled."""
    watch = _Watch({"Decode": 1, "Prefill": 0, "Ingress": 1})
    r, meter, calls = _routing(monkeypatch, watch=watch, when=("unavailable",))
    assert r.pre_route("ours") is None

    async def call(body):
        await asyncio.sleep(2 * hybrid.WATCH_TICK_S)  # long enough for the watch to look again
        return JSONResponse({"model": "ours", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.headers[SERVED_BY] == "cluster" and calls == [] and meter.fallbacks == []


def test_engines_that_go_away_while_a_request_waits_release_it_to_the_fallback(monkeypatch):
    watch = _Watch({"Decode": 1, "Prefill": 1, "Ingress": 1})
    r, meter, _ = _routing(monkeypatch, watch=watch, when=("unavailable",))

    async def call(body):
        watch.running["Decode"] = 0  # killed while this request is queued for it
        await asyncio.sleep(30)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.headers[SERVED_BY] == "fallback" and meter.fallbacks == [("unavailable", "ok")]


def test_overflow_at_the_threshold_per_decode_replica(monkeypatch):
    r, _, _ = _routing(monkeypatch, watch=_Watch({"Decode": 2, "Prefill": 1, "Ingress": 1}), overflow_at=2)
    for _ in range(3):
        r.inflight.open("ours")
    r.inflight.open("another")  # another model's requests share nothing of this one's capacity
    assert r.pre_route("ours") is None  # 3 < 2 x 2
    r.inflight.open("ours")
    reason, detail = r.pre_route("ours")
    assert reason == "overloaded" and "2 decode replica" in detail
    # Two ingress replicas share the decode replicas: each takes half.
    r.watch.running["Ingress"] = 2
    r2, _, _ = _routing(monkeypatch, watch=r.watch, overflow_at=2)
    r2.inflight.open("ours"), r2.inflight.open("ours")
    assert r2.pre_route("ours")[0] == "overloaded"


def test_rate_limited_key_gets_429_with_retry_after(monkeypatch):
    r, _, calls = _routing(monkeypatch)

    async def refuse(kid, model, body, context_len=None, *, budget=True):
        return Decision(False, 12, "rpm", "Rate limit reached: 1 requests per minute for this API key.")

    r.limiter.admit = refuse
    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, _cluster_json())
    assert resp.status_code == 429 and resp.headers["retry-after"] == "12"
    assert calls == []


def test_a_failing_fallback_returns_our_error_with_the_reason(monkeypatch):
    r, meter, _ = _routing(
        monkeypatch,
        watch=_Watch({"Decode": 0, "Ingress": 1}),
        provider=lambda req: httpx.Response(500, json={"error": {"message": "their secret"}}),
    )
    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, _cluster_json())
    body = json.loads(resp.body)
    assert resp.status_code == 503 and resp.headers[SERVED_BY] == "fallback"
    assert "unavailable" in body["error"]["message"] and "no running replica of Decode" in body["error"]["message"]
    assert "their secret" not in body["error"]["message"]
    assert meter.fallbacks == [("unavailable", "failed")]


@pytest.mark.parametrize(
    "exc,reason",
    [
        ("BackPressureError", "overloaded"),
        ("DeploymentUnavailableError", "unavailable"),
        ("ActorDiedError", "unavailable"),
        ("TimeoutError", "deadline"),
    ],
)
def test_the_fallback_rule_of_ray_failures(exc, reason):
    import ray.exceptions
    import ray.serve.exceptions

    cls = getattr(ray.serve.exceptions, exc, None) or getattr(ray.exceptions, exc, None) or TimeoutError
    e = cls.__new__(cls)
    assert as_unservable(e, 1).fallback_when == reason


def test_the_fallback_rule_of_http_statuses():
    class E(Exception):
        def __init__(self, s):
            self.status_code = s

    rules = [(f.fallback_when if f else None) for f in (as_unservable(E(s), 1) for s in (400, 404, 408, 500, 503))]
    assert rules == [None, None, "deadline", "unavailable", "overloaded"]
    # Every reason the cluster can refuse for has one answer: its status and its fallback rule.
    assert {r: (f.status, f.fallback) for r, f in REFUSALS.items()} == {
        Reason.OVERLOADED: (503, "overloaded"),
        Reason.DECODE_UNAVAILABLE: (503, "unavailable"),
        Reason.ENGINE_ERROR: (503, "unavailable"),
        Reason.DEADLINE: (504, "deadline"),
    }


def test_a_request_the_relay_finds_unservable_goes_to_the_fallback_metered_once(monkeypatch):
    """The relay raises why the cluster cannot serve (here: the first token was late); the
    router hands it to the fallback with the admission's key and usage, metered once, as
    the fallback's; a reason not in `when` is answered with its own status."""
    r, meter, calls = _routing(monkeypatch, when=("deadline",))

    async def late(body):
        raise Unservable(Reason.DEADLINE, 1, "first token late")

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, late)
    assert resp.headers[SERVED_BY] == "fallback" and len(calls) == 1
    assert meter.fallbacks == [("deadline", "ok")]
    assert [c[2] for c in meter.calls] == ["fallback"]
    assert r.inflight.count() == 0

    async def busy(body):
        raise Unservable(Reason.OVERLOADED, 3)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, busy)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3" and len(calls) == 1


# --- per-key model access and per-model limits -----------------------------------------
def _limited(r, cfg):
    """`r` with limits `cfg` (an ingress user_config's `limits`) on the real windows, in process."""
    from serving.ingress.limits import LimitsConfig
    from tests.serving.fakes import LocalLedger

    ledger = LocalLedger()
    r.limiter.config = LimitsConfig.from_user_config(cfg)
    r.limiter._factory = lambda: ledger
    return ledger


def _cluster_echo(seen):
    async def call(body):
        seen.append(body["model"])
        return JSONResponse(
            {"model": body["model"], "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
        )

    return call


def test_a_key_outside_its_models_gets_openais_404_before_any_limit_is_charged(monkeypatch):
    from serving.spec import key_id

    r, meter, calls = _routing(monkeypatch)
    ledger = _limited(r, {"requests_per_minute": 100, "keys": {key_id("sk-client"): {"models": ["a"]}}})
    seen = []
    for model in ("b", "b:tenant"):
        resp, _ = _run(r, {"model": model, "prompt": "x"}, _cluster_echo(seen))
        assert resp.status_code == 404
        assert json.loads(resp.body) == {
            "error": {
                "message": f"The model '{model}' does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
    assert ledger.calls == [] and seen == [] and calls == [] and meter.calls == []
    for model in ("a", "a:tenant"):
        resp, _ = _run(r, {"model": model, "prompt": "x"}, _cluster_echo(seen))
        assert resp.status_code == 200
    assert seen == ["a", "a:tenant"]
    # Usage names the model as asked (the adapter too); both requests and their 3 tokens each
    # were counted on a's window.
    kid = key_id("sk-client")
    assert [c[:3] for c in meter.calls] == [(kid, "a", "cluster"), (kid, "a:tenant", "cluster")]
    assert ledger.actor.totals(kid, "a") == (2, 6)
    # Another key lists no models: it may use every one.
    resp, _ = _run(r, {"model": "b", "prompt": "x"}, _cluster_echo(seen), key="sk-other")
    assert resp.status_code == 200


def test_may_use_is_per_key_and_every_model_with_auth_disabled(monkeypatch):
    from serving.spec import key_id

    r, _, _ = _routing(monkeypatch, fallback=False)
    _limited(r, {"keys": {key_id("sk-client"): {"models": ["a"]}}})
    assert r.may_use(_Request(), "a:tenant") and not r.may_use(_Request(), "b")
    assert r.may_use(_Request("sk-other"), "b")
    r.auth_enabled = False
    assert r.may_use(_Request(), "b")


def test_exhausting_a_keys_requests_on_one_model_leaves_the_other_admitted(monkeypatch):
    r, _, _ = _routing(monkeypatch, fallback=False)
    _limited(r, {"requests_per_minute": 1})
    seen = []
    statuses = [_run(r, {"model": m, "prompt": "x"}, _cluster_echo(seen))[0].status_code for m in ("a", "a", "b")]
    assert statuses == [200, 429, 200] and seen == ["a", "b"]


def test_tokenize_checks_access_then_counts_on_the_models_window(monkeypatch):
    from ray.llm._internal.serve.core.configs.openai_api_models import TokenizeResponse

    from serving.spec import key_id

    r, _, _ = _routing(monkeypatch, fallback=False)
    kid = key_id("sk-client")
    ledger = _limited(r, {"models": {"a": {"requests_per_minute": 1}}, "keys": {kid: {"models": ["a", "ours"]}}})
    asked = []

    class Handle:
        def __getattr__(self, name):
            class M:
                def remote(self, body, info):
                    asked.append(body.model)

                    async def gen():
                        yield TokenizeResponse(count=1, max_model_len=8, tokens=[1])

                    return gen()

            return M()

    r.front.models.resolve = _resolve_with(Handle())

    def go(model):
        body = {"prompt": "hi"} if model is None else {"model": model, "prompt": "hi"}
        return asyncio.run(r.front.counted(_Request("sk-client", body).starlette(), "tokenize"))

    denied = go("b:tenant")
    assert denied.status_code == 404 and json.loads(denied.body)["error"]["code"] == "model_not_found"
    assert ledger.calls == []
    assert go("a:tenant").status_code == 200
    assert go("a").status_code == 429  # a's one request a minute was the adapter's
    assert go(None).status_code == 200  # no model: the only one (`ours`), which it may use
    assert asked == ["a:tenant", "ours"]


def _resolve_with(handle):
    async def resolve(model):
        route = _route(model)
        return ModelRoute(route.model, route.base, lambda: handle, route.engine, None)

    return resolve


def test_a_request_the_fallback_would_take_is_refused_first_for_a_model_the_key_may_not_use(monkeypatch):
    from serving.spec import key_id

    r, _, calls = _routing(monkeypatch)
    _limited(r, {"keys": {key_id("sk-client"): {"models": ["a"]}}})

    async def late(body):
        raise Unservable(Reason.DEADLINE, 1, "late")

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, late)
    assert resp.status_code == 404 and calls == []


@pytest.mark.parametrize(("hooks", "served"), [(False, "cluster"), (True, "fallback")])
def test_the_test_hook_sends_a_request_to_the_fallback_only_where_it_is_on(monkeypatch, hooks, served):
    """The conformance harness compares the fallback path on every body, streamed or not: its
    header sends a request to the fallback only in a replica started with TEST_HOOKS_ENV."""
    from serving.ingress.routing import ROUTE_HEADER
    from serving.spec import TEST_HOOKS_ENV

    if hooks:
        monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    else:
        monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    r, _, calls = _routing(monkeypatch)
    r.relay.call = _cluster_json()
    request = _Request("sk-client", {"model": "ours", "prompt": "x"})
    request.headers[ROUTE_HEADER] = "fallback"
    resp = asyncio.run(r.front.generate(request.starlette(), "completions"))
    assert resp.status_code == 200 and resp.headers[SERVED_BY] == served
    assert len(calls) == (1 if hooks else 0)


def test_each_answer_is_priced_from_its_usage_and_its_cost_settles_the_keys_spend(monkeypatch):
    """The cluster's answers, whole and streamed, read their cached prompt tokens (vLLM's
    prompt_tokens_details) before the client's view drops the usage; each is priced at the
    model's rates and its cost goes with the tokens to the key's spend."""
    from serving.ingress.costs import Costs

    r, meter, _ = _routing(monkeypatch)
    price = {"prefill_usd_per_token": 1e-6, "decode_usd_per_token": 1e-5, "disaggregated": True}
    r.router.costs = Costs.from_user_config({"ours": price}, None, vllm="0.32.0")
    spent = []
    r.limiter.settle = lambda kid, model, decision, used, spend=None: spent.append(spend)
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}

    async def whole(body):
        return JSONResponse({"model": "ours", "choices": [], "usage": usage})

    async def streamed(body):
        async def gen():
            yield 'data: {"model":"ours","choices":[{"text":"a"}],"usage":null}\n\n'
            yield f"data: {json.dumps({'model': 'ours', 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    _run(r, {"model": "ours", "prompt": "x"}, whole)
    _, chunks = _run(r, {"model": "ours", "prompt": "x", "stream": True}, streamed)
    assert not any("prompt_tokens_details" in c for c in chunks)  # the usage event the client did not ask for
    # 10 prompt tokens, 4 of them cached: 6 computed at $1/M; 3 output tokens at $10/M.
    expected = (6e-6, 3e-5)
    assert [c for c, _ in meter.costs] == [4, 4]
    assert all(cost == pytest.approx(expected) for _, cost in meter.costs)
    assert [(s.requests, s.prompt, s.completion, s.cached) for s in spent] == [(1, 10, 3, 4)] * 2
    assert all(s.usd == pytest.approx(sum(expected)) for s in spent)


def test_a_fallback_answer_is_priced_with_the_providers_cached_prompt_tokens(monkeypatch):
    """The provider's usage is read as the cluster's is: its cached prompt tokens
    (prompt_tokens_details) are priced at its cached price (they were counted as full-price
    prompt tokens: the fallback's usage reader never carried them)."""
    from serving.ingress.costs import Costs

    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    answer = {**PROVIDER_ANSWER, "usage": usage}
    r, meter, _ = _routing(monkeypatch, when=("unavailable",), provider=lambda req: httpx.Response(200, json=answer))
    prices = {"prices": {"ours": {"prompt": 1e-6, "completion": 1e-5, "cached_prompt": 1e-7}}}
    r.router.costs = Costs.from_user_config(None, prices, vllm="0.32.0")
    r.router.pre_route = lambda model: ("unavailable", "no decode replica")
    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, _cluster_json())
    assert resp.headers[SERVED_BY] == "fallback"
    # 6 prompt tokens at $1/M, 4 cached at $0.1/M; 3 output tokens at $10/M.
    assert [c for c, _ in meter.costs] == [4]
    assert meter.costs[0][1] == pytest.approx((6e-6 + 4e-7, 3e-5))


def test_an_unpriced_model_is_metered_in_tokens_with_no_cost(monkeypatch):
    r, meter, _ = _routing(monkeypatch)
    spent = []
    r.limiter.settle = lambda kid, model, decision, used, spend=None: spent.append(spend)
    _run(r, {"model": "ours", "prompt": "x"}, _cluster_json())
    assert meter.costs == [(0, None)] and spent[0].usd == 0.0 and spent[0].prompt == 2
