"""The limits ledger's arithmetic, pure (the actor in serving/ingress/ledger.py only holds it):
sliding one-minute windows of requests and tokens, and what each key spent per UTC day and
month against its budget.

What flows through here: an admission (a key, the time, its limits, the tokens it reserves)
-> a Decision (counted, or refused with the seconds until there is room); a settle or release
-> the reservation corrected; a request's cost and tokens -> the key's day and month (`SpendBook`),
and an admission of a key with a budget -> refused from the moment the period's spend reaches
the budget (`Retry-After` until the period's end, when the spend starts again from zero).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

WINDOW_S = 60
# Decision.limit of a refusal because the key's budget is spent.
BUDGET = "budget"
DAY, MONTH = "day", "month"
PERIODS = (DAY, MONTH)


@dataclass(frozen=True)
class KeyLimit:
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute <= 0 and self.tokens_per_minute <= 0


@dataclass(frozen=True)
class Decision:
    ok: bool
    retry_after_s: int = 0
    limit: str | None = None  # "rpm", "tpm" or "budget" when refused
    message: str = ""
    # Counted: the windows' (second of admission, tokens reserved); the ledger's answer carries
    # the reservation's id instead.
    ticket: tuple[int, int] | str | None = None
    # The ledger handle that was asked (set by the ingress): the settle goes the same way.
    ledger: Any = field(default=None, compare=False, repr=False)


# --- the window arithmetic (pure; the actor only holds it) ------------------------------------
class SlidingWindows:
    """Sliding one-minute windows of (requests, tokens) per key (any hashable: the ledger's
    are (key id, model id)), in one-second buckets."""

    def __init__(self, window_s: int = WINDOW_S):
        self.window_s = window_s
        # key -> deque of [second, requests, tokens], oldest first
        self._buckets: dict[Hashable, deque[list[int]]] = {}

    def _trim(self, key: Hashable, now_s: int) -> deque[list[int]]:
        q = self._buckets.setdefault(key, deque())
        while q and q[0][0] <= now_s - self.window_s:
            q.popleft()
        return q

    def _bucket(self, q: deque[list[int]], now_s: int) -> list[int]:
        if not q or q[-1][0] != now_s:
            q.append([now_s, 0, 0])
        return q[-1]

    def totals(self, key: Hashable, now_s: int) -> tuple[int, int]:
        q = self._trim(key, now_s)
        return sum(b[1] for b in q), sum(b[2] for b in q)

    def _seconds_until(self, q: deque[list[int]], idx: int, most: int, now_s: int) -> int:
        """Seconds until the window's sum of column `idx` is at most `most`, as buckets leave."""
        total = sum(b[idx] for b in q)
        for b in q:
            if total <= most:
                break
            total -= b[idx]
            if total <= most:
                return max(1, b[0] + self.window_s - now_s)
        return 1 if total <= most else self.window_s

    def admit(self, key: Hashable, now: float, limit: KeyLimit, tokens: int, subject: str = "this API key") -> Decision:
        """Count one request of `tokens` in `key`'s window, or refuse it; `subject` names
        whose limit it is in the refusal's message."""
        now_s = int(now)
        q = self._trim(key, now_s)
        reqs, toks = sum(b[1] for b in q), sum(b[2] for b in q)
        rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
        if rpm > 0 and reqs + 1 > rpm:
            wait = self._seconds_until(q, 1, rpm - 1, now_s)
            return Decision(False, wait, "rpm", f"Rate limit reached: {rpm} requests per minute for {subject}.")
        if tpm > 0 and tokens > tpm:
            # It can never fit: waiting does not help, a smaller max_tokens does.
            return Decision(
                False,
                self.window_s,
                "tpm",
                f"Request too large: it may use up to {tokens} tokens (prompt and max_tokens), over the limit "
                f"of {tpm} tokens per minute for {subject}; send a smaller max_tokens.",
            )
        if tpm > 0 and toks + tokens > tpm:
            # The reservation would overspend the budget (reservations included): wait until
            # enough of it leaves.
            wait = self._seconds_until(q, 2, tpm - tokens, now_s)
            return Decision(False, wait, "tpm", f"Rate limit reached: {tpm} tokens per minute for {subject}.")
        b = self._bucket(q, now_s)
        b[1] += 1
        b[2] += tokens
        return Decision(True, ticket=(now_s, tokens))

    def settle(self, key: Hashable, now: float, ticket: tuple[int, int], used: int) -> None:
        """Replace a reservation by the tokens really used."""
        admitted_s, reserved = ticket
        b = self._at(key, now, admitted_s)
        if b is not None:
            b[2] += used - reserved
        else:
            # The reservation already left the window (a request longer than a minute): the
            # tokens were spent now.
            self.charge(key, now, used)

    def release(self, key: Hashable, now: float, ticket: tuple[int, int]) -> None:
        """Take an admitted request out again: its request and its reservation."""
        b = self._at(key, now, ticket[0])
        if b is not None:
            b[1] -= 1
            b[2] -= ticket[1]

    def charge(self, key: Hashable, now: float, tokens: int) -> None:
        """Tokens spent now by a request that holds no reservation."""
        now_s = int(now)
        self._bucket(self._trim(key, now_s), now_s)[2] += tokens

    def _at(self, key: Hashable, now: float, second: int) -> list[int] | None:
        return next((b for b in self._trim(key, int(now)) if b[0] == second), None)

    def forget_idle(self, now: float) -> None:
        now_s = int(now)
        for key in [k for k, q in self._buckets.items() if not q or q[-1][0] <= now_s - self.window_s]:
            del self._buckets[key]

    def export(self) -> list[tuple[Hashable, list[list[int]]]]:
        return [(k, [list(b) for b in q]) for k, q in self._buckets.items() if q]

    def load(self, rows: list[tuple[Hashable, list[list[int]]]]) -> None:
        """Add exported windows to these (a ledger taking over from another)."""
        for key, buckets in rows:
            q = self._buckets.setdefault(key, deque())
            merged = {b[0]: b for b in q}
            for second, reqs, toks in buckets:
                b = merged.setdefault(second, [second, 0, 0])
                b[1] += reqs
                b[2] += toks
            self._buckets[key] = deque(sorted(merged.values()))


# --- spend per key, per UTC day and month --------------------------------------------------------
class Spend(NamedTuple):
    """What requests used and cost: USD, requests, prompt, completion and cached prompt tokens."""

    usd: float = 0.0
    requests: int = 0
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def plus(self, other: Iterable[float]) -> Spend:
        """This and `other` (a Spend, or its values in order; missing ones count as 0)."""
        o = [*other, 0, 0, 0, 0, 0]
        return Spend(
            self.usd + float(o[0]),
            self.requests + int(o[1]),
            self.prompt + int(o[2]),
            self.completion + int(o[3]),
            self.cached + int(o[4]),
        )


def period_bounds(period: str, now: float) -> tuple[float, float, str]:
    """(start, end, name) of the UTC calendar `period` ("day" or "month") holding `now`."""
    t = datetime.fromtimestamp(now, UTC)
    if period == DAY:
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86400, UTC)
        return start.timestamp(), end.timestamp(), f"{DAY}:{start:%Y-%m-%d}"
    if period != MONTH:
        raise ValueError(f"budget period {period!r} is not {DAY!r} or {MONTH!r}")
    start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start.timestamp(), end.timestamp(), f"{MONTH}:{start:%Y-%m}"


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class SpendBook:
    """Per key id, its Spend in the current UTC day and month (and the period before each,
    until it is tidied away). A budget counts settled spend only: a request is admitted while
    the period's spend is under the budget, so the first request after the spend reaches it is
    refused, and requests in flight at that moment are counted when they end."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Spend]] = {}  # kid -> period name -> spend

    def add(self, kid: str, now: float, spend: Iterable[float]) -> None:
        rows = self._rows.setdefault(kid, {})
        for period in PERIODS:
            name = period_bounds(period, now)[2]
            rows[name] = rows.get(name, Spend()).plus(spend)

    def spent(self, kid: str, period: str, now: float) -> Spend:
        return self._rows.get(kid, {}).get(period_bounds(period, now)[2], Spend())

    def refusal(self, kid: str, usd: float, period: str, now: float) -> Decision | None:
        """The 429 for a key whose `period` spend reached its budget of `usd`, else None."""
        spent = self.spent(kid, period, now).usd
        if spent < usd:
            return None
        _, end, _ = period_bounds(period, now)
        every = "daily" if period == DAY else "monthly"
        return Decision(
            False,
            max(1, math.ceil(end - now)),
            BUDGET,
            f"Budget exceeded: this API key has spent ${spent:,.2f} of its {every} budget of ${usd:,.2f}; "
            f"it resets at {_utc(end)}.",
        )

    def report(self, kid: str, now: float) -> dict[str, Any]:
        """The key's spend in the current day and month, with each period's bounds."""
        out: dict[str, Any] = {}
        for period in PERIODS:
            start, end, _ = period_bounds(period, now)
            out[period] = {"start": _utc(start), "end": _utc(end), **self.spent(kid, period, now)._asdict()}
        return out

    def tidy(self, now: float) -> None:
        """Keep the current periods only (a period's last spend was settled into it already)."""
        current = {period_bounds(p, now)[2] for p in PERIODS}
        for kid in list(self._rows):
            rows = {n: s for n, s in self._rows[kid].items() if n in current}
            if rows:
                self._rows[kid] = rows
            else:
                del self._rows[kid]

    def export(self) -> list[list[Any]]:
        return [[kid, name, list(s)] for kid, rows in self._rows.items() for name, s in rows.items()]

    def load(self, rows: Iterable[list[Any]]) -> None:
        """Add exported spend to this book (a ledger taking over, or restarting)."""
        for kid, name, values in rows:
            mine = self._rows.setdefault(kid, {})
            mine[name] = mine.get(name, Spend()).plus(values)
