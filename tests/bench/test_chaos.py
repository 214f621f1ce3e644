"""`make chaos` dry (bench/chaos.py, bench/chaos_streams.py): the stack every scenario runs on,
and the configs the scenarios deploy, built without Ray (tests/bench/dry_run.py); each
scenario's expectations of that stack (the deployments it kills, the replicas Serve must be
back to, the admission bound it bursts past) hold in what is built."""

from __future__ import annotations

import pytest

from bench import chaos
from bench import chaos_streams as cs
from local.config import admission_bound
from tests.bench import dry_run


@pytest.fixture(scope="module")
def stack() -> dry_run.StackPlan:
    return dry_run.plan(chaos.stack_options())


@pytest.fixture(scope="module")
def built(stack) -> dict[str, dry_run.Replicas]:
    (app,) = dry_run.build(stack.config).items()
    assert app[0] == "llm"
    return app[1]


def _deployment(built: dict[str, dry_run.Replicas], marker: str) -> str:
    """The one deployment whose replicas' process titles (ray::ServeReplica:<app>:<deployment>)
    hold `marker`, and whose name holds the marker Serve's REST view is searched by."""
    found = [d for d in built if marker in f"ray::ServeReplica:llm:{d}" and marker.strip(":") in d]
    assert len(found) == 1, (marker, list(built))
    return found[0]


def test_every_scenario_is_checked_here():
    assert {*chaos.SCENARIOS, chaos.SOAK} == {*chaos.KILLS, *cs.NAMES, "overload", chaos.SOAK}


@pytest.mark.parametrize("name", sorted(chaos.KILLS))
def test_a_kill_scenario_finds_its_deployment_and_the_replicas_serve_restores(built, name):
    marker, want = chaos.KILLS[name]
    assert built[_deployment(built, marker)] == dry_run.Replicas(want, want)


def test_the_stream_scenarios_have_two_decode_replicas_and_scale_in_deploys_one(stack, built):
    decode = _deployment(built, cs.DECODE)
    assert built[decode] == dry_run.Replicas(cs.DECODE_REPLICAS, cs.DECODE_REPLICAS)
    # scale-in deploys the stack's config with decode at 1, then the stack's own again
    (scaled,) = dry_run.build(cs._with_decode_replicas(stack.config, 1)).values()
    assert scaled[decode] == dry_run.Replicas(1, 1, initial=1)
    assert {d: r for d, r in scaled.items() if d != decode} == {d: r for d, r in built.items() if d != decode}


def test_overload_bursts_past_the_admission_bound_of_the_built_decode(stack, built):
    decode = stack.config["applications"][0]["args"]["decode_config"]["deployment_config"]
    assert admission_bound(stack.config) == decode["max_ongoing_requests"] * 2 + decode["max_queued_requests"] > 0


def test_the_stack_exports_metrics_often_enough_to_pick_a_busy_victim(stack):
    # The victim is picked from the engines' exported gauges within seconds of a round's start.
    interval_s = int(chaos.stack_options()["extra_env"]["RAY_metrics_report_interval_ms"]) / 1000
    assert interval_s * 5 <= min(chaos.VICTIM_WITHIN_S, cs.BUSY_WITHIN_S)
    assert stack.config  # the stack still plans with the extra environment


def _out(start: float, end: float) -> chaos.Outcome:
    return chaos.Outcome(start=start, end=end, status=200, ok=True, began_streaming=True, ttfb_s=0.1, kind="ok")


def test_the_requests_a_fault_hit_are_not_counted_as_before():
    """A kill at t=20 (healthy again at t=60): the request open at the kill took 7 s. Counted in
    "before" (as it was), before's max would be 7 s and the fault's tail would hide in the ratio."""
    edge = 20 + chaos.SWITCH_S  # the first start after the switch window
    outs = [_out(10, 11), _out(18, 19.5), _out(19, 26), _out(21, 26.5), _out(edge - 1, edge), _out(edge + 1, edge + 2)]
    outs.append(_out(61, 62))
    phases = chaos.by_phase(outs, fault_at=20, healthy_at=60)
    assert {ph: st["requests"] for ph, st in phases.items()} == {
        "before": 2,  # ended by t=20
        "hit": 1,  # 19 -> 26, open at the kill
        "switch": 2,  # started in [20, edge): 21 and edge - 1
        "during": 3,  # started in [20, 60)
        "after": 1,
    }
    assert phases["before"]["max_s"] == 1.5
    assert phases["hit"]["max_s"] == 7.0
    assert phases["switch"]["max_s"] == 5.5
    # The switch window ends where the replica is healthy again, if that comes first.
    assert chaos.by_phase(outs, fault_at=20, healthy_at=25)["switch"]["requests"] == 1


def test_the_first_seconds_of_load_are_not_the_baseline():
    """A cold stack's first requests (all clients start at t=0) are slow: not what a fault is
    compared with."""
    outs = [_out(0.1, 9.0), _out(0.2, 8.0), _out(chaos.WARMUP_S, chaos.WARMUP_S + 1), _out(12, 13.5)]
    before = chaos.by_phase(outs, fault_at=20, healthy_at=60)["before"]
    assert before["requests"] == 2 and before["max_s"] == 1.5
