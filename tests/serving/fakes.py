"""Stand-ins for Serve's response streams and Ray's ErrorResponse, shared by the resilience
tests (serving/core/failures.py, prefill_hop.py, ingress_resilience.py), and the real limits
ledger behind an actor handle's `.method.remote()` (test_limits.py, test_hybrid.py): no Ray
started.

Each fake stream behaves like a Serve DeploymentResponseGenerator: async-iterable, with
.cancel() and the router's assignment step; it can fail, hang or answer.
"""

from __future__ import annotations

import asyncio

from serving.ingress.limits import LimitsLedger
from serving.spec import ResilienceSpec

# Small deadlines for the fakes (model_construct: the spec's ordering checks are for stack files).
CFG = ResilienceSpec.model_construct(
    prefill_timeout_s=0.2,
    prefill_queue_timeout_s=0.3,
    prefill_attempts=2,
    kv_ready_timeout_s=0.2,
    first_token_timeout_s=0.5,
    total_timeout_s=2.0,
    fail_fast_s=0.1,
    decode_attempts=2,
    migrations=2,
    stall_timeout_s=0.5,
    circuit_open_s=10.0,
    circuit_failures=3,
    retry_after_s=1,
    cold_start_retry_after_s=None,
)


class Err:
    """Stands in for Ray's ErrorResponse."""

    def __init__(self, code: int):
        self.code = code


def is_err(x) -> bool:
    return isinstance(x, Err)


def is_5xx(x) -> bool:
    return isinstance(x, Err) and x.code >= 500


class FakeStream:
    """items: values to yield; an Exception instance is raised; "hang" waits forever."""

    def __init__(self, items, *, assigned=True, assign_after_s=0.0):
        self.items = list(items)
        self.cancelled = False
        self.closed = False
        self.assigned = assigned
        self.assign_after_s = assign_after_s

    async def _fetch_future_result_async(self):
        """Like Serve's: returns once a replica took the call (never, with no replica)."""
        if not self.assigned:
            await asyncio.Event().wait()
        await asyncio.sleep(self.assign_after_s)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item == "hang":
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True

    async def aclose(self):
        self.closed = True


def run(coro):
    return asyncio.run(coro)


async def collect(agen):
    return [x async for x in agen]


class _Done:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def get():
            return self.value

        return get().__await__()


class LocalLedger:
    """serving.ingress.limits.LimitsLedger called in this process as its actor handle would be
    (`ledger.admit.remote(...)` returns an awaitable): the real windows, no Ray."""

    def __init__(self):
        self.actor = LimitsLedger()
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        method = getattr(self.actor, name)
        outer = self

        class _Method:
            def remote(self, *args):
                outer.calls.append((name, *args))
                return _Done(method(*args))

        return _Method()
