"""bench/replicas.py: the victim from Serve's replicas and the engines' readings, and the
replica a scale-in removed (no stack)."""

from __future__ import annotations

import types

import httpx

from bench.replicas import RUNNING, Victim, busy, choose_victim, engine_running, removed_replica

REPLICAS = [{"replica_id": "b", "pid": 20}, {"replica_id": "a", "pid": 10}]

# What Ray's metrics page shows for two decode engines and one gone since (its series lingers).
PAGE = f"""\
# TYPE {RUNNING} gauge
{RUNNING}{{ReplicaId="a",WorkerId="w1",model_name="m"}} 1.0
{RUNNING}{{ReplicaId="b",WorkerId="w2",model_name="m"}} 5.0
{RUNNING}{{ReplicaId="gone",WorkerId="w3",model_name="m"}} 9.0
"""


def test_the_victim_is_the_replica_whose_engine_runs_the_most(monkeypatch):
    monkeypatch.setattr(httpx, "get", lambda url, timeout: types.SimpleNamespace(text=PAGE))
    running = engine_running(["http://node-1/metrics"])
    assert running == {"a": 1.0, "b": 5.0, "gone": 9.0}
    assert choose_victim(REPLICAS, running) == Victim("b", 20, 5.0)  # not "gone": not a candidate
    assert busy(REPLICAS, running) == 2
    assert busy(REPLICAS, {"a": 0, "b": 3}) == 1


def test_without_readings_the_lowest_pid_and_without_replicas_none():
    assert choose_victim(REPLICAS, {}) == Victim("a", 10, None)
    assert choose_victim(REPLICAS, {"a": 0.0, "b": 0.0}) == Victim("a", 10, 0.0)
    assert choose_victim(REPLICAS, {"b": 0.0}) == Victim("b", 20, 0.0)  # a reading beats none
    assert choose_victim([], {"a": 3}) is None


def test_the_removed_replica_is_the_first_no_longer_running():
    now = [{"replica_id": "a", "state": "RUNNING"}, {"replica_id": "b", "state": "STOPPING"}]
    assert removed_replica(["a", "b"], now) == "b"
    assert removed_replica(["a", "b"], now[:1]) == "b"
    assert removed_replica(["a"], now) is None
