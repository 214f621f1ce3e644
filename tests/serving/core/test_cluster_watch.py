"""serving/core/cluster_watch.py: Serve's running replicas, pushed to the watch by the controller
only when they change and only for the deployments asked about, and read for /health once per
process at a time; the replicas it counts are the ones Ray's own `serve.status()` would count.

The watch runs against Ray 2.60's own LongPollHost (python/ray/serve/_private/long_poll.py, the
object Serve's controller answers `listen_for_change` with) in this process, no Ray started; the
details count is held against Ray 2.60's ServeInstanceDetails._get_status (python/ray/serve/
schema.py) on the same details.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from serving import ray_internals as ri
from serving.core.cluster_watch import ClusterWatch, StatusReads, running_replicas, serve_running


class _Controller:
    """Serve's controller as a handle sees it, its long poll answered by Ray's own LongPollHost
    (listen timeout shortened); counts the listens it answers."""

    def __init__(self, timeout_s: float = 30.0):
        from ray.serve._private.long_poll import LongPollHost

        self.host = LongPollHost(listen_for_change_request_timeout_s=(timeout_s, timeout_s))
        self.listens = 0
        self.fail = False
        self.listen_for_change = types.SimpleNamespace(remote=self._listen)

    async def _listen(self, keys):
        self.listens += 1
        if self.fail:
            raise ConnectionError("controller unreachable")
        return await self.host.listen_for_change(keys)

    def set_running(self, app: str, name: str, n: int, available: bool = True) -> None:
        """What the controller broadcasts when a deployment's routable replicas change
        (deployment_state.py broadcast_running_replicas_if_changed)."""
        from ray.serve._private.common import DeploymentID, DeploymentTargetInfo, ReplicaID, RunningReplicaInfo
        from ray.serve._private.long_poll import LongPollNamespace

        dep = DeploymentID(name=name, app_name=app)
        replicas = [
            RunningReplicaInfo(
                replica_id=ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep),
                node_id="n",
                node_ip="10.0.0.1",
                availability_zone=None,
                actor_name=f"replica-{i}",
                max_ongoing_requests=8,
            )
            for i in range(n)
        ]
        self.host.notify_changed(
            {(LongPollNamespace.DEPLOYMENT_TARGETS, dep): DeploymentTargetInfo(available, replicas)}
        )


def _watch(controller: _Controller, **kw) -> ClusterWatch:
    async def listen(snapshots):
        return await ri.deployment_targets(controller, snapshots)

    return ClusterWatch("llm", "Ingress", listen=listen, period_s=0.05, **kw)


async def _until(cond, timeout_s: float = 5.0):
    """Wait (polling the loop) until cond() is true; the suite's timeout bounds a hang."""
    while not cond():
        await asyncio.sleep(0.01)


def test_replica_counts_are_pushed_when_they_change_and_an_unasked_watch_asks_nothing():
    async def go():
        controller = _Controller()
        controller.set_running("llm", "Prefill:tiny", 1)
        controller.set_running("other", "Decode:b", 2)
        w = _watch(controller)
        w.start()
        await asyncio.sleep(0.2)
        assert controller.listens == 0  # nobody asked about a deployment: the controller is not asked
        assert w.replicas("Prefill:tiny") is None  # first ask: not known yet, callers do not guess
        await _until(lambda: w.replicas("Prefill:tiny") == 1)
        assert w.replicas("other/Decode:b") is None  # another application's: watched from now on
        await _until(lambda: w.replicas("other/Decode:b") == 2)
        await asyncio.sleep(0.3)  # the listener is waiting for the next change
        settled = controller.listens
        for _ in range(20):  # read per request: no listen per read
            assert w.replicas("Prefill:tiny") == 1
            await asyncio.sleep(0.01)
        assert controller.listens == settled
        controller.set_running("llm", "Prefill:tiny", 0)  # killed: pushed
        await _until(lambda: w.replicas("Prefill:tiny") == 0)
        controller.set_running("other", "Decode:b", 0, available=False)  # deleted
        await _until(lambda: w.replicas("other/Decode:b") == 0)
        w.stop()
        return controller.listens - settled

    listens_for_two_changes = asyncio.run(go())
    assert listens_for_two_changes <= 3  # one per change, and the one waiting now


def test_the_controller_not_answering_makes_the_watch_unknown_until_it_answers_again():
    async def go():
        controller = _Controller(timeout_s=0.1)  # the listen times out: nothing changed, still fresh
        controller.set_running("llm", "Decode:tiny", 1)
        w = _watch(controller)
        w.start()
        w.replicas("Decode:tiny")
        await _until(lambda: w.replicas("Decode:tiny") == 1)
        await asyncio.sleep(0.3)  # listens that time out with nothing changed
        assert w.replicas("Decode:tiny") == 1
        controller.fail = True
        await _until(lambda: w.replicas("Decode:tiny") is None)  # do not guess
        controller.fail = False
        await _until(lambda: w.replicas("Decode:tiny") == 1)
        w.stop()

    asyncio.run(go())


def test_a_burst_of_health_reads_starts_one_read_of_serves_details_and_it_refreshes_after_its_ttl():
    """/health needs no key: a burst of it used to start one blocking status read each."""
    now = [0.0]
    reads = []

    def read():
        reads.append(1)
        return DETAILS

    shared = StatusReads(read=read, clock=lambda: now[0])

    async def burst(n: int):
        return await asyncio.gather(*(serve_running("llm", max_age_s=2.0, reads=shared) for _ in range(n)))

    first = asyncio.run(burst(50))
    assert len(reads) == 1 and all(r == running_replicas(DETAILS, "llm") for r in first)
    now[0] = 1.5
    asyncio.run(burst(50))
    assert len(reads) == 1  # within its age: the same answer
    now[0] = 2.5
    asyncio.run(burst(50))
    assert len(reads) == 2  # past it: read again, once


def test_a_failed_details_read_fails_its_waiters_and_the_next_caller_reads_again():
    calls = []

    def read():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("controller unreachable")
        return DETAILS

    shared = StatusReads(read=read)

    async def burst():
        return await asyncio.gather(*(shared.details(2.0) for _ in range(5)), return_exceptions=True)

    assert all(isinstance(r, ConnectionError) for r in asyncio.run(burst()))
    assert all(r == DETAILS for r in asyncio.run(burst())) and len(calls) == 2


def _replica(i: str, state: str) -> dict:
    return {
        "replica_id": i,
        "state": state,
        "pid": 1,
        "actor_name": f"replica-{i}",
        "node_id": "n",
        "node_ip": "10.0.0.1",
        "start_time_s": 0,
        "log_file_path": "l",
        "worker_id": "w",
    }


def _deployment(name: str, states: list[str]) -> dict:
    return {
        "name": name,
        "status": "HEALTHY",
        "status_trigger": "CONFIG_UPDATE_COMPLETED",
        "message": "",
        "deployment_config": {"name": name},
        "target_num_replicas": len(states),
        "required_resources": {},
        "replicas": [_replica(f"{name}-{k}", st) for k, st in enumerate(states)],
    }


def _app(name: str, deployments: dict[str, list[str]]) -> dict:
    return {
        "name": name,
        "route_prefix": None,
        "docs_path": None,
        "source": "declarative",
        "external_scaler_enabled": False,
        "status": "RUNNING",
        "message": "",
        "last_deployed_time_s": 0,
        "deployments": {d: _deployment(d, st) for d, st in deployments.items()},
    }


DETAILS = {
    "proxies": {},
    "applications": {
        "llm": _app(
            "llm",
            {
                "AuthenticatedIngress": ["RUNNING"],
                "Decode:tiny": ["RUNNING", "STARTING", "STOPPING"],
                "Prefill:tiny": ["RECOVERING", "PENDING_MIGRATION"],
            },
        ),
        "model-b": _app("model-b", {"EagerLLMServer:b": ["RUNNING", "RUNNING"]}),
    },
}


@pytest.mark.parametrize("own_app", ["llm", "model-b"])
def test_counts_the_running_replicas_rays_status_counts(own_app):
    from ray.serve.schema import ServeInstanceDetails

    status = ServeInstanceDetails(**DETAILS)._get_status()
    want: dict[str, int] = {}
    for app_name, app in status.applications.items():
        for name, d in app.deployments.items():
            n = d.replica_states.get("RUNNING", 0)
            want[f"{app_name}/{name}"] = n
            if app_name == own_app:
                want[name] = n
    assert running_replicas(DETAILS, own_app) == want
    assert want["llm/Decode:tiny"] == 1 and want["llm/Prefill:tiny"] == 0  # the fixture can fail


def test_no_details_before_serve_started_is_no_replicas():
    assert running_replicas({}, "llm") == {}
