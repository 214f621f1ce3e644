"""serving/engines/kv_router.py: KV-aware routing of the prefill tier, piece by piece.

The router (in a decode replica's process) takes the scorer's worker for a call and else makes
Serve's power-of-two choice; decode's side counts every outcome and never fails a request on
the scorer's account; the scorer scores only what it can and frees a booking before it books
the same request again. Against Ray 2.60 (ray/llm/_internal/serve/routing_policies/kv_aware/):
the router class is KV-aware to Ray's builder, which then turns the prefill engines' KV events
on. The whole path runs in tests/serving/ingress/test_kv_routing_e2e.py.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from serving import ray_internals as ri
from serving.core import metrics
from serving.engines import kv_router
from serving.engines.kv_router import KV_ROUTE_KWARG, KvPrefillRouter, KvRoutes, KvScorer


def _replica(uid: str):
    return types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=uid))


def _choose(candidates, **kwargs):
    router = object.__new__(KvPrefillRouter)  # choose_replicas reads no router state
    pending = types.SimpleNamespace(kwargs=kwargs)
    return asyncio.run(router.choose_replicas(candidates, pending))


# --- the router ----------------------------------------------------------------------------------
def test_the_call_goes_to_the_replica_the_scorer_chose():
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert _choose([a, b, c], **{KV_ROUTE_KWARG: ri.kv_worker_id("b")}) == [[b]]
    assert _choose([a, b, c], **{KV_ROUTE_KWARG: ri.kv_worker_id("c")}) == [[c]]


@pytest.mark.parametrize("kwargs", [{}, {KV_ROUTE_KWARG: None}, {KV_ROUTE_KWARG: 12345}])
def test_without_a_live_choice_two_candidates_are_probed(kwargs):
    """No choice, or a replica that is no longer a candidate (died, drained): Serve's power of
    two choices (one rank of two distinct replicas, the shorter queue wins)."""
    candidates = [_replica(u) for u in "abcd"]
    for _ in range(20):
        (rank,) = _choose(candidates, **kwargs)
        assert len(rank) == 2 and len({id(r) for r in rank}) == 2 and all(r in candidates for r in rank)
    one = _replica("x")
    assert _choose([one], **kwargs) == [[one]]
    assert _choose([], **kwargs) == []


def test_rays_builder_turns_the_prefill_engines_kv_events_on_for_this_router(monkeypatch):
    """Ray's build_llm_deployment sees a KVAwareRouter subclass: it enables the engine's KV
    events (ZMQ publisher and replay socket) and pins PYTHONHASHSEED so every replica hashes
    blocks alike (routing_policies/kv_aware/vllm/kv_events.py)."""
    import ray
    from ray.serve.llm import LLMConfig, build_llm_deployment

    monkeypatch.setenv("RAY_ENABLE_AUTO_CONNECT", "0")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={}))
    from serving.spec.base import KV_ROUTER_CLS

    config = LLMConfig(
        model_loading_config={"model_id": "m", "model_source": "/models/m"},
        deployment_config={"request_router_config": {"request_router_class": KV_ROUTER_CLS}},
        accelerator_type=None,
    )
    assert ri.is_kv_aware(config)
    app = build_llm_deployment(config, deployment_cls=kv_router.KvPrefillServer)
    built = app._bound_deployment.init_kwargs["llm_config"]
    events = built.engine_kwargs["kv_events_config"]
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"].startswith("tcp://*:") and events["replay_endpoint"].startswith("tcp://*:")
    assert built.runtime_env["env_vars"]["PYTHONHASHSEED"] == "0"


def test_the_prefill_server_takes_the_routing_keyword_and_runs_rays_method(monkeypatch):
    from ray.serve.llm.deployment import PDPrefillServer

    seen = []

    async def chat(self, request, raw_request_info=None):
        seen.append((request, raw_request_info))
        return "gen"

    monkeypatch.setattr(PDPrefillServer, "chat", chat)
    server = object.__new__(kv_router.KvPrefillServer)
    assert asyncio.run(server.chat("req", "raw", kv_route=7)) == "gen"
    assert seen == [("req", "raw")]


# --- decode's side -------------------------------------------------------------------------------
class _Counter:
    def __init__(self):
        self.seen: list = []

    def inc(self, value=1.0, tags=None):
        if value <= 0:  # as Ray's Counter (ray/util/metrics.py)
            raise ValueError(f"value must be >0, got {value}")
        self.seen.append((value, tags))


class _Call:
    def __init__(self, result):
        self._result = result
        self.cancelled = False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        if isinstance(self._result, Exception):
            raise self._result
        if self._result == "stall":
            await asyncio.sleep(10)
        return self._result

    def cancel(self):
        self.cancelled = True


class _Scorer:
    def __init__(self, result):
        self.calls: list[tuple] = []
        self.result = result
        self.last: _Call | None = None
        self.select = types.SimpleNamespace(remote=self._select)

    def _select(self, *args):
        self.calls.append(args)
        self.last = _Call(self.result)
        return self.last


def _routes(monkeypatch, result):
    counters = {metrics.KV_ROUTES: _Counter(), metrics.KV_ROUTE_TOKENS: _Counter()}
    monkeypatch.setattr(metrics, "counter", counters.__getitem__)
    monkeypatch.setattr(ri, "serve_request_id", lambda: "req-1")
    scorer = _Scorer(result)
    return KvRoutes(scorer, "tiny", timeout_s=0.05), scorer, counters


@pytest.mark.parametrize(
    ("result", "worker", "outcome"),
    [
        ({"worker_id": 42, "overlap_tokens": 256, "prompt_tokens": 300}, 42, "scored"),
        ({"worker_id": 42, "overlap_tokens": 0, "prompt_tokens": 300}, 42, "scored"),
        (None, None, "unscored"),
        (RuntimeError("scorer replica died"), None, "error"),
        ("stall", None, "timeout"),
    ],
)
def test_decode_asks_the_scorer_and_routes_by_load_on_anything_but_an_answer(monkeypatch, result, worker, outcome):
    routes, scorer, counters = _routes(monkeypatch, result)
    request = types.SimpleNamespace(messages=[{"role": "user", "content": "hi"}], prompt=None, max_tokens=8, n=1)
    assert asyncio.run(routes.choose(request)) == worker
    assert counters[metrics.KV_ROUTES].seen == [(1.0, {"model": "tiny", "outcome": outcome})]
    # A scored request's prompt tokens, and those the chosen replica held cached.
    tokens = [(300, {"model": "tiny", "kind": "prompt"}), (256, {"model": "tiny", "kind": "cached"})]
    if worker and not result["overlap_tokens"]:
        tokens = tokens[:1]  # nothing cached: no increment (Ray refuses an increment of 0)
    assert counters[metrics.KV_ROUTE_TOKENS].seen == (tokens if worker else [])
    ((request_id, fields),) = scorer.calls
    # The prompt fields only, none unset; the request id the prefill engine reports under.
    assert request_id == "req-1" and fields == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert scorer.last.cancelled == (outcome == "timeout")


# --- the scorer ----------------------------------------------------------------------------------
class _Tracker:
    def __init__(self, workers):
        self._replica_id_by_worker = dict.fromkeys(workers, "replica")
        self._requests: dict[str, int] = {}
        self._svc = object()
        self.log: list[tuple] = []

    async def select_worker(self, request_id, ids, workers, expected):
        self.log.append(("select", request_id, tuple(ids), tuple(workers), expected))
        self._requests[request_id] = workers[0]
        return {"worker_id": workers[0], "overlap_tokens": 128, "dp_rank": 0, "effective_prefill_tokens": 1}

    async def on_request_completed(self, request_id):
        self.log.append(("free", request_id))
        self._requests.pop(request_id, None)


class _Tokenizer:
    def __init__(self, ids):
        self.ids = ids

    async def tokenize(self, fields):
        if isinstance(self.ids, Exception):
            raise self.ids
        return self.ids


def _scorer(workers, ids) -> tuple[KvScorer, _Tracker]:
    scorer = object.__new__(KvScorer)
    tracker = _Tracker(workers)
    scorer._tracker, scorer._tokenizer = tracker, _Tokenizer(ids)
    scorer._model, scorer._bookings = "tiny", _Counter()
    return scorer, tracker


def test_the_scorer_books_the_chosen_worker_and_frees_a_request_scored_twice():
    scorer, tracker = _scorer([7, 9], [1, 2, 3])
    got = asyncio.run(scorer.select("r", {"messages": [], "max_completion_tokens": 5, "max_tokens": 99}))
    assert got == {"worker_id": 7, "overlap_tokens": 128, "prompt_tokens": 3}
    assert tracker.log == [("select", "r", (1, 2, 3), (7, 9), 5)]
    asyncio.run(scorer.select("r", {"messages": []}))
    assert tracker.log[1:] == [("free", "r"), ("select", "r", (1, 2, 3), (7, 9), None)]
    asyncio.run(scorer.release("r"))
    asyncio.run(scorer.release("r"))  # a second release (or one for a request never booked) is a no-op
    assert tracker.log[3:] == [("free", "r")]
    # Booked twice, freed twice: nothing outstanding (pd_kv_bookings).
    events = [tags["event"] for _, tags in scorer._bookings.seen]
    assert events == ["booked", "freed", "booked", "freed"]


def test_engine_lifecycle_reports_that_free_bookings_are_counted():
    scorer, tracker = _scorer([7], [1, 2])
    for rid in ("a", "b"):
        asyncio.run(scorer.select(rid, {"prompt": "x"}))

    async def on_lifecycle_events(batch):
        for hook, (rid,) in batch:
            if hook == "on_request_completed":
                tracker._requests.pop(rid, None)

    tracker.on_lifecycle_events = on_lifecycle_events
    asyncio.run(scorer.on_lifecycle_events([("on_prefill_complete", ("a",)), ("on_request_completed", ("a",))]))
    asyncio.run(scorer.on_lifecycle_events([("on_request_completed", ("zz",))]))  # not ours: nothing freed
    assert [(n, tags["event"]) for n, tags in scorer._bookings.seen] == [(1, "booked"), (1, "booked"), (1, "freed")]


@pytest.mark.parametrize(
    ("workers", "ids"),
    [([], [1, 2]), ([7], None), ([7], []), ([7], RuntimeError("template error quoting the prompt"))],
)
def test_nothing_to_score_by_books_nothing(workers, ids):
    scorer, tracker = _scorer(workers, ids)
    assert asyncio.run(scorer.select("r", {"prompt": "x"})) is None
    assert tracker.log == []


def test_the_scorer_is_unhealthy_without_dynamo():
    scorer, tracker = _scorer([7], [1])
    scorer.check_health()
    tracker._svc = None
    with pytest.raises(RuntimeError, match="ai-dynamo-runtime"):
        scorer.check_health()


def test_the_scorer_is_deployed_under_the_name_rays_engines_report_to():
    """Ray's KV-routed engines send their lifecycle reports to the deployment of this name in
    their own application (kv_token_tracker.py get_llm_router_handle)."""
    from serving.spec.base import KV_SCORER_DEPLOYMENT

    assert KV_SCORER_DEPLOYMENT == ri.LLM_ROUTER_DEPLOYMENT_NAME
