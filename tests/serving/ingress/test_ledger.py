"""serving/ingress/ledger.py: the sliding-minute arithmetic, and one ledger per application
that every ingress version counts in, across rollouts, with the old ones retired."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from serving.ingress import ledger as ledger_module
from serving.ingress import limits
from serving.ingress.ledger import (
    CALLS,
    LEDGER_SCHEMA,
    RETIRE_IDLE_S,
    KeyLimit,
    LimitsLedger,
    SlidingWindows,
    Succession,
    family,
    ledger_name,
    schema_of,
)
from serving.ingress.limits import LimitsConfig, Reservation

KID = "k-0123456789ab"


# --- the windows --------------------------------------------------------------------------------
def test_rpm_refuses_the_request_over_the_limit_with_the_seconds_until_room():
    w = SlidingWindows()
    lim = KeyLimit(requests_per_minute=3)
    assert [w.admit("k", 1000.2, lim, 0).ok for _ in range(3)] == [True, True, True]
    d = w.admit("k", 1010.0, lim, 0)
    assert not d.ok and d.limit == "rpm" and "3 requests per minute" in d.message
    # The three requests of second 1000 leave the window at 1060: 50 s from 1010.
    assert d.retry_after_s == 50
    assert w.admit("k", 1059.9, lim, 0).ok is False
    assert w.admit("k", 1060.0, lim, 0).ok is True


def test_keys_are_counted_apart():
    w = SlidingWindows()
    lim = KeyLimit(requests_per_minute=1)
    assert w.admit("a", 0, lim, 0).ok
    assert not w.admit("a", 1, lim, 0).ok
    assert w.admit("b", 1, lim, 0).ok


def test_retry_after_counts_only_the_buckets_that_must_leave():
    w = SlidingWindows()
    lim = KeyLimit(requests_per_minute=2)
    assert w.admit("k", 100, lim, 0).ok
    assert w.admit("k", 130, lim, 0).ok
    d = w.admit("k", 140, lim, 0)
    assert not d.ok and d.retry_after_s == 20  # the request of second 100 leaves at 160


def test_tpm_reserves_then_settles_to_what_was_used():
    w = SlidingWindows()
    lim = KeyLimit(tokens_per_minute=100)
    d1 = w.admit("k", 10, lim, 60)
    assert d1.ok
    # Reserved 60 of 100: a reservation that would overspend the budget is refused ...
    d2 = w.admit("k", 11, lim, 60)
    assert not d2.ok and d2.limit == "tpm"
    # ... one that fits is not.
    d3 = w.admit("k", 12, lim, 40)
    assert d3.ok
    assert not w.admit("k", 12, lim, 1).ok
    # Both used far less than reserved: room again at once.
    w.settle("k", 13, d1.ticket, 10)
    w.settle("k", 13, d3.ticket, 10)
    assert w.totals("k", 13) == (2, 20)
    assert w.admit("k", 13, lim, 60).ok


def test_settle_after_the_reservation_left_the_window_counts_the_tokens_now():
    w = SlidingWindows()
    lim = KeyLimit(tokens_per_minute=1000)
    d = w.admit("k", 0, lim, 50)
    w.settle("k", 90, d.ticket, 70)
    assert w.totals("k", 90) == (0, 70)


# --- the ledger's calls are its schema's ----------------------------------------------------------
def test_the_ledgers_calls_are_the_ones_its_schema_names():
    """Every replica of a schema, of any code version, sends these calls to one actor, and a
    newer schema's ledger serves them for an older one forwarding to it: a change to a call
    must come with a new LEDGER_SCHEMA (and a CALLS of its own)."""
    public = {
        name: tuple(inspect.signature(fn).parameters)[1:]
        for name, fn in inspect.getmembers(LimitsLedger, inspect.isfunction)
        if not name.startswith("_")
    }
    assert public == CALLS


# --- one ledger across code versions ---------------------------------------------------------------
class _Handle:
    """An actor handle over a ledger object in this process (`.call.remote(...)` awaitable)."""

    def __init__(self, ledger):
        self.ledger = ledger

    def __getattr__(self, name):
        method = getattr(self.ledger, name)

        class _Call:
            def remote(self, *args):
                return _Answered(method(*args))

        return _Call()


class _Answered:
    """An answered call's reference: awaitable, and nothing left undone if it is not awaited."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        yield from ()
        return self.value


def _next_version(tmp_path):
    """The module that defines the ledger, as the next release of the ingress ships it: one
    line of the ledger's code changed (not its calls or state)."""
    source = Path(inspect.getsourcefile(LimitsLedger)).read_text()
    changed = source.replace("        self._calls = 0\n", "        self._calls = 0  # next release\n", 1)
    assert changed != source
    path = tmp_path / "ledger_next.py"
    path.write_text(changed)
    spec = importlib.util.spec_from_file_location("ledger_next", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ledger_next"] = module
    spec.loader.exec_module(module)
    return sys.modules[LimitsLedger.__module__], module


def test_two_versions_of_the_ingress_code_count_in_one_ledger(tmp_path):
    """The defect: the ledger was named by a hash of its code, so during a rollout the old
    and the new replicas each counted in a ledger of their own and a key got twice its limit."""
    try:
        current, following = _next_version(tmp_path)
        actors = {}  # Ray's named actors: the first replica to name one creates it

        def factory(module):
            name = module.ledger_name("llm")
            return lambda: actors.setdefault(name, _Handle(module.LimitsLedger()))

        cfg = LimitsConfig.from_user_config({"requests_per_minute": 1})
        old = limits.Limiter(cfg, factory(current), _Meter())
        new = limits.Limiter(cfg, factory(following), _Meter())

        async def go():
            return (await old.admit(KID, "m", {})).ok, (await new.admit(KID, "m", {})).ok

        assert asyncio.run(go()) == (True, False)
        assert len(actors) == 1
    finally:
        sys.modules.pop("ledger_next", None)


# --- a newer schema takes over; old ledgers retire ---------------------------------------------------
class _Meter:
    def rate_limited(self, *a):
        pass

    def limiter_error(self):
        pass


class _Registry:
    """The application's named ledger actors, as Ray lists them (a stand-in)."""

    def __init__(self):
        self.actors, self.killed, self.is_rolling = {}, [], False

    def add(self, name, ledger):
        self.actors[name] = ledger
        return ledger

    def names(self):
        return list(self.actors)

    def proxy(self, name):
        return self.actors[name]

    def kill(self, name):
        self.killed.append(name)
        del self.actors[name]

    def rolling(self):
        return self.is_rolling


class _HashNamed:
    """A ledger of schema 1 (named by a hash of its code): it has no idle_s or hand_over."""

    def totals(self, kid, model):
        return (0, 0)


def _ledger(reg, clock, schema=LEDGER_SCHEMA):
    return reg.add(ledger_name("llm", schema), LimitsLedger("llm", "Ingress", registry=reg, schema=schema, clock=clock))


def test_a_newer_schemas_ledger_takes_over_and_both_versions_count_once():
    now = [1000.0]
    reg = _Registry()
    older = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA)
    cfg = LimitsConfig.from_user_config({"requests_per_minute": 2, "tokens_per_minute": 10_000})
    old_replica = limits.Limiter(cfg, lambda: _Handle(older), _Meter())

    async def before():
        return await old_replica.admit(KID, "m", {"prompt": "x" * 40, "max_tokens": 500})

    reserved = asyncio.run(before())
    newer = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA + 1)
    Succession(newer, reg).sweep()
    assert newer.totals(KID, "m") == (1, 510)  # the older one's windows came along
    new_replica = limits.Limiter(cfg, lambda: _Handle(newer), _Meter())
    Reservation(old_replica, KID, "m", reserved).settle(20)  # opened there, settled here

    async def after():
        return (await new_replica.admit(KID, "m", {})).ok, (await old_replica.admit(KID, "m", {})).ok

    assert asyncio.run(after()) == (True, False)  # the old replica's call was counted with the new ones
    assert newer.totals(KID, "m") == (2, 20)


def test_an_old_ledger_is_retired_once_quiet_and_no_rollout_is_under_way():
    now = [1000.0]
    reg = _Registry()
    hash_named = reg.add("pd-limits-llm-0123456789", _HashNamed())
    older = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA)
    current = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA + 1)
    sweep = Succession(current, reg).sweep
    reg.is_rolling = True
    assert sweep() == []  # first seen; the older one hands over
    now[0] += RETIRE_IDLE_S
    current.totals(KID, "m")  # in use
    older.totals(KID, "m")  # an old replica still calls the older one (forwarded)
    assert sweep() == []  # a rollout is under way
    reg.is_rolling = False
    assert sweep() == ["pd-limits-llm-0123456789"]  # the older one had a call just now
    now[0] += RETIRE_IDLE_S
    current.totals(KID, "m")
    assert sweep() == [older.name]
    assert list(reg.actors) == [current.name] and hash_named not in reg.actors.values()


def test_a_ledger_nobody_calls_retires_no_other():
    """After a rollback to code that names another ledger, the one left unused must not
    retire the one in use: it is retired by it instead."""
    now = [1000.0]
    reg = _Registry()
    reg.add("pd-limits-llm-0123456789", _HashNamed())
    current = _ledger(reg, lambda: now[0])
    sweep = Succession(current, reg).sweep
    assert sweep() == []
    now[0] += RETIRE_IDLE_S  # no call to `current` since
    assert sweep() == []


def test_an_application_names_only_its_own_ledgers():
    mine = family("llm")
    assert mine.fullmatch(ledger_name("llm")) and mine.fullmatch("pd-limits-llm-0123456789")
    for other in ("pd-limits-llm-2-v2", ledger_name("llm-prod"), "pd-limits-llm-0123456789-v2", "pd-limits-llmv2"):
        assert not mine.fullmatch(other), other
    assert schema_of(ledger_name("llm"), "llm") == LEDGER_SCHEMA
    assert schema_of("pd-limits-llm-0123456789", "llm") == 1
    assert ledger_module.NAMESPACE == "serve"


# --- budgets and spend: one more window in the same ledger ----------------------------------------
class _Store:
    """Ray's GCS key-value store for one ledger name (a stand-in): what a restart reads back."""

    def __init__(self):
        self.rows, self.saves = [], 0

    def load(self):
        return [list(r) for r in self.rows]

    def save(self, rows):
        self.rows, self.saves = [list(r) for r in rows], self.saves + 1


# 2026-12-07 22:00:00 UTC: two hours before the day's budget resets.
LATE_EVENING = 1_796_680_800.0


def _spent(limiter, cost, used=10):
    """One admitted request of KID on `limiter` that cost `cost` USD: its admit, then its settle."""

    async def go():
        d = await limiter.admit(KID, "m", {"prompt": "x", "max_tokens": 1})
        if d.ok:
            Reservation(limiter, KID, "m", d).settle(used, limits.Spend(cost, 1, used - 1, 1, 0))
        return d

    return asyncio.run(go())


def test_a_key_past_its_budget_is_refused_on_its_first_request_past_it_across_ingress_replicas():
    now = [LATE_EVENING]
    ledger = LimitsLedger(clock=lambda: now[0])
    cfg = LimitsConfig.from_user_config({"keys": {KID: {"budget": {"usd": 0.01, "period": "day"}}}})
    a = limits.Limiter(cfg, lambda: _Handle(ledger), _Meter())
    b = limits.Limiter(cfg, lambda: _Handle(ledger), _Meter())
    assert _spent(a, 0.004).ok and _spent(b, 0.004).ok  # $0.008 of $0.01
    assert _spent(a, 0.004).ok  # admitted under the budget; its cost takes the day to $0.012
    refused = _spent(b, 0.004)  # the first request past it, on the other replica
    assert not refused.ok and refused.limit == "budget"
    assert refused.retry_after_s == 2 * 3600  # the day's end, UTC
    assert "$0.01" in refused.message and "daily budget" in refused.message
    assert not _spent(a, 0.0).ok
    assert ledger.spend(KID)["day"]["usd"] == pytest.approx(0.012) and ledger.spend(KID)["day"]["requests"] == 3
    now[0] += 2 * 3600  # midnight: a new day
    assert _spent(a, 0.004).ok


def test_a_monthly_budget_counts_every_model_of_the_key_and_other_keys_not_at_all():
    ledger = LimitsLedger(clock=lambda: LATE_EVENING)
    budget = [1.0, "month"]
    ledger.settle(KID, "a", "r1", 5, [0.6, 1, 4, 1, 0])  # no admit landed: spend still counts
    ledger.settle(KID, "b", "r2", 5, [0.5, 1, 4, 1, 0])
    ledger.record([["k-other0000000", 3.0, 1, 1, 1, 0]])
    assert not ledger.admit(KID, "c", 0, 0, 0, "r3", budget).ok  # $1.10 over a, b
    assert ledger.admit("k-other0000000", "a", 0, 0, 0, "r4", None).ok  # no budget
    assert ledger.spend("k-other0000000")["month"]["usd"] == 3.0


def test_spend_survives_a_restart_of_the_ledger_from_its_checkpoint():
    store = _Store()
    before = LimitsLedger(clock=lambda: LATE_EVENING, store=store)
    before.settle(KID, "m", "r1", 5, [0.25, 1, 4, 1, 2])
    assert before._checkpoint() and not before._checkpoint()  # written once, then nothing new
    after = LimitsLedger(clock=lambda: LATE_EVENING, store=store)  # the actor restarted
    assert after.spend(KID) == before.spend(KID)
    assert after.spend(KID)["month"]["cached"] == 2


def test_a_newer_schemas_ledger_takes_the_spend_over_with_the_windows():
    now = [LATE_EVENING]
    reg = _Registry()
    older = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA)
    older.settle(KID, "m", "r1", 5, [0.75, 1, 4, 1, 0])
    newer = _ledger(reg, lambda: now[0], schema=LEDGER_SCHEMA + 1)
    Succession(newer, reg).sweep()
    assert newer.spend(KID)["day"]["usd"] == 0.75
    older.settle(KID, "m", "r2", 5, [0.25, 1, 4, 1, 0])  # an old replica's settle: forwarded
    assert newer.spend(KID)["day"]["usd"] == 1.0 and older._spend.export() == []


def test_a_schema_2_ledgers_state_has_no_spend_and_its_calls_still_count():
    """Schema 2 handed over windows and open reservations only, and its replicas send admit and
    settle without a budget or a spend: a schema-3 ledger takes both."""
    now = [LATE_EVENING]
    ledger = LimitsLedger(clock=lambda: now[0])

    class _Schema2:
        def hand_over(self, successor):
            return {"schema": 2, "windows": [[KID, "m", [[int(now[0]), 1, 7]]]], "open": []}

    ledger._take_over(_Schema2())
    assert ledger.totals(KID, "m") == (1, 7) and ledger.spend(KID)["day"]["usd"] == 0.0
    d = ledger.admit(KID, "m", 10, 0, 3, "old-1")  # schema 2's six arguments
    ledger.settle(KID, "m", d.ticket, 3)  # and its four
    assert ledger.totals(KID, "m") == (2, 10)
