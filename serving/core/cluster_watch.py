"""What Serve says about the applications: running replicas per deployment, kept fresh while read.

What flows through here: Serve's controller's details of every application (what
`serve.status()` summarises; it blocks, so it is read in a thread every `period_s`) -> running
replicas per deployment of this application (and of
every other one, by "<app>/<deployment>": a many-model front door watches the models'
applications) -> the routing rules (serving/ingress/routing.py: is the deployment that serves
a model's tokens down, how many decode replicas share the load) and the decode server's
prefill hop (serving/engines/pd_server.py: no running prefill replica -> prefill locally).

Read on demand: each read is a full round trip to the controller (it builds every
application's details), so the watch polls only while someone reads it, and stops after
`idle_s` without a read. An idle stack asks the controller nothing; the first read after a
pause finds no fresh answer (`replicas` is None: the callers then do not guess) and wakes the
poll.

Why the controller's dict and not `serve.status()`: Ray 2.60's `serve.status()` validates that
dict into pydantic models in the caller, and each deployment's RequestRouterConfig
cloudpickles its router class on the way; under load that was 15% of a decode replica's CPU
(py-spy, 16 streams on the local stack). Counting the replicas in the dict gives the same
figure (Ray's own `ServeInstanceDetails._get_status` counts `replicas[*].state`; an e2e test
holds the two equal on the live stack).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClusterState:
    """Running replicas per deployment of this application, as Serve's controller last said."""

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
    """Polls the controller's details every `period_s` in a thread (it blocks on the controller), while
    it is read; `idle_s` after the last read it stops until the next."""

    def __init__(
        self,
        app_name: str,
        own_deployment: str,
        period_s: float = 1.0,
        idle_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.app_name = app_name
        self.own = own_deployment
        self.period_s = period_s
        self.idle_s = idle_s
        self._clock = clock
        self.state = ClusterState()
        self._task: asyncio.Task | None = None
        self._started = False
        self._read_at = -float("inf")
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        self._started = True
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_event_loop().create_task(self._run())

    def stop(self) -> None:
        self._started = False
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def poll(self) -> dict[str, int]:
        """Serve's running replicas now (blocks on the controller: call it in a thread)."""
        from serving import ray_internals as ri

        return running_replicas(ri.serve_details(), self.app_name)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if self._clock() - self._read_at > self.idle_s:
                self._wake.clear()
                await self._wake.wait()  # nobody reads: ask the controller nothing
            try:
                running = await asyncio.to_thread(self.poll)
                self.state = ClusterState(running=running, updated=self._clock())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.state.error = repr(exc)
            await asyncio.sleep(self.period_s)

    def _read(self) -> None:
        self._read_at = self._clock()
        if self._wake is not None and not self._wake.is_set():
            self._wake.set()

    def fresh(self, max_age_s: float = 10.0) -> bool:
        self._read()
        return bool(self.state.running) and self._clock() - self.state.updated < max_age_s

    def replicas(self, deployment: str) -> int | None:
        if not self.fresh():
            return None
        return self.state.running.get(deployment)
