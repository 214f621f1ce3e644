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
import time
import types
from collections import OrderedDict

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


class _Engine:
    """Ray's engine stream as the KV-routed engine makes it: the id it reports the request's
    lifecycle under is Ray Serve LLM's get_serve_request_id() when its generate starts
    (routing_policies/kv_aware/vllm/token_tracking.py, Ray 2.60)."""

    def __init__(self, n: int = 2):
        self.n = n
        self.closed = False

    async def stream(self):
        from ray.llm._internal.serve.utils.server_utils import get_serve_request_id

        try:
            for _ in range(self.n):
                yield get_serve_request_id()
        finally:
            self.closed = True


def _in_request(request_id: str, internal_id: str):
    """Serve's request context of a request sent with `x-request-id: request_id` (Serve's
    request id) whose proxy gave it `internal_id` (ray/serve/context.py _RequestContext)."""
    from ray.serve import context

    return context._serve_request_context.set(
        context._RequestContext(request_id=request_id, _internal_request_id=internal_id)
    )


def test_the_prefill_server_takes_the_routing_keyword_and_its_engine_reports_under_the_booking_id(monkeypatch):
    from ray.serve import context
    from ray.serve.llm.deployment import PDPrefillServer

    seen = []
    engine = _Engine()

    async def chat(self, request, raw_request_info=None):
        seen.append((request, raw_request_info))
        return engine.stream()

    monkeypatch.setattr(PDPrefillServer, "chat", chat)
    server = object.__new__(kv_router.KvPrefillServer)

    async def go():
        token = _in_request("client-chosen", "serve-internal-1")
        try:
            return [x async for x in await server.chat("req", "raw", kv_route=7)], ri.serve_request_id()
        finally:
            context._serve_request_context.reset(token)

    reported, after = asyncio.run(go())
    assert seen == [("req", "raw")]
    assert reported == ["serve-internal-1"] * 2  # what decode booked under, never the client's id
    assert after == "client-chosen"  # the request's own id is left as it was
    assert engine.closed


def test_a_prefill_call_cancelled_mid_stream_closes_the_engines_stream():
    engine = _Engine(n=10)

    async def go():
        gen = kv_router.reporting_under("b", engine.stream())
        assert await gen.__anext__() == "b"
        await gen.aclose()  # Serve closes the user generator when the caller goes away

    asyncio.run(go())
    assert engine.closed  # vLLM aborts the request when its stream is closed


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
    counters = {metrics.KV_ROUTES: _Counter(), metrics.KV_ROUTE_TOKENS: _Counter(), metrics.KV_ROUTE_WAIT: _Counter()}
    monkeypatch.setattr(metrics, "counter", counters.__getitem__)
    monkeypatch.setattr(ri, "serve_internal_request_id", lambda: "req-1")
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
    # The prompt fields only, none unset; the booking id (the prefill engine reports under it).
    assert request_id == "req-1" and fields == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert scorer.last.cancelled == (outcome == "timeout")
    # How long it waited, whatever the outcome: the whole timeout for a stalled scorer.
    ((waited, tags),) = counters[metrics.KV_ROUTE_WAIT].seen
    assert tags == {"model": "tiny"} and (0.05 <= waited < 1.0 if outcome == "timeout" else 0 < waited < 0.05)


# --- the scorer ----------------------------------------------------------------------------------
class _Tracker:
    def __init__(self, workers):
        self._replica_id_by_worker = dict.fromkeys(workers, "replica")
        self._requests: dict[str, int] = {}
        self._completed_request_ids: OrderedDict[str, float] = OrderedDict()
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
    scorer._selecting = asyncio.Lock()
    scorer._releasing, scorer._index_warned = None, False
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


# --- the scorer down: decode's breaker ---------------------------------------------------------
def test_once_the_scorer_timed_out_requests_route_by_load_without_waiting_until_a_probe_answers(monkeypatch):
    """Before: with the scorer down every P/D request waited the whole timeout (0.25 s) before
    its prefill call. Now the first timeout opens the breaker: requests skip the scorer (not
    asked: no wait) for the cool-down, then one asks again; its answer closes the breaker."""
    routes, scorer, counters = _routes(monkeypatch, "stall")
    now = [100.0]
    routes = KvRoutes(scorer, "tiny", timeout_s=0.05, cooldown_s=5.0, clock=lambda: now[0])
    request = types.SimpleNamespace(prompt="hello", max_tokens=4)

    def outcomes():
        return [tags["outcome"] for _, tags in counters[metrics.KV_ROUTES].seen]

    assert asyncio.run(routes.choose(request)) is None and len(scorer.calls) == 1  # waited once
    for _ in range(5):
        assert asyncio.run(routes.choose(request)) is None
    assert len(scorer.calls) == 1  # not asked again: nobody waited
    assert outcomes() == ["timeout"] + ["skipped"] * 5
    now[0] += 5.0  # the cool-down is over: the next request probes
    scorer.result = {"worker_id": 42, "overlap_tokens": 0, "prompt_tokens": 5}

    async def probe_while_others_arrive():
        probe = asyncio.ensure_future(routes.choose(request))
        await asyncio.sleep(0)  # the probe is asking
        others = [await routes.choose(request) for _ in range(3)]
        return await probe, others

    probed, others = asyncio.run(probe_while_others_arrive())
    assert probed == 42 and others == [None] * 3 and len(scorer.calls) == 2  # one probe only
    assert asyncio.run(routes.choose(request)) == 42 and len(scorer.calls) == 3  # closed again
    assert outcomes()[6:] == ["skipped"] * 3 + ["scored", "scored"]


def test_a_failed_probe_keeps_the_scorer_skipped_for_another_cool_down(monkeypatch):
    routes, scorer, counters = _routes(monkeypatch, RuntimeError("scorer replica died"))
    now = [0.0]
    routes = KvRoutes(scorer, "tiny", timeout_s=0.05, cooldown_s=5.0, clock=lambda: now[0])
    request = types.SimpleNamespace(prompt="hello")
    asyncio.run(routes.choose(request))
    now[0] = 6.0
    asyncio.run(routes.choose(request))  # the probe fails
    now[0] = 10.0
    asyncio.run(routes.choose(request))  # within the new cool-down: skipped
    assert len(scorer.calls) == 2
    assert [tags["outcome"] for _, tags in counters[metrics.KV_ROUTES].seen] == ["error", "error", "skipped"]


# --- against Ray's own tracker -----------------------------------------------------------------
class _SelectionService:
    """Dynamo's SelectionService as Ray's tracker calls it (kv_token_tracker.py, Ray 2.60): the
    load it holds per booked request."""

    def __init__(self):
        self.reserved: dict[str, int] = {}

    async def select_and_reserve(self, req):
        worker = req["allowed_worker_ids"][0]
        self.reserved[req["selection_id"]] = worker
        n = len(req["token_ids"])
        return {
            "worker_id": worker,
            "dp_rank": 0,
            "overlap": {"longest_matched": 0},
            "effective_prefill_tokens": n,
            "sequence_hashes": [],
            "isl_tokens": n,
        }

    async def free_reservation(self, request_id):
        self.reserved.pop(request_id)

    async def prefill_complete(self, request_id):
        pass


def _rays_tracker(workers):
    """Ray 2.60's KVTokenTracker, its own code, without its Serve controller subscription."""
    from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import KVTokenTracker

    tracker = object.__new__(KVTokenTracker)
    tracker._block_size = 16
    tracker._svc = _SelectionService()
    tracker._replica_id_by_worker = dict.fromkeys(workers, "replica")
    tracker._requests = OrderedDict()
    tracker._request_ids_by_worker = {}
    tracker._completed_request_ids = OrderedDict()
    tracker._reservation_forwarder = None
    tracker._ingress_replica_rank = None
    return tracker


def _scorer_on(tracker) -> KvScorer:
    scorer = object.__new__(KvScorer)
    scorer._tracker, scorer._tokenizer = tracker, _Tokenizer([1, 2, 3])
    scorer._model, scorer._bookings = "tiny", _Counter()
    scorer._selecting = asyncio.Lock()
    scorer._releasing, scorer._index_warned = None, False
    return scorer


def test_completed_ids_of_requests_never_scored_are_swept():
    """Every KV-routed prefill engine reports its requests' completion, scored or routed by load;
    Ray's tracker remembers each id and sweeps them only inside select_worker, after an hour."""
    n = kv_router.KV_COMPLETED_IDS_KEPT + 500
    batch = [("on_request_completed", (f"unscored-{i}",)) for i in range(n)]
    rays_own = _rays_tracker([7])
    asyncio.run(rays_own.on_lifecycle_events(batch))
    assert len(rays_own._completed_request_ids) == n  # Ray's alone: grows with every request
    tracker = _rays_tracker([7])
    scorer = _scorer_on(tracker)
    asyncio.run(scorer.on_lifecycle_events(batch))
    kept = tracker._completed_request_ids
    assert len(kept) == kv_router.KV_COMPLETED_IDS_KEPT
    assert next(reversed(kept)) == f"unscored-{n - 1}"  # the newest are kept
    asyncio.run(scorer.release("never-booked"))
    assert len(kept) <= kv_router.KV_COMPLETED_IDS_KEPT


class _Handle:
    """The scorer deployment's handle, calling the scorer in this process."""

    def __init__(self, scorer: KvScorer):
        self.select = types.SimpleNamespace(remote=lambda *a: _Pending(scorer.select(*a)))
        self.release = types.SimpleNamespace(remote=lambda *a: asyncio.ensure_future(scorer.release(*a)))


class _Pending:
    def __init__(self, coro):
        self._task = asyncio.ensure_future(coro)

    def __await__(self):
        return self._task.__await__()

    def cancel(self):
        self._task.cancel()


def test_two_requests_sent_with_one_x_request_id_keep_separate_bookings(monkeypatch):
    """Serve's request id is the client's x-request-id when it sends one. Before, bookings were
    kept under it: the second request's scoring freed the first's booking, and either's
    completion freed the other's. Now each is booked, reported and freed under Serve's
    internal id (decode's KvRoutes, the prefill server's engine, Ray's own tracker)."""
    from ray.serve import context
    from ray.serve.llm.deployment import PDPrefillServer

    monkeypatch.setattr(metrics, "counter", lambda metric: _Counter())
    tracker = _rays_tracker([7])
    scorer = _scorer_on(tracker)
    routes = KvRoutes(_Handle(scorer), "tiny", timeout_s=5.0)

    async def engine_chat(self, request, raw_request_info=None):
        return _Engine(n=1).stream()

    monkeypatch.setattr(PDPrefillServer, "chat", engine_chat)
    prefill = object.__new__(kv_router.KvPrefillServer)
    request = types.SimpleNamespace(prompt="same prompt", max_tokens=4)

    async def score(internal_id):
        token = _in_request("same-client-id", internal_id)
        try:
            assert await routes.choose(request) == 7
            return [x async for x in await prefill.chat(request, None, kv_route=7)]  # what the engine reports under
        finally:
            context._serve_request_context.reset(token)

    async def go():
        first = await score("internal-a")
        second = await score("internal-b")
        assert (first, second) == (["internal-a"], ["internal-b"])  # each engine reports its own
        booked = dict(tracker._svc.reserved)
        await scorer.on_lifecycle_events([("on_request_completed", (first[0],))])
        return booked, dict(tracker._svc.reserved)

    booked, after_first_finished = asyncio.run(go())
    assert booked == {"internal-a": 7, "internal-b": 7}  # two bookings, neither freed by the other
    assert after_first_finished == {"internal-b": 7}  # the first's completion freed only its own


# --- tenants' prefix caches: the scorer scores with the request's cache_salt ------------------------
class _Recording(_SelectionService):
    """Ray's tracker's selection service, recording the requests it is asked to score."""

    def __init__(self):
        super().__init__()
        self.asked: list[dict] = []

    async def select_and_reserve(self, req):
        self.asked.append(req)
        return await super().select_and_reserve(req)


class _FieldsTokenizer:
    def __init__(self):
        self.fields: list[dict] = []

    async def tokenize(self, fields):
        self.fields.append(dict(fields))
        return [1, 2, 3]


def test_decode_sends_the_requests_cache_salt_to_the_scorer(monkeypatch):
    routes, scorer, _ = _routes(monkeypatch, {"worker_id": 4, "overlap_tokens": 0, "prompt_tokens": 3})
    request = types.SimpleNamespace(prompt="hi", max_tokens=8, cache_salt="salt-of-key-a")
    assert asyncio.run(routes.choose(request)) == 4
    ((_, fields),) = scorer.calls
    assert fields == {"prompt": "hi", "max_tokens": 8, "cache_salt": "salt-of-key-a"}


def test_the_scorer_hands_the_salt_to_dynamos_selection_not_to_the_prompts_renderer():
    tracker = _rays_tracker([7])
    svc = _Recording()
    tracker._svc = svc
    kv_router.salted(tracker)
    kv_router.salted(tracker)  # once: a second wrap would not add a second salt
    scorer = _scorer_on(tracker)
    scorer._tokenizer = _FieldsTokenizer()
    asyncio.run(scorer.select("r1", {"prompt": "x", "cache_salt": "salt-a"}))
    asyncio.run(scorer.select("r2", {"prompt": "x"}))
    assert [f.get("cache_salt") for f in scorer._tokenizer.fields] == [None, None]
    assert svc.asked[0]["cache_salt"] == "salt-a" and "cache_salt" not in svc.asked[1]
    assert [a["token_ids"] for a in svc.asked] == [[1, 2, 3]] * 2


BLOCK = 16


async def _dynamo(workers, endpoints, model="m"):
    from dynamo.llm import SelectionService

    svc = SelectionService(indexer_threads=1)
    for worker, endpoint in zip(workers, endpoints, strict=True):
        await svc.upsert_worker(
            {
                "worker_id": worker,
                "model_name": model,
                "tenant_id": "default",
                "endpoint": f"ray://w{worker}",
                "block_size": BLOCK,
                "max_num_batched_tokens": 4096,
                "data_parallel_start_rank": 0,
                "data_parallel_size": 1,
                "kv_events_endpoints": {0: endpoint},
            }
        )
    return svc


async def _overlap(svc, tokens, salt=None) -> dict[int, int]:
    req = {"model_name": "m", "tenant_id": "default", "token_ids": tokens, **({"cache_salt": salt} if salt else {})}
    return {w["worker_id"]: w["device_blocks"] for w in (await svc.overlap_scores(req))["workers"]}


def test_dynamos_selection_core_finds_a_keys_own_routed_blocks_and_never_another_keys(monkeypatch):
    """Contract, ai-dynamo-runtime 1.6.1's SelectionService (what Ray 2.60's tracker runs): with
    the predict-on-route index on (DYN_ROUTER_PREDICTED_TTL_SECS, read when the service is
    created), a prompt routed with one salt scores its blocks on that worker for the same salt,
    and none for another salt or for no salt."""
    from local.procs import free_port

    monkeypatch.setenv(kv_router.PREDICTED_TTL_ENV, str(kv_router.KV_PREDICTED_TTL_S))
    prompt = list(range(100, 100 + 4 * BLOCK))

    async def go():
        svc = await _dynamo([1, 2], [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)])
        try:
            select = {"model_name": "m", "tenant_id": "default", "allowed_worker_ids": [1, 2], "token_ids": prompt}
            first = await svc.select_and_reserve({**select, "selection_id": "a1", "cache_salt": "salt-a"})
            await svc.free_reservation("a1")
            worker = first["worker_id"]
            return worker, {
                "same key": await _overlap(svc, prompt, "salt-a"),
                "other key": await _overlap(svc, prompt, "salt-b"),
                "no salt": await _overlap(svc, prompt),
            }
        finally:
            svc.shutdown()

    worker, scores = asyncio.run(go())
    assert scores["same key"][worker] == 4
    assert scores["other key"] == {1: 0, 2: 0} and scores["no salt"] == {1: 0, 2: 0}


def test_vllms_kv_events_carry_a_blocks_salt_where_dynamo_does_not_hash_it():
    """Why the scorer needs the predict-on-route index: vLLM 0.32 publishes a salted block with
    its salt only in `extra_keys` (vllm/v1/core/kv_cache_utils.py to_event_extra_keys;
    vllm/distributed/kv_events.py BlockStored), and Dynamo 1.6.1 indexes that block as if
    unsalted: the salted lookup of the same prompt finds nothing, the unsalted one finds it all.
    A Dynamo that hashes the salt would fail this test: then the engines' events alone suffice."""
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from local.procs import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    prompt = list(range(300, 300 + 4 * BLOCK))
    stored = BlockStored(
        block_hashes=[11, 12, 13, 14],
        parent_block_hash=None,
        token_ids=prompt,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("salt-a",), None, None, None],  # what vLLM publishes for cache_salt="salt-a"
    )

    async def go():
        svc = await _dynamo([1], [endpoint])
        try:
            deadline = time.monotonic() + 20
            seq = 0
            while time.monotonic() < deadline:  # until the listener has connected and indexed it
                batch = KVEventBatch(ts=time.time(), events=[stored])
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
                seq += 1
                await asyncio.sleep(0.2)
                if (await _overlap(svc, prompt)).get(1):
                    break
            return await _overlap(svc, prompt), await _overlap(svc, prompt, "salt-a")
        finally:
            svc.shutdown()

    try:
        unsalted, salted = asyncio.run(go())
    finally:
        pub.close(0)
    assert unsalted == {1: 4} and salted == {1: 0}


def _dynamo_env(monkeypatch, env):
    """Dynamo's router settings in this process: exactly `env` of the scorer's (the service
    reads them when it is created)."""
    for name in kv_router.SCORER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


async def _select_indexed(svc, request):
    """Dynamo's selection of `request`, returned once its booked blocks show in the index, as
    the scorer lets the next selection run (Dynamo indexes them a moment after it answers)."""
    selection = kv_router._SaltedSelection(svc)
    got = await selection.select_and_reserve(request)
    assert await selection.indexed(selection.booked, within_s=2.0)
    return got


async def _burst(svc, shared, suffixes):
    """Select (and book) one request per suffix of `shared`, all in flight at once: the
    workers chosen."""
    base = {"model_name": "m", "tenant_id": "default", "allowed_worker_ids": [1, 2]}
    chosen = []
    for i, suffix in enumerate(suffixes):
        got = await _select_indexed(svc, {**base, "selection_id": f"r{shared[0]}-{i}", "token_ids": shared + suffix})
        chosen.append(got["worker_id"])
    return chosen


def _burst_on(monkeypatch, env, prompts):
    from local.procs import free_port

    _dynamo_env(monkeypatch, env)

    async def go():
        svc = await _dynamo([1, 2], [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)])
        try:
            return [await _burst(svc, shared, suffixes) for shared, suffixes in prompts]
        finally:
            svc.shutdown()

    return asyncio.run(go())


def _suffix(k: int) -> list[int]:
    return list(range(9000 + k * BLOCK, 9000 + (k + 1) * BLOCK))


def test_a_prefix_whose_first_request_is_still_in_flight_follows_it_and_new_prompts_still_spread(monkeypatch):
    """Contract, ai-dynamo-runtime 1.6.1's selection core with the scorer's settings
    (kv_router.SCORER_ENV): the requests of one 4-block prefix, sent together (each booked
    before the next is scored, as a burst of a shared system prompt is), go to one worker;
    prompts sharing nothing spread over both. With Dynamo's defaults (booked prompt work
    counted) the second request of the prefix goes to the idle worker and computes it again:
    what make bench-prefix measured."""
    prefix = list(range(500, 500 + 4 * BLOCK))
    unrelated = [(list(range(k * 1000, k * 1000 + 4 * BLOCK)), [_suffix(k)]) for k in (20, 21, 22, 23)]
    burst = [(prefix, [_suffix(k) for k in range(3)])]
    ours = _burst_on(monkeypatch, kv_router.SCORER_ENV, burst + unrelated)
    assert len(set(ours[0])) == 1  # the prefix computed once
    assert set(w for (w,) in ours[1:]) == {1, 2}  # load still spreads what shares nothing
    defaults = _burst_on(monkeypatch, {kv_router.PREDICTED_TTL_ENV: "120"}, burst)
    assert len(set(defaults[0])) == 2


class _PromptIds:
    """A renderer whose token ids are the request's `prompt` (a list of ids), after a pause:
    several requests are tokenized at once, as the scorer's are."""

    async def tokenize(self, fields):
        await asyncio.sleep(0.01)
        return list(fields["prompt"])


def test_a_burst_of_one_prefix_scored_at_once_goes_to_one_worker(monkeypatch):
    """Ray 2.60's tracker on ai-dynamo-runtime 1.6.1's selection core, through the scorer: three
    requests of one prefix scored together (a burst of a shared system prompt at concurrency
    3) are all sent to one worker, which computes the prefix once. Dynamo books a routed
    prompt's blocks as it selects; two selections run side by side do not see each other's."""
    from ray.llm._internal.serve.routing_policies.kv_aware import kv_token_tracker

    from local.procs import free_port

    _dynamo_env(monkeypatch, kv_router.SCORER_ENV)
    prefix = list(range(700, 700 + 4 * BLOCK))

    async def go():
        tracker = _rays_tracker([1, 2])
        endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        tracker._svc = await _dynamo([1, 2], endpoints, model=kv_token_tracker._MODEL_NAME)
        try:
            scorer = _scorer_on(kv_router.salted(tracker))
            scorer._tokenizer = _PromptIds()
            picks = await asyncio.gather(*(scorer.select(f"b{k}", {"prompt": prefix + _suffix(k)}) for k in range(3)))
            return [p["worker_id"] for p in picks]
        finally:
            tracker._svc.shutdown()

    assert len(set(asyncio.run(go()))) == 1


class _LaggingIndex(_SelectionService):
    """Dynamo's service whose index shows a booking's blocks only from the `lag`-th read after it
    answered the selection (1.6.1 enters them a moment later: about one selection in seven
    on two loaded cores)."""

    def __init__(self, lag: int):
        super().__init__()
        self.lag, self.reads, self.selected_at = lag, 0, []

    async def select_and_reserve(self, req):
        self.selected_at.append(self.reads)
        self.reads = 0
        return {**await super().select_and_reserve(req), "sequence_hashes": [11, 12]}

    async def overlap_scores(self, query):
        self.reads += 1
        return {"workers": [{"worker_id": 1, "device_blocks": 2 if self.reads >= self.lag else 0}]}


def test_a_prompt_shorter_than_a_block_holds_no_selection_back():
    """Nothing booked, nothing to read back: the index is not asked."""
    svc = _LaggingIndex(10**9)
    selection = kv_router._SaltedSelection(svc)
    booking = kv_router.Booking({"token_ids": [1, 2]}, worker_id=1, blocks=0)
    assert asyncio.run(selection.indexed(booking, within_s=5.0)) and svc.reads == 0


@pytest.mark.parametrize("lag", [3, 10**9])
def test_the_next_selection_waits_until_the_last_ones_blocks_are_indexed(lag):
    """Two requests scored at once: the first is answered at once, and the second is selected
    only once Dynamo's index shows the first one's booked blocks (else it would not see the
    prefix they share); an index that never shows them holds it back KV_INDEX_WAIT_S, no more."""
    tracker = _rays_tracker([1, 2])
    tracker._svc = _LaggingIndex(lag)
    scorer = _scorer_on(kv_router.salted(tracker))

    async def go():
        t0 = time.monotonic()
        first = asyncio.ensure_future(scorer.select("a", {"prompt": "x"}))
        await first
        answered_first = time.monotonic() - t0
        await scorer.select("b", {"prompt": "x"})
        await scorer._releasing
        return answered_first, time.monotonic() - t0

    answered_first, both = asyncio.run(go())
    svc = tracker._svc._svc
    if lag == 3:
        assert svc.selected_at == [0, 3]  # the second selected after the third read showed the blocks
    else:
        assert svc.selected_at[1] >= 2 and both >= kv_router.KV_INDEX_WAIT_S
    assert answered_first < kv_router.KV_INDEX_WAIT_S  # the first request's answer did not wait
    assert not scorer._selecting.locked()


def _cached_then_busy(monkeypatch, env, others: int = 1) -> int:
    """Dynamo's core: a 4-block prefix prefilled on worker 1 and finished there, then `others`
    unrelated 5-block requests in flight on worker 1, then a request of the prefix: the
    worker chosen."""
    from local.procs import free_port

    _dynamo_env(monkeypatch, env)
    prefix = list(range(800, 800 + 4 * BLOCK))
    base = {"model_name": "m", "tenant_id": "default"}

    async def go():
        svc = await _dynamo([1, 2], [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)])
        try:
            await _select_indexed(
                svc, {**base, "allowed_worker_ids": [1], "selection_id": "p", "token_ids": prefix + _suffix(0)}
            )
            await svc.free_reservation("p")
            for k in range(others):
                other = list(range(30000 + k * 5 * BLOCK, 30000 + (k + 1) * 5 * BLOCK))
                await _select_indexed(
                    svc, {**base, "allowed_worker_ids": [1], "selection_id": f"o{k}", "token_ids": other}
                )
            got = await svc.select_and_reserve(
                {**base, "allowed_worker_ids": [1, 2], "selection_id": "r", "token_ids": prefix + _suffix(1)}
            )
            return got["worker_id"]
        finally:
            svc.shutdown()

    return asyncio.run(go())


@pytest.mark.parametrize(("others", "worker"), [(1, 1), (3, 1), (4, 2)])
def test_a_prefix_cached_on_a_busier_worker_goes_there_until_its_load_outweighs_the_cache(monkeypatch, others, worker):
    """Contract, ai-dynamo-runtime 1.6.1's core with the scorer's settings: a 4-block prefix
    cached on worker 1 (its request finished) goes back there while worker 1 holds up to three
    other 5-block requests (15 blocks) and worker 2 none: each cached block is credited four
    times (DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=4, 16 blocks' worth); with four (20 blocks) the
    load wins and it goes to the idle worker 2, which computes it again."""
    assert {_cached_then_busy(monkeypatch, kv_router.SCORER_ENV, others) for _ in range(3)} == {worker}


def test_with_single_credit_one_other_request_sends_a_cached_prefix_away(monkeypatch):
    """The same core with Dynamo's single credit: one other request on worker 1 sends the
    prefix to worker 2 (with the bench's 128-token blocks the two tie and Dynamo picks at
    random: make bench-prefix's misses, docs/kv-aware-routing.md)."""
    env = {**kv_router.SCORER_ENV, "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "1.0"}
    assert {_cached_then_busy(monkeypatch, env, 1) for _ in range(3)} == {2}
