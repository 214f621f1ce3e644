"""KV-aware routing of the prefill tier: the prefill replica whose KV cache holds most of a prompt.

What flows through here: a P/D request on a decode replica, before its prefill call ->
`KvRoutes.choose` sends the request's prompt fields to the `KvScorer` deployment -> the scorer
tokenizes the prompt as the engine does (Ray's vLLM renderer) and asks Ray's `KVTokenTracker`
(Dynamo's selection core, fed by every prefill engine's vLLM KV-cache events over ZMQ) for the
worker with the best overlap and load, and books that load -> the worker id comes back and
rides on the prefill call as the `kv_route` keyword -> `KvPrefillRouter`, the prefill tier's
request router in the decode replica's process, sends the call to that replica -> the prefill
engine reports the request's lifecycle (prefill done, finished) to the scorer, which frees the
booked load. Whatever goes wrong on the way (no scorer answer in time, a prompt the renderer
cannot read, no worker registered yet, the chosen replica gone) leaves the call to the
router's power-of-two choice: routing degrades to load-based, never to an error; after a
failure or a timeout decode does not ask the scorer for `KV_SCORER_COOLDOWN_S`, then one
request asks again (`KvRoutes`' breaker), so a scorer that is down costs no request its wait.
Bookings are kept under Serve's internal request id (`booking_id`), which no client chooses,
and the prefill server has its engine report under that id too: two requests sent with one
`x-request-id` (Serve's request id) keep separate bookings.

Tenants' prefix caches (serving/ingress/tenancy.py): a request carries its key's `cache_salt`,
and the scorer hands it to Dynamo's selection core, which hashes the prompt's blocks with it
(ai-dynamo-runtime 1.6.1's select request takes `cache_salt`): another key's blocks are never
overlap. vLLM 0.32 publishes a block's salt only inside its KV events' `extra_keys`, which
Dynamo 1.6.1's event reader does not hash, so the events index a salted block as if unsalted
and a salted prompt finds none of them; what lets it find its own blocks is Dynamo's
predict-on-route index (`DYN_ROUTER_PREDICTED_TTL_SECS`, set for the scorer's process): the
salted blocks of every prompt routed to a worker, held for KV_PREDICTED_TTL_S. So a key's
repeated prefix goes back to the replica that computed it, as an unsalted one does, for that
long after its last request (tests/serving/engines/test_kv_router.py runs Dynamo's own core).

Why this module and not Ray's own wiring: Ray 2.60 scores KV overlap only for the deployment
behind its `LLMRouter` ingress (direct streaming), which in its P/D builder is decode, never
prefill; a `KVAwareRouter` set on our prefill tier would find no tracker in the decode process
and pick at random (docs/kv-aware-routing.md). The parts are Ray's: the router class (so Ray's
builder turns on the engines' KV events and lifecycle reports), the tracker, the tokenizer and
the lifecycle contract; the scorer is deployed under the name Ray's engines report to
(`LLMRouter`), one per application, so each P/D model has its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.llm.deployment import PDPrefillServer
from ray.serve.llm.request_router import KVAwareRouter

from serving import ray_internals as ri
from serving.core import metrics
from serving.core.calls import aclose_quietly
from serving.spec.base import KV_SCORER_DEPLOYMENT

logger = logging.getLogger("ray.serve")

# The keyword the chosen worker id rides on, from decode's prefill call to the prefill router.
KV_ROUTE_KWARG = "kv_route"
# After the scorer failed or did not answer in time, decode routes by load without asking it
# for this long; then one request asks again (a scorer replica restarts in seconds to minutes).
KV_SCORER_COOLDOWN_S = 5.0
# Completed request ids the scorer lets Ray's tracker remember (see KvScorer._sweep).
KV_COMPLETED_IDS_KEPT = 1024
# Dynamo's predict-on-route index (see the module doc): how long a prompt's blocks count as held by
# the worker it was routed to. Dynamo's own TTL for its approximate index (router_ttl_secs, 120 s).
KV_PREDICTED_TTL_S = 120
PREDICTED_TTL_ENV = "DYN_ROUTER_PREDICTED_TTL_SECS"
# How Dynamo's selection core (ai-dynamo-runtime 1.6.1) weighs a prefill worker: the prompt work
# booked on it and the prompt's uncached blocks, less a credit per cached block, plus the blocks
# its requests in flight hold (a shared prefix counted once). Its defaults book every in-flight
# prompt as prompt work, so a repeat of a prefix still prefilling on A goes to an idle B and
# the prefix is computed twice: the scorer turns that term off. Then a prefix cached on A but no
# longer in flight earns A nothing, and A with one other request in flight ties an idle B: so
# each cached block is credited four times (Dynamo documents credits above 1 as extra credit),
# and a prefix stays on its replica until that replica holds about four times the prefix's
# blocks more in flight (a cached block is a block's prefill saved, and a prefill worker's
# blocks in flight count its cached ones too; at 2 a repeat still left a replica two
# requests busier: make bench-prefix). DYN_ROUTER_PREFILL_LOAD_SCALE is not set: 1.6.1 reads
# it but its logits do not change with it. Measured, and how each was found:
# docs/kv-aware-routing.md#measured. Set in the scorer's process before the service reads them.
SCORER_ENV = {
    PREDICTED_TTL_ENV: str(KV_PREDICTED_TTL_S),
    "DYN_ROUTER_TRACK_PREFILL_TOKENS": "false",
    "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "4.0",
}
# Dynamo enters a routed prompt's predicted blocks into its index a moment after it answers
# the selection (about a millisecond on two loaded cores, 2026-12-07; not at once in about one
# selection of seven), so the next selection holds back until they show, for at most this long.
KV_INDEX_WAIT_S = 0.05
KV_INDEX_POLL_S = 0.001
# The request's prefix-cache salt, for the selection core while the scorer selects.
_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("kv_cache_salt", default=None)
# The request fields the engine's renderer reads to build the prompt (vLLM's ChatCompletionRequest
# and CompletionRequest): the scorer gets these, not the whole request.
PROMPT_FIELDS = (
    "messages",
    "prompt",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
    "max_tokens",
    "max_completion_tokens",
)


class KvPrefillRouter(KVAwareRouter):
    """The prefill tier's request router: the replica the scorer chose, else power of two.

    A subclass of Ray's `KVAwareRouter` so that Ray's builder configures the prefill engines
    for KV routing (KV events on, lifecycle reports to `LLMRouter`, `is_kv_aware`); it runs in
    each decode replica's process, where no tracker lives, so it only maps the scorer's worker
    id (the call's `kv_route` keyword) to a candidate replica. A call without one, or whose
    replica is no longer a candidate, gets two random candidates: Serve probes both and takes
    the shorter queue (the power-of-two choice; Ray's own mixin would hand a chosen replica to
    another request queued first, so it is not used)."""

    def initialize_state(self, **kwargs: Any) -> None:
        pass  # nothing to bind: the tracker lives in the scorer

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        if not candidate_replicas:
            return []
        worker = None if pending_request is None else pending_request.kwargs.get(KV_ROUTE_KWARG)
        if worker is not None:
            for replica in candidate_replicas:
                if ri.kv_worker_id(replica.replica_id.unique_id) == worker:
                    return [[replica]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


def booking_id() -> str:
    """The id this request's KV booking is kept under, on decode (booked and released) and on
    the prefill replica (its engine's lifecycle reports): Serve's internal request id, the same
    on every hop of one client request. Not Serve's request id: that is the client's
    `x-request-id` when it sends one (Ray 2.60 serve/_private/proxy.py), and two requests
    sent with one id would free each other's bookings."""
    return ri.serve_internal_request_id()


class KvPrefillServer(PDPrefillServer):
    """Ray's prefill server, taking (and dropping) the `kv_route` keyword its router read, its
    engine reporting the request's lifecycle under `booking_id()`."""

    async def chat(self, request: Any, raw_request_info: Any = None, kv_route: int | None = None) -> Any:
        return reporting_under(booking_id(), await super().chat(request, raw_request_info))

    async def completions(self, request: Any, raw_request_info: Any = None, kv_route: int | None = None) -> Any:
        return reporting_under(booking_id(), await super().completions(request, raw_request_info))


async def reporting_under(request_id: str, gen: Any) -> AsyncIterator[Any]:
    """`gen` (Ray's engine stream) read with Serve's request id set to `request_id` while each
    item is made: Ray's KV-routed engine takes the id it reports lifecycle events under when
    its generate starts (routing_policies/kv_aware/vllm/token_tracking.py,
    get_serve_request_id), and vLLM's own request id, stamped before, is left as it was.
    Closed with this stream, so a cancelled call still aborts the engine's request."""
    it = gen.__aiter__()
    try:
        while True:
            with ri.serve_request_id_as(request_id):
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    return
            yield item
    finally:
        await aclose_quietly(it)


class KvScorer:
    """The prefill tier's KV index and scorer (deployed as `LLMRouter`: see the module doc).

    `select` tokenizes the prompt fields with the prefill engines' own renderer and chat
    template and asks Ray's tracker for the best registered worker, booking its load; the
    engines' lifecycle reports (`on_lifecycle_events`) free it. Returns None when there is
    nothing to score by (no text prompt, no worker registered yet): the caller routes by load.
    """

    async def __init__(self, prefill_server: Any, llm_config: Any) -> None:  # type: ignore[misc]
        self._model = llm_config.model_id
        self._bookings = metrics.counter(metrics.KV_BOOKINGS)
        # Read by Dynamo's selection core when the tracker creates it, just below.
        for name, value in SCORER_ENV.items():
            os.environ.setdefault(name, value)
        self._tracker = ri.build_kv_token_tracker(llm_config, prefill_server.deployment_id)
        salted(self._tracker)
        self._tokenizer = await asyncio.to_thread(ri.kv_tokenizer, llm_config)
        # One selection at a time, each after the last one's blocks entered the index: Dynamo
        # books a routed prompt's blocks on its worker (the predict-on-route index) as it
        # selects, and a selection that does not see them spreads a burst of one prefix over
        # the workers (see `select`).
        self._selecting = asyncio.Lock()
        self._releasing: asyncio.Future[None] | None = None  # holds the lock until the index shows
        self._index_warned = False

    async def select(self, request_id: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        salt = fields.pop("cache_salt", None)  # not the renderer's: the selection core's
        workers = list(self._tracker._replica_id_by_worker)
        if not workers:
            return None
        try:
            ids = await self._tokenizer.tokenize(fields)
        except Exception as exc:
            # The renderer refused the request (Ray's TokenizeError: a bad template input): the
            # engine gives the client its own answer; routing by load is all that is lost. Only
            # the error's type is logged: a renderer's message may quote the prompt.
            logger.info("KV scorer could not tokenize a request (%s): routed by load", type(exc).__name__)
            return None
        if not ids:
            return None
        # Ray frees a request id's load when its engine reports it finished; a request scored
        # again under the same id releases its earlier booking first, not counted twice.
        await self.release(request_id)
        expected = fields.get("max_completion_tokens") or fields.get("max_tokens")
        await self._selecting.acquire()
        token = _SALT.set(salt if isinstance(salt, str) and salt else None)
        handed_over = False
        try:
            # Tokenizing above runs beside other requests; selecting does not (`_selecting`):
            # it is Dynamo's in-process index, a few milliseconds per request at most. The
            # answer goes back at once; the next selection waits for this one's blocks.
            chosen = await self._tracker.select_worker(request_id, ids, workers, expected)
            svc = self._tracker._svc
            if isinstance(svc, _SaltedSelection) and svc.booked is not None:
                self._releasing = asyncio.ensure_future(self._release_once_indexed(svc, svc.booked))
                handed_over = True
        finally:
            _SALT.reset(token)
            if not handed_over:
                self._selecting.release()
        self._count(1, "booked")
        return {"worker_id": chosen["worker_id"], "overlap_tokens": chosen["overlap_tokens"], "prompt_tokens": len(ids)}

    async def _release_once_indexed(self, svc: _SaltedSelection, booking: Booking) -> None:
        """Let the next selection run once `booking`'s blocks show in Dynamo's index, or after
        KV_INDEX_WAIT_S: a lagging index costs a burst its shared prefix, never a stall."""
        try:
            if not await svc.indexed(booking, KV_INDEX_WAIT_S):
                logger.debug("KV scorer: a routed prompt's blocks not indexed within %ss", KV_INDEX_WAIT_S)
        except Exception as exc:  # the index is advice: the next selection runs regardless
            if not self._index_warned:
                self._index_warned = True
                logger.warning("KV scorer cannot read Dynamo's index back: %r", exc)
        finally:
            self._selecting.release()

    async def release(self, request_id: str) -> None:
        """Free a booking no engine will report finished (the call never reached one)."""
        if request_id in self._tracker._requests:
            await self._tracker.on_request_completed(request_id)
            self._count(1, "freed")
        self._sweep()

    async def on_lifecycle_events(self, batch: Any) -> None:
        # Only the batch's own requests can be freed by it: no copy of every booking per batch.
        booked = {args[0] for _, args in batch if args} & self._tracker._requests.keys()
        await self._tracker.on_lifecycle_events(batch)
        self._count(len(booked - self._tracker._requests.keys()), "freed")
        self._sweep()

    def _sweep(self) -> None:
        """Ray's tracker remembers the id of every request an engine reported finished
        (`_completed_request_ids`, oldest first), booked or not: every KV-routed prefill call
        reports, those routed by load too. It is there for a booking broadcast by a peer
        LLMRouter replica that arrives after the request finished, and Ray sweeps it only in
        `select_worker` and when applying such broadcasts, after an hour
        (kv_token_tracker.py _evict_stale_requests, REQUEST_TRACKING_TTL_S; Ray 2.60). One
        scorer replica receives no broadcasts: only the newest KV_COMPLETED_IDS_KEPT are kept,
        whatever reaches `select_worker`."""
        done = self._tracker._completed_request_ids
        while len(done) > KV_COMPLETED_IDS_KEPT:
            done.popitem(last=False)

    def _count(self, n: int, event: str) -> None:
        metrics.add(self._bookings, n, {"model": self._model, "event": event})

    async def on_reservations_created(self, batch: Any) -> Any:
        return await self._tracker.on_reservations_created(batch)

    def check_health(self) -> None:
        if self._tracker._svc is None:
            raise RuntimeError("ai-dynamo-runtime is not installed: KV-aware routing cannot score")


@dataclass(frozen=True)
class Booking:
    """A selection Dynamo answered: the request it scored, the worker it chose and how many
    of the prompt's blocks it booked there (its full blocks)."""

    request: dict[str, Any]
    worker_id: int
    blocks: int


class _SaltedSelection:
    """Dynamo's selection service, as Ray's tracker holds it, with the request's prefix-cache
    salt added to what it scores (Ray 2.60's `select_worker` builds the request without one),
    and the last selection's booking kept, to be read back from the index (`indexed`)."""

    def __init__(self, svc: Any):
        self._svc = svc
        self.booked: Booking | None = None

    async def select_and_reserve(self, request: dict[str, Any]) -> Any:
        salt = _SALT.get()
        request = {**request, "cache_salt": salt} if salt else request
        self.booked = None
        selection = await self._svc.select_and_reserve(request)
        self.booked = Booking(request, selection["worker_id"], len(selection.get("sequence_hashes") or ()))
        return selection

    async def indexed(self, booking: Booking, within_s: float) -> bool:
        """Whether `booking`'s blocks show on its worker in Dynamo's index within `within_s`
        (a prompt shorter than a block books none: nothing to wait for)."""
        if not booking.blocks:
            return True
        query = {
            k: booking.request[k]
            for k in ("model_name", "tenant_id", "token_ids", "cache_salt")
            if k in booking.request
        }
        deadline = time.monotonic() + within_s
        while True:
            scores = await self._svc.overlap_scores(query)
            if any(
                w["worker_id"] == booking.worker_id and w["device_blocks"] >= booking.blocks for w in scores["workers"]
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(KV_INDEX_POLL_S)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._svc, name)


def salted(tracker: Any) -> Any:
    """`tracker` (Ray's KVTokenTracker) scoring with each request's salt (None: no Dynamo)."""
    if tracker._svc is not None and not isinstance(tracker._svc, _SaltedSelection):
        tracker._svc = _SaltedSelection(tracker._svc)
    return tracker


def scorer_deployment(prefill: Any, llm_config: Any) -> Any:
    """The bound scorer of one P/D model's prefill tier (`llm_config`: prefill's LLMConfig),
    named as Ray's engines dial it. One replica on no CPU, like Ray's LLMRouter (core/ingress/
    builder.py): it holds the one index, and every decode replica asks it. It runs on the
    prefill pool's nodes with the engines' environment: its tokenizer reads the model's
    tokenizer files from where the engines read them (an s3:// source included)."""
    actor: dict[str, Any] = {"num_cpus": 0}
    bundles = llm_config.deployment_config.get("placement_group_bundle_label_selector") or []
    if bundles:
        actor["label_selector"] = dict(bundles[0])
    if llm_config.runtime_env:
        actor["runtime_env"] = dict(llm_config.runtime_env)
    return (
        serve.deployment(KvScorer)
        .options(
            name=KV_SCORER_DEPLOYMENT,
            num_replicas=1,
            max_ongoing_requests=1000,
            ray_actor_options=actor,
        )
        .bind(prefill_server=prefill, llm_config=llm_config)
    )


class KvRoutes:
    """Decode's side: ask the scorer for a prefill worker within `timeout_s`, and count how each
    request was routed (`pd_kv_routes`: scored, unscored, timeout, error, skipped), how long it
    waited for the answer (`pd_kv_route_wait_seconds`) and, for a scored one, its prompt tokens
    and how many the chosen replica held cached (`pd_kv_route_tokens`). A breaker: after a
    timeout or an error the scorer is not asked for `cooldown_s` (those requests are
    `skipped`, routed by load at once), then one request asks again while the others keep
    skipping; its answer closes the breaker, its failure opens it for another `cooldown_s`."""

    def __init__(
        self,
        scorer: Any,
        model: str,
        timeout_s: float,
        cooldown_s: float = KV_SCORER_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scorer = scorer
        self._model = model
        self._timeout_s = timeout_s
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._counter = metrics.counter(metrics.KV_ROUTES)
        self._tokens = metrics.counter(metrics.KV_ROUTE_TOKENS)
        self._wait = metrics.counter(metrics.KV_ROUTE_WAIT)
        self._down_until: float | None = None  # set while the scorer is taken for down
        self._probing = False

    async def choose(self, request: Any) -> int | None:
        """The prefill worker id the scorer chose for `request`, or None: route by load."""
        down_until = self._down_until
        if self._probing or (down_until is not None and self._clock() < down_until):
            self._counter.inc(tags={"model": self._model, "outcome": metrics.KvRoute.SKIPPED.value})
            return None
        self._probing = down_until is not None  # the first request after the cool-down: the only one that asks
        asked = self._clock()
        try:
            worker, outcome = await self._ask(request)
        finally:
            self._probing = False
        metrics.add(self._wait, self._clock() - asked, {"model": self._model})
        failed = outcome in (metrics.KvRoute.TIMEOUT, metrics.KvRoute.ERROR)
        self._down_until = self._clock() + self._cooldown_s if failed else None
        self._counter.inc(tags={"model": self._model, "outcome": outcome.value})
        return worker

    async def _ask(self, request: Any) -> tuple[int | None, metrics.KvRoute]:
        fields = {f: v for f in PROMPT_FIELDS if (v := getattr(request, f, None)) is not None}
        salt = getattr(request, "cache_salt", None)
        if salt:  # the key's prefix cache (serving/ingress/tenancy.py): scored with it
            fields["cache_salt"] = salt
        call = self._scorer.select.remote(booking_id(), fields)
        try:
            chosen = await asyncio.wait_for(call, self._timeout_s)
        except TimeoutError:
            call.cancel()
            return None, metrics.KvRoute.TIMEOUT
        except Exception as exc:  # the scorer is advice: any failure routes by load
            logger.warning("KV route not scored: %r", exc)
            return None, metrics.KvRoute.ERROR
        if chosen is None:
            return None, metrics.KvRoute.UNSCORED
        metrics.add(self._tokens, chosen["prompt_tokens"], {"model": self._model, "kind": "prompt"})
        metrics.add(self._tokens, chosen["overlap_tokens"], {"model": self._model, "kind": "cached"})
        return int(chosen["worker_id"]), metrics.KvRoute.SCORED

    def release(self) -> None:
        """Free this request's booking: its prefill call ended without the engine's answer
        (failed, timed out, or never sent), so no lifecycle report may free it. Fire and forget:
        a lost release only leaves the load booked until Ray's tracker sweeps it."""
        try:
            self._scorer.release.remote(booking_id())
        except Exception as exc:
            logger.warning("KV route booking not released: %r", exc)
