"""serving/core/cluster_watch.py: Serve's status is asked for while it is read, and not otherwise,
and the running replicas it reads are the ones Ray's own `serve.status()` would count.

Each read is a round trip to Serve's controller; every ingress replica and every decode
replica keeps a watch. The poll is faked here (no Ray started); the counting is held against
Ray 2.60's ServeInstanceDetails._get_status (python/ray/serve/schema.py) on the same details.
"""

from __future__ import annotations

import asyncio

import pytest

from serving.core.cluster_watch import ClusterWatch, running_replicas


class _Watch(ClusterWatch):
    def __init__(self, **kw):
        super().__init__("llm", "Ingress", **kw)
        self.polls = 0

    def poll(self):
        self.polls += 1
        return {"Decode": 1}


def test_an_unread_watch_asks_serve_nothing_and_a_read_wakes_it():
    async def go():
        w = _Watch(period_s=0.02, idle_s=0.2)
        w.start()
        await asyncio.sleep(0.3)
        idle_polls = w.polls  # nobody read it
        assert w.replicas("Decode") is None  # not fresh yet: callers do not guess
        await asyncio.sleep(0.1)
        assert w.replicas("Decode") == 1 and w.polls > idle_polls
        for _ in range(5):  # read while traffic flows: kept fresh
            await asyncio.sleep(0.05)
            assert w.replicas("Decode") == 1
        await asyncio.sleep(1.0)  # no reads for longer than idle_s: the poll stops
        stopped_at = w.polls
        await asyncio.sleep(0.3)
        w.stop()
        return idle_polls, stopped_at, w.polls

    idle, stopped_at, end = asyncio.run(go())
    assert idle == 0
    assert end == stopped_at  # nothing asked while nobody read


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
