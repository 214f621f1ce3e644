"""serving/ingress/routing.py: the routing rules and the metering, with the cluster and the provider faked.

The real thing (Ray Serve LLM engines, a vLLM server as the provider) runs in
test_hybrid_e2e.py; here each rule is driven directly and quickly.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.responses import JSONResponse, StreamingResponse

from serving.core.cluster_watch import ClusterState, ClusterWatch
from serving.ingress import routing as hybrid
from serving.ingress.fallback import SERVED_BY, FallbackClient, FallbackConfig
from serving.ingress.limits import Decision


def _error(status, message, *, type=None, param=None, code=None, headers=None):
    """serving.app.error_response's shape, with what the caller chose and no defaults."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Meter:
    """Records what UsageMeter would count."""

    def __init__(self):
        self.calls, self.fallbacks, self.limited = [], [], []

    def served(self, *a):
        self.calls.append(a)

    def fallback(self, reason, outcome):
        self.fallbacks.append((reason, outcome))

    def rate_limited(self, kid, model, limit):
        self.limited.append((kid, model, limit))

    def limiter_error(self):
        pass


class _Request:
    def __init__(self, key="sk-client"):
        self.headers = {"authorization": f"Bearer {key}"}


class _Watch(ClusterWatch):
    """The real watch with Serve's answer given (always fresh) instead of polled."""

    def __init__(self, running):
        super().__init__("llm", "Ingress")
        self.state = ClusterState(running=running, updated=time.monotonic())
        self.running = self.state.running

    def fresh(self, max_age_s: float = 10.0) -> bool:
        return True


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
    r = hybrid.HybridRouting(
        auth_enabled=True,
        app_name="llm",
        own_deployment="Ingress",
        engine_deployment=lambda m: "Decode",
        default_model=lambda: "ours",
        error_response=_error,
    )
    meter = _Meter()
    r.meter = meter
    r.limiter._metrics = meter
    calls = []
    if fallback:
        cfg = FallbackConfig.from_user_config(
            {
                "base_url": "https://provider.example/v1",
                "models": {"ours": "their/model"},
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

        r.fallback = FallbackClient(cfg, transport=httpx.MockTransport(handler))
        r.watch = watch
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
    r.limiter.settle = lambda kid, model, decision, used: settled.append(used)

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

    with pytest.raises(BackPressureError):
        _run(r, {"model": "ours", "prompt": "x"}, call)
    assert calls == []


def test_no_fallback_configured_changes_nothing(monkeypatch):
    r, _, _ = _routing(monkeypatch, fallback=False)

    async def call(body):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _run(r, {"model": "ours", "prompt": "x"}, call)


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
    r._wake = woken.append  # scaled to zero: only a request at the handle brings it back

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
        r.inflight.open()
    assert r.pre_route("ours") is None  # 3 < 2 x 2
    r.inflight.open()
    reason, detail = r.pre_route("ours")
    assert reason == "overloaded" and "2 decode replica" in detail
    # Two ingress replicas share the decode replicas: each takes half.
    r.watch.running["Ingress"] = 2
    r2, _, _ = _routing(monkeypatch, watch=r.watch, overflow_at=2)
    r2.inflight.open(), r2.inflight.open()
    assert r2.pre_route("ours")[0] == "overloaded"


def test_rate_limited_key_gets_429_with_retry_after(monkeypatch):
    r, _, calls = _routing(monkeypatch)

    async def refuse(kid, model, body):
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
def test_reason_for_ray_failures(exc, reason):
    import ray.exceptions
    import ray.serve.exceptions

    cls = getattr(ray.serve.exceptions, exc, None) or getattr(ray.exceptions, exc, None) or TimeoutError
    e = cls.__new__(cls)
    assert hybrid.reason_for(e) == reason


def test_reason_for_http_statuses():
    class E(Exception):
        def __init__(self, s):
            self.status_code = s

    assert [hybrid.reason_for(E(s)) for s in (400, 404, 408, 500, 503)] == [
        None,
        None,
        "deadline",
        "unavailable",
        "overloaded",
    ]


def test_a_layer_below_can_hand_the_request_to_the_fallback(monkeypatch):
    """The resilience mixin's on_unservable hook calls `unservable` from inside the cluster call:
    the fallback's answer comes back through handle() metered once, as the fallback's."""
    r, meter, calls = _routing(monkeypatch, when=("deadline",))

    async def call(body):
        resp = await r.unservable("completions", body, _Request(), "deadline", "first token late")
        assert resp is not None
        return resp

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.headers[SERVED_BY] == "fallback" and len(calls) == 1
    assert meter.fallbacks == [("deadline", "ok")]
    assert [c[2] for c in meter.calls] == ["fallback"]
    assert r.inflight.count() == 0

    async def not_for_this_reason():
        return await r.unservable("completions", {"prompt": "x"}, _Request(), "overloaded", "queue full")

    assert asyncio.run(not_for_this_reason()) is None


# --- per-key model access and per-model limits (issue 26) -----------------------------------------
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


def test_admit_only_checks_access_then_counts_on_the_models_window(monkeypatch):
    from serving.spec import key_id

    r, _, _ = _routing(monkeypatch, fallback=False)
    kid = key_id("sk-client")
    ledger = _limited(r, {"models": {"a": {"requests_per_minute": 1}}, "keys": {kid: {"models": ["a", "ours"]}}})

    async def go(model):
        return await r.admit_only(_Request(), model)

    denied = asyncio.run(go("b:tenant"))
    assert denied.status_code == 404 and json.loads(denied.body)["error"]["code"] == "model_not_found"
    assert ledger.calls == []
    assert asyncio.run(go("a:tenant")) is None
    assert asyncio.run(go("a")).status_code == 429  # a's one request a minute was the adapter's
    assert asyncio.run(go(None)) is None  # no model: the only one (`ours`), which it may use


def test_a_request_the_fallback_would_take_outside_handle_is_refused_for_a_model_the_key_may_not_use(monkeypatch):
    from serving.spec import key_id

    r, _, calls = _routing(monkeypatch)
    _limited(r, {"keys": {key_id("sk-client"): {"models": ["a"]}}})

    async def go():
        return await r.unservable("completions", {"model": "ours", "prompt": "x"}, _Request(), "deadline", "late")

    resp = asyncio.run(go())
    assert resp.status_code == 404 and calls == []
