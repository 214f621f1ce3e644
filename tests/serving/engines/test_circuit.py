"""The prefill circuit (serving/engines/circuit.py) against a reference state machine.

hypothesis drives arbitrary sequences of requests, successes, failures (of the probe and of
requests that started before the circuit opened), cancellations and clock steps; after
every step the circuit must agree with the reference model written here from the
breaker's definition in the module docstring (closed -> N failures in a row -> open ->
open_s -> one probe -> success closes / failure reopens / cancel frees the slot), not from
the implementation. The invariant the review found broken: once open_s has passed a probe
is let through, and a successful probe closes the circuit for good.
"""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.engines.circuit import Circuit, State

OPEN_S = 5.0
THRESHOLD = 3


class Reference:
    """The breaker as specified, with no shared code."""

    def __init__(self) -> None:
        self.failures = 0
        self.opened_at: float | None = None
        self.probe_out = False

    def state(self, now: float) -> State:
        if self.opened_at is None:
            return State.CLOSED
        if self.probe_out or now - self.opened_at < OPEN_S:
            return State.OPEN
        return State.HALF_OPEN


class CircuitMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.circuit = Circuit(OPEN_S, THRESHOLD, clock=lambda: self.now)
        self.ref = Reference()
        self.probe_active = False  # the model's probe holder, if one was let through
        self.normal_active = 0  # requests let through while closed, not yet settled

    @rule(dt=st.floats(min_value=0.0, max_value=2 * OPEN_S, allow_nan=False))
    def clock_step(self, dt: float) -> None:
        self.now += dt

    @rule()
    def request(self) -> None:
        expected = self.ref.state(self.now)
        allowed = self.circuit.allow()
        if expected is State.CLOSED:
            assert allowed
            self.normal_active += 1
        elif expected is State.OPEN:
            assert not allowed
        else:
            assert allowed and self.circuit.probing
            self.ref.probe_out = True
            self.probe_active = True

    @precondition(lambda self: self.probe_active)
    @rule()
    def probe_succeeds(self) -> None:
        self.circuit.success()
        self.probe_active = False
        self.ref.failures, self.ref.opened_at, self.ref.probe_out = 0, None, False
        assert self.circuit.state is State.CLOSED and self.circuit.allow()
        self.normal_active += 1  # the request just let through above

    @precondition(lambda self: self.probe_active)
    @rule()
    def probe_fails(self) -> None:
        self.circuit.failure(probe=True)
        self.probe_active = False
        self.ref.opened_at, self.ref.probe_out, self.ref.failures = self.now, False, 0

    @precondition(lambda self: self.probe_active)
    @rule()
    def probe_cancelled(self) -> None:
        self.circuit.release()
        self.probe_active = False
        self.ref.probe_out = False

    @precondition(lambda self: self.normal_active > 0)
    @rule()
    def request_succeeds(self) -> None:
        self.normal_active -= 1
        self.circuit.success()
        self.ref.failures, self.ref.opened_at = 0, None
        if self.ref.probe_out:  # a success closes the circuit whoever reports it
            self.ref.probe_out = False
            self.probe_active = False

    @precondition(lambda self: self.normal_active > 0)
    @rule()
    def request_fails(self) -> None:
        self.normal_active -= 1
        self.circuit.failure()
        if self.ref.opened_at is None:
            self.ref.failures += 1
            if self.ref.failures >= THRESHOLD:
                self.ref.opened_at, self.ref.failures, self.ref.probe_out = self.now, 0, False
                self.probe_active = False

    @invariant()
    def agrees_with_the_reference(self) -> None:
        assert self.circuit.state is self.ref.state(self.now)
        assert self.circuit.is_open == (self.ref.opened_at is not None)

    @invariant()
    def an_open_circuit_always_lets_a_probe_through_after_open_s(self) -> None:
        if self.ref.opened_at is not None and not self.ref.probe_out:
            saved = self.now
            self.now = max(self.now, self.ref.opened_at + OPEN_S + 1e-6)
            assert self.circuit.state is State.HALF_OPEN
            self.now = saved


TestCircuitModel = CircuitMachine.TestCase
TestCircuitModel.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_waiters_are_woken_when_it_opens_and_the_probe_after_it_is_not():
    """The defect of 2026-12-01 at the event level: the trip event stayed set after the
    circuit opened, so the probe's own wait returned at once and the probe gave up."""

    async def go():
        now = [0.0]
        c = Circuit(1.0, 1, clock=lambda: now[0])
        waiter = asyncio.ensure_future(c.tripped())
        await asyncio.sleep(0)
        c.failure()
        await asyncio.wait_for(waiter, 1.0)  # woken by the opening
        now[0] = 2.0
        assert c.allow() and c.probing
        probe_wait = asyncio.ensure_future(c.tripped())
        await asyncio.sleep(0.01)
        assert not probe_wait.done()  # nothing opened since: the probe keeps waiting for its answer
        c.success()
        probe_wait.cancel()
        assert c.state is State.CLOSED

    asyncio.run(go())


def test_failures_in_a_row_open_it_and_a_success_between_them_resets_the_count():
    c = Circuit(10.0, 3, clock=lambda: 0.0)
    c.failure(), c.failure(), c.success(), c.failure(), c.failure()
    assert c.state is State.CLOSED
    c.failure()
    assert c.state is State.OPEN and not c.allow()
