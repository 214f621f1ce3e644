"""What Serve says about the application: running replicas per deployment, kept fresh.

What flows through here: `serve.status()` (Serve's controller; it blocks, so it is polled in
a thread every `period_s`) -> running replicas per deployment of this application -> the
hybrid routing rules (serving/hybrid.py): is the deployment that serves a model's tokens
down, and how many decode replicas share the load.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class ClusterState:
    """Running replicas per deployment of this application, as Serve's controller last said."""

    running: dict[str, int] = field(default_factory=dict)
    updated: float = 0.0
    error: str | None = None


class ClusterWatch:
    """Polls `serve.status()` every `period_s` in a thread (it blocks on the controller)."""

    def __init__(self, app_name: str, own_deployment: str, period_s: float = 1.0):
        self.app_name = app_name
        self.own = own_deployment
        self.period_s = period_s
        self.state = ClusterState()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_event_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _poll(self) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(self.app_name)
        if app is None:
            return {}
        return {
            name: sum(n for state, n in d.replica_states.items() if state == "RUNNING")
            for name, d in app.deployments.items()
        }

    async def _run(self) -> None:
        while True:
            try:
                running = await asyncio.to_thread(self._poll)
                self.state = ClusterState(running=running, updated=time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.state.error = repr(exc)
            await asyncio.sleep(self.period_s)

    def fresh(self, max_age_s: float = 10.0) -> bool:
        return bool(self.state.running) and time.monotonic() - self.state.updated < max_age_s

    def replicas(self, deployment: str) -> int | None:
        if not self.fresh():
            return None
        return self.state.running.get(deployment)
