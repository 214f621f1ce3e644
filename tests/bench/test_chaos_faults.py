"""bench/chaos_faults.py: a fault that missed its target reads INCONCLUSIVE, one that landed
PASS or FAIL on its figures; latency against before; the printed "hit" line (no stack)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import chaos
from bench import chaos_faults as cf
from bench import chaos_streams as cs
from bench.sse import Streamed


def _stream(ok: bool = True) -> Streamed:
    s = Streamed(start=0.0, end=10.0, status=200, done=ok, text="a")
    s.usage = {"completion_tokens": cs.TOKENS}
    if not ok:
        s.error_event = {"error": {"message": "cut"}}
    return s


def _phase(failed: int = 0, p99: float | None = 1.0, mx: float | None = 2.0) -> dict[str, Any]:
    return {"failed": failed, "p99_s": p99, "max_s": mx}


def _streams(*, running: float | None, migrations: dict[str, float], cut: int = 0) -> dict[str, Any]:
    got = [_stream(ok=False) for _ in range(cut)] + [_stream() for _ in range(cs.STREAMS - cut)]
    return {
        "faulted": cs._summary(got, "a"),
        "migrations": migrations,
        "fault": {"replica_id": "r1", "pid": 11, "running": running},
    }


def _kill(*, running: float | None = 4, open_requests: int = 8, replaced_by=("r3",), local: float = 0) -> dict:
    return {
        "phases": {"before": _phase(), "during": _phase(p99=1.5), "after": _phase()},
        "back_to_remote_prefill_s": 3.0,
        "migrations": {},
        "fault": {
            "replica_id": "r1",
            "pid": 11,
            "running": running,
            "open_requests": open_requests,
            "replaced_by": list(replaced_by),
            "local_prefills": local,
        },
    }


def _overload(outcomes: dict[str, int]) -> dict:
    return {"phases": {"before": _phase(), "during": _phase()}, "burst_outcomes": outcomes}


# What each scenario's result looks like when its fault landed, and when it missed.
LANDED = {
    "migrate-decode": _streams(running=4, migrations={"continued": 4}),
    "scale-in": _streams(running=3, migrations={}),
    "kill-decode": _kill(),
    "kill-prefill": _kill(local=5),
    "kill-ingress": _kill(running=None),
    "overload": _overload({"ok": 10, "http_503": 20}),
}
MISSED = {
    # The run of the issue: the killed decode replica held none of the 8 streams.
    "migrate-decode": _streams(running=0, migrations={}),
    "scale-in": _streams(running=0, migrations={}),
    "kill-decode": _kill(running=0),
    "kill-prefill": _kill(local=0),
    "kill-ingress": _kill(running=None, open_requests=0),
    "overload": _overload({"ok": 30}),
}


def test_every_fault_scenario_has_a_landing_check():
    assert set(LANDED) == set(chaos.SCENARIOS) == set(MISSED)
    for name in chaos.SCENARIOS:
        assert cf.landing_checks(name, LANDED[name]), name
    assert cf.landing_checks(chaos.SOAK, {}) == {}


@pytest.mark.parametrize("name", chaos.SCENARIOS)
def test_a_landed_fault_that_broke_nothing_passes(name):
    judged = cf.judge(cf.acceptance({name: LANDED[name]}), {name: LANDED[name]})
    assert judged and set(judged.values()) <= {cf.PASS, cf.NA}, judged
    assert cf.exit_code(judged) == 0
    assert "fault landed" in cf.fault_line(name, LANDED[name])


@pytest.mark.parametrize("name", chaos.SCENARIOS)
def test_a_missed_fault_is_inconclusive_and_the_run_exits_non_zero(name):
    res = MISSED[name]
    acceptance = cf.acceptance({name: res})
    assert all(ok is not False for ok in acceptance.values())  # the figures alone would pass
    judged = cf.judge(acceptance, {name: res})
    assert judged and set(judged.values()) == {cf.INCONCLUSIVE}, judged
    assert cf.exit_code(judged) == 2
    assert "fault missed" in cf.fault_line(name, res)


def test_a_failed_bar_exits_1_whatever_else_the_run_says():
    assert cf.exit_code({"a": cf.PASS, "b": cf.FAIL, "c": cf.INCONCLUSIVE}) == 1
    assert cf.exit_code({"a": cf.PASS, "b": cf.NA}) == 0


def test_a_migration_without_a_continuation_is_inconclusive_even_with_every_stream_complete():
    res = _streams(running=4, migrations={"continued": 0})
    assert cf.judge(cf.acceptance({"migrate-decode": res}), {"migrate-decode": res}) == {
        f"migrate-decode: 0 streams cut or failed, every stream {cs.TOKENS} tokens": cf.INCONCLUSIVE
    }


def test_a_failure_stays_a_failure_whether_or_not_the_fault_landed():
    for res in (_streams(running=4, migrations={"failed": 1}, cut=1), _streams(running=0, migrations={}, cut=1)):
        judged = cf.judge(cf.acceptance({"migrate-decode": res}), {"migrate-decode": res})
        assert set(judged.values()) == {cf.FAIL}
    kd = _kill(running=0)
    kd["phases"]["during"]["failed"] = 2
    assert cf.judge(cf.acceptance({"kill-decode": kd}), {"kill-decode": kd}) == {
        "kill-decode: 0 failed, 0 streams cut": cf.FAIL
    }


def test_only_the_scenario_whose_fault_missed_is_inconclusive():
    results = {"kill-decode": LANDED["kill-decode"], "migrate-decode": MISSED["migrate-decode"]}
    judged = cf.judge(cf.acceptance(results), results)
    assert {k.split(":")[0]: v for k, v in judged.items()} == {
        "kill-decode": cf.PASS,
        "migrate-decode": cf.INCONCLUSIVE,
    }


def test_a_restart_means_a_new_replica_id_in_place_of_the_killed_one():
    assert not all(cf.landing_checks("kill-decode", _kill(replaced_by=())).values())
    assert not all(cf.landing_checks("kill-decode", _kill(replaced_by=("r1",))).values())


def test_requests_open_at_the_kill():
    assert cf.open_at([(0, 5), (4, 6), (6, 9), (1, 4)], 4) == 2


def test_latency_during_and_after_as_ratios_to_before():
    phases = {"before": _phase(p99=2.0, mx=4.0), "during": _phase(p99=3.0, mx=10.0), "after": _phase(p99=None)}
    assert cf.latency_ratios(phases) == {
        "during": {"p99": 1.5, "max": 2.5},
        "after": {"p99": None, "max": 0.5},
    }
    assert cf.latency_ratios({"before": _phase(p99=0.0), "during": _phase()})["during"]["p99"] is None
    head, *rows = cf.table("kill-decode", phases).splitlines()[1:]
    assert head.split()[-2:] == ["p99x", "maxx"]
    assert rows[1].split()[-2:] == ["1.50", "2.50"]


def test_the_hit_line_names_the_replica_its_load_and_the_migrations():
    line = cf.fault_line("migrate-decode", LANDED["migrate-decode"])
    assert "replica r1 (pid 11)" in line and "4 requests running" in line and "continued" in line
    assert "replaced by r3" in cf.fault_line("kill-decode", LANDED["kill-decode"])


def _tail(hit_max: float | None, switch_max: float | None) -> dict:
    res = _kill(local=5)
    res["phases"] = {
        **res["phases"],
        "hit": _phase(mx=hit_max),
        "switch": _phase(mx=switch_max),
    }
    return res


TAIL = "kill-prefill: slowest request hit or met by the kill <= 2x before's slowest"


def test_the_tail_of_a_prefill_kill_is_bounded_by_twice_the_slowest_before():
    # before's slowest is 2.0 s (_phase): 4.0 s passes, 6.3 s (the run the bar comes from) fails.
    assert cf.acceptance({"kill-prefill": _tail(4.0, 1.0)})[TAIL] is True
    assert cf.acceptance({"kill-prefill": _tail(1.0, 6.3)})[TAIL] is False
    assert cf.acceptance({"kill-prefill": _tail(None, None)})[TAIL] is None  # no figure, no verdict
