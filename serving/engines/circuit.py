"""The prefill circuit breaker of a decode replica: remote prefill on, off, or being probed.

What flows through here: the verdict of every remote prefill call this decode replica makes
(success, a failure of the prefill tier, or no verdict: the call was cancelled, the tier was
busy, or the call failed on the request's own error, serving/core/failures.py
`prefill_failure`) -> the circuit's state ->
`allow()`, asked before each call: may this request try the remote prefill, or does it
prefill locally on decode (the P/D stack then serves that request aggregated)?

States (a classic breaker, Nygard's "Release It!", with a count threshold):
  closed     every request tries remote prefill; `failures_to_open` failures in a row open it
             (one slow or failed call is not enough: under load a timeout is often queueing;
             and a call that ran out its deadline while another call was answered is not
             counted at all: the tier is busy, not broken, see `answered_since`);
  open       requests skip remote prefill for `open_s`; requests already waiting on a prefill
             stop waiting the moment it opens (`tripped()`);
  half-open  after `open_s`, exactly one request (the probe) tries remote prefill: its success
             closes the circuit, its failure opens it again for another `open_s`, and a probe
             that ends without a verdict (cancelled) frees the slot for the next request.

The invariant the review of 2026-12-01 found broken (a circuit that never closed again, so a
P/D stack silently served aggregated for good): after `open_s` a probe is always let through,
and a successful probe always closes the circuit. tests/serving/engines/test_circuit.py checks it
against a reference state machine over arbitrary sequences of events (hypothesis).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable


class State(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # open_s has passed; the next allowed request is the probe


class Circuit:
    """Remote prefill on/off for one decode replica (one per replica, its event loop only)."""

    def __init__(self, open_s: float, failures_to_open: int = 3, clock: Callable[[], float] = time.monotonic):
        if open_s <= 0 or failures_to_open < 1:
            raise ValueError("Circuit: open_s must be > 0 and failures_to_open >= 1")
        self.open_s = open_s
        self.failures_to_open = failures_to_open
        self._clock = clock
        self._failures = 0  # consecutive failures while closed
        self._answered_at = -float("inf")  # the last success()
        self._opened_at: float | None = None
        self._probing = False
        # Set when the circuit opens, then replaced: waiters of one closed period are woken
        # once; a later waiter (the probe) waits for the next opening, not the last one.
        self._tripped: asyncio.Event | None = None

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return State.CLOSED
        if self._probing or self._clock() - self._opened_at < self.open_s:
            return State.OPEN
        return State.HALF_OPEN

    @property
    def is_open(self) -> bool:
        """True while remote prefill is off or being probed (not closed)."""
        return self._opened_at is not None

    @property
    def probing(self) -> bool:
        return self._probing

    def allow(self) -> bool:
        """May this request try the remote prefill? True for every request while closed, and
        for exactly one (the probe) once `open_s` has passed; the caller must then report
        `success()`, `failure(probe=True)` or `release()`."""
        state = self.state
        if state is State.CLOSED:
            return True
        if state is State.OPEN:
            return False
        self._probing = True
        return True

    def now(self) -> float:
        return self._clock()

    def answered_since(self, t: float) -> bool:
        """Has a remote prefill succeeded after `t` (a call's start)? A call that timed out
        while others were answered waited in a busy tier (a prefill engine's own queue after
        its replica took the call); a stalled or dead tier answers none."""
        return self._answered_at > t

    def success(self) -> None:
        """A remote prefill worked: the circuit closes (whoever reports it)."""
        self._answered_at = self._clock()
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def failure(self, probe: bool = False) -> None:
        """A remote prefill failed. While closed it counts towards `failures_to_open`; the
        probe's failure opens the circuit again; a late failure of a request that started
        before the circuit opened changes nothing (the circuit already knows)."""
        if self._opened_at is None:
            self._failures += 1
            if self._failures >= self.failures_to_open:
                self._open()
        elif probe:
            self._open()

    def release(self) -> None:
        """The probe ended without a verdict (cancelled): let another request probe."""
        self._probing = False

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._probing = False
        self._failures = 0
        if self._tripped is not None:
            self._tripped.set()
            self._tripped = None

    async def tripped(self) -> None:
        """Returns when the circuit opens next."""
        if self._tripped is None:
            self._tripped = asyncio.Event()
        await self._tripped.wait()
