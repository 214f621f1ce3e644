"""What Serve says about the applications: running replicas per deployment, pushed, or read once.

What flows through here, two ways:
  - `ClusterWatch` (per request, cheap): Serve's controller pushes the routable replicas of
    each deployment the watch was asked about (its long poll, `DEPLOYMENT_TARGETS`: what every
    Serve router follows) -> running replicas by deployment name -> the routing rules
    (serving/ingress/routing.py: is the deployment that serves a model's tokens down, how many
    ingress replicas share the load) and the decode server's prefill hop
    (serving/engines/pd_server.py: no running prefill replica -> prefill locally). Names are
    this application's deployments, or "<app>/<deployment>" for another application's (a
    many-model front door watches the models' applications).
  - `serve_running` (/health): the controller's details of every application, read in a
    thread, one read per process at a time, its answer shared by every caller for
    `max_age_s` (a burst of /health, which needs no key, starts one read, not one each).

Why a push and not a poll: each replica used to read the controller's details once a second
while it served (`get_serve_instance_details`, run on the controller's event loop: a GCS read,
every application's config unpickled and validated, every deployment's details built), a cost
that grew with replicas x applications. The long poll answers a listener only when a watched
deployment's replicas change (or, empty, after Ray's 30-60 s listen timeout), and a watch
that nobody asked about a deployment asks the controller nothing. A deployment is watched from
the first time it is asked about; that first read answers None (not known yet: the callers do
not guess), as does any read while the controller does not answer.

What "running" means: the replicas Serve routes to (RUNNING, and PENDING_MIGRATION ones still
serving while their node drains; Ray 2.60 deployment_state.py get_running_replica_infos); 0 for
a deleted deployment. The details count RUNNING only (Ray's ServeInstanceDetails._get_status,
`running_replicas`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A watch whose listener has not come back for this long is not fresh: twice the longest
# listen of Ray 2.60's long poll (serve/_private/long_poll.py LISTEN_FOR_CHANGE_REQUEST_TIMEOUT_S,
# 30-60 s), after which the controller answers even when nothing changed.
STALE_AFTER_S = 120.0

# The least time between two listens: the controller answers at once only for what changed
# since the snapshot ids a listen carries, so rounds come with changes; this bounds them if not.
MIN_ROUND_GAP_S = 0.1

# (application, deployment) -> the last snapshot id the listener saw (-1: none yet).
Key = tuple[str, str]
Listen = Callable[[Mapping[Key, int]], Awaitable[Mapping[Key, tuple[int, int]]]]


@dataclass
class ClusterState:
    """Running replicas per deployment name asked about, as Serve's controller last said."""

    running: dict[str, int] = field(default_factory=dict)
    updated: float = 0.0
    error: str | None = None


RUNNING = "RUNNING"  # ray.serve._private.common.ReplicaState.RUNNING (a str enum)


def running_replicas(details: Mapping[str, Any], own_app: str) -> dict[str, int]:
    """Running replicas by deployment, from the controller's details (the dict Ray's
    ServeInstanceDetails schema describes): this application's by their name, every
    application's (the many-model form's model applications included) as "<app>/<deployment>"."""
    running: dict[str, int] = {}
    for app_name, app in (details.get("applications") or {}).items():
        for name, d in (app.get("deployments") or {}).items():
            n = sum(1 for r in d.get("replicas") or () if r.get("state") == RUNNING)
            running[f"{app_name}/{name}"] = n
            if app_name == own_app:
                running[name] = n
    return running


class ClusterWatch:
    """Running replicas of the deployments asked about, pushed by Serve's controller.

    `listen(snapshot ids by key)` is one long-poll round (default: Serve's controller, via
    serving.ray_internals.deployment_targets): it returns the keys whose replicas changed,
    each with its new snapshot id and running replicas, or nothing at the listen's timeout."""

    def __init__(
        self,
        app_name: str,
        own_deployment: str,
        period_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        listen: Listen | None = None,
    ):
        self.app_name = app_name
        self.own = own_deployment
        self.period_s = period_s  # wait after a failed listen before the next
        self._clock = clock
        self._listen = listen
        self.state = ClusterState()
        self._snapshots: dict[Key, int] = {}
        self._names: dict[Key, str] = {}
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            if self._snapshots:
                self._wake.set()
            self._task = asyncio.get_event_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _key(self, deployment: str) -> Key:
        app, sep, name = deployment.partition("/")
        return (app, name) if sep else (self.app_name, deployment)

    def _want(self, deployment: str) -> None:
        key = self._key(deployment)
        if key not in self._snapshots:
            self._snapshots[key] = -1
            self._names[key] = deployment
            if self._wake is not None:
                self._wake.set()  # listen again, with this deployment too

    async def _run(self) -> None:
        assert self._wake is not None
        listen = self._listen
        while True:
            await self._wake.wait()  # nothing asked about yet: ask the controller nothing
            self._wake.clear()
            try:
                listen = listen or await _controller_listen()
                updates = await self._round(listen)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller did not answer: not fresh until it does
                self.state.error = repr(exc)
                await asyncio.sleep(self.period_s)
            else:
                if updates is not None:
                    self._apply(updates)
                await asyncio.sleep(MIN_ROUND_GAP_S)
            self._wake.set()

    async def _round(self, listen: Listen) -> Mapping[Key, tuple[int, int]] | None:
        """One listen, or None when a new deployment was asked about meanwhile (then listen
        again with it; the call left behind ends on the controller's listen timeout)."""
        assert self._wake is not None
        pending = asyncio.ensure_future(listen(dict(self._snapshots)))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({pending, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if not pending.done():
            pending.cancel()
            return None
        return pending.result()

    def _apply(self, updates: Mapping[Key, tuple[int, int]]) -> None:
        for key, (snapshot, running) in updates.items():
            if key in self._names:
                self._snapshots[key] = snapshot
                self.state.running[self._names[key]] = running
        self.state.updated = self._clock()
        self.state.error = None

    def fresh(self, max_age_s: float = STALE_AFTER_S) -> bool:
        """Is what the watch says current: the listener answered (a change or the listen's
        timeout) within `max_age_s` and its last round did not fail?"""
        state = self.state
        return bool(state.running) and state.error is None and self._clock() - state.updated < max_age_s

    def replicas(self, deployment: str) -> int | None:
        """Running replicas of `deployment` (None: not known yet, or Serve's controller does
        not answer; the deployment is watched from now on)."""
        self._want(deployment)
        if not self.fresh():
            return None
        return self.state.running.get(deployment)


async def _controller_listen() -> Listen:
    """One long-poll round against Serve's controller (looked up once, off the loop)."""
    from serving import ray_internals as ri

    controller = await asyncio.to_thread(ri.serve_controller)

    async def listen(snapshots: Mapping[Key, int]) -> Mapping[Key, tuple[int, int]]:
        return await ri.deployment_targets(controller, snapshots)

    return listen


class StatusReads:
    """The controller's details of every application, read at most once at a time (in a
    thread: the call blocks), its answer shared by every caller for `max_age_s`."""

    def __init__(
        self, read: Callable[[], Mapping[str, Any]] | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self._read = read
        self._clock = clock
        self._details: Mapping[str, Any] = {}
        self._at = -float("inf")
        self._pending: asyncio.Future[Mapping[str, Any]] | None = None

    async def details(self, max_age_s: float) -> Mapping[str, Any]:
        if self._clock() - self._at <= max_age_s:
            return self._details
        pending = self._pending
        if pending is None or pending.done() or pending.get_loop() is not asyncio.get_running_loop():
            pending = self._pending = asyncio.ensure_future(self._fetch())
        # A caller that goes away (a /health client hanging up) leaves the read to the others.
        return await asyncio.shield(pending)

    async def _fetch(self) -> Mapping[str, Any]:
        read = self._read
        if read is None:
            from serving import ray_internals as ri

            read = ri.serve_details
        details = await asyncio.to_thread(read)
        self._details, self._at = details, self._clock()
        return details


READS = StatusReads()  # this process's


async def serve_running(app_name: str, max_age_s: float = 2.0, reads: StatusReads | None = None) -> dict[str, int]:
    """Running replicas per deployment of every application (`running_replicas`), as Serve's
    controller said at most `max_age_s` ago: one read per process at a time (`READS`)."""
    return running_replicas(await (reads or READS).details(max_age_s), app_name)
