"""Per-key model access, request and token limits, budgets, and per-key usage, for the ingress.

What flows through here: each authenticated request's API key -> its key id (`k-` + 12 hex
of its SHA-256; the raw key never leaves the ingress), the model it asks for and an estimate
of its tokens -> `LimitsConfig.may_use`: may the key use that model (`limits.keys.<id>.models`;
an adapter `<model>:<adapter>` when its base model is) -> `Limiter.admit` asks ONE named Ray
actor (the ledger, serving/ingress/ledger.py: shared by every ingress replica of the
application, of every code version, so the counts hold across replicas and rollouts) whether
the key's budget for the day or month is not yet spent (`limits.keys.<id>.budget`) and it is
still under its requests-per-minute and tokens-per-minute limits on that model -> a 429 with
Retry-After, or a reservation -> when the answer is complete, `Reservation.settle` replaces
the estimate with the tokens really used and adds the request's cost to the key's spend (keys
holding no reservation send their spend in batches: `Limiter.record`), and `UsageMeter`
counts requests, prompt, completion and cached tokens and the cost per key id, model and
destination (cluster or fallback) as Ray metrics (Prometheus, through Ray's metrics port).

The limits of key k on model m are k's own (`limits.keys`), else the model's
(`limits.models`), else the defaults. Windows are counted per (key id, base model id): a
key's budget on one model is apart from its budget on another, because a cheap model's
traffic must not starve the key's access to another model, and a token costs differently
on each model (so one per-key budget across models would mean nothing). An adapter's
requests count on its base model's window: adapters share the base model's engines.

Windows are sliding minutes in one-second buckets. Tokens are reserved at admission
(prompt estimate + the output cap the engine will apply, times n) and corrected when the
request ends, so a burst of concurrent requests cannot spend a minute's budget many times
over before any finishes. Each reservation has an id of this replica's making, sent with the
admit; it is settled exactly once (pipeline.py), through the handle that carried the admit
(Ray keeps one caller's calls in order), whatever happened meanwhile: the admit answered; or
it did not answer within `LEDGER_TIMEOUT_S` and the request went on by the policy below (the
settle corrects the reservation if the admit landed late, or counts the tokens used if it
never did); or the policy refused the request (the reservation is released, so a late admit
counts nothing); or the replica's handle was dropped and looked up again meanwhile.
The ledger is looked up in a thread (creating or finding a named actor blocks on the GCS)
and asked with a deadline (`LEDGER_TIMEOUT_S`). While it does not answer,
`limits.whenLedgerUnreachable` decides, without asking again for `LEDGER_RETRY_S`: "allow"
(the default: served, counted only if the ledger was asked; a limiter outage is no serving
outage) or "refuse" (503 with Retry-After, limits never exceeded); `pd_limiter_errors`
counts each such decision.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from serving.core import metrics
from serving.core.calls import in_background
from serving.ingress.ledger import WINDOW_S, Decision, KeyLimit, LimitsLedger, SlidingWindows, get_ledger
from serving.ingress.sse import CHARS_PER_TOKEN
from serving.ingress.windows import BUDGET, Spend
from serving.spec import base_model_id

logger = logging.getLogger("ray.serve")

# The ledger's names, where the limiter's callers have always found them.
__all__ = ["BUDGET", "WINDOW_S", "Decision", "KeyLimit", "LimitsLedger", "SlidingWindows", "Spend", "get_ledger"]

LEDGER_TIMEOUT_S = 1.0
# After the ledger failed to answer: decide by the policy, without asking, for this long.
LEDGER_RETRY_S = 5.0
# How long a reconfiguration waits for a new ledger actor to start and answer.
LEDGER_START_S = 30.0
ALLOW, REFUSE = "allow", "refuse"
# Decision.limit of a refusal because the ledger could not be asked (policy "refuse").
UNCHECKED = "unchecked"
# budget.when_exceeded: the external fallback serves a key past its budget (else refuse, or a model id).
OVER_BUDGET_FALLBACK = "fallback"
# cache_isolation: each key (or its cache group) its own prefix cache, or one for every key.
ISOLATE_KEYS, SHARED_CACHE = "key", "shared"
# How long a replica keeps the spend of keys without a reservation before sending it (batched).
SPEND_FLUSH_S = 1.0


def _rates(cfg: Mapping[str, Any]) -> KeyLimit:
    return KeyLimit(int(cfg.get("requests_per_minute") or 0), int(cfg.get("tokens_per_minute") or 0))


@dataclass(frozen=True)
class Budget:
    """A key's spend cap (limits.keys.<id>.budget): USD per UTC "day" or "month", and what its
    requests get past it ("refuse", OVER_BUDGET_FALLBACK, or a model id)."""

    usd: float
    period: str
    when_exceeded: str = REFUSE

    def wire(self) -> list[Any]:
        return [self.usd, self.period]


@dataclass(frozen=True)
class LimitsConfig:
    """The ingress user_config's `limits` (ServingSpec.ingress_user_config renders it)."""

    default: KeyLimit
    keys: Mapping[str, KeyLimit]  # the keys with limits of their own
    when_ledger_unreachable: str = ALLOW
    models: Mapping[str, KeyLimit] = field(default_factory=dict)  # every other key's, per model id
    access: Mapping[str, frozenset[str]] = field(default_factory=dict)  # key id -> its models (absent: all)
    budgets: Mapping[str, Budget] = field(default_factory=dict)  # key id -> its budget
    cache_isolation: str = ISOLATE_KEYS
    cache_groups: Mapping[str, str] = field(default_factory=dict)  # key id -> the group whose cache it shares

    @classmethod
    def from_user_config(cls, cfg: Mapping[str, Any] | None) -> LimitsConfig:
        cfg = cfg or {}
        entries: Mapping[str, Mapping[str, Any]] = cfg.get("keys") or {}
        # An entry names its own limits, its models, its budget, its cache group, or several
        # (one without limits keeps the limits every key has).
        keys = {k: _rates(v) for k, v in entries.items() if "requests_per_minute" in v or "tokens_per_minute" in v}
        access = {k: frozenset(v["models"]) for k, v in entries.items() if v.get("models") is not None}
        budgets = {
            k: Budget(float(b["usd"]), str(b.get("period") or "month"), str(b.get("when_exceeded") or REFUSE))
            for k, v in entries.items()
            if (b := v.get("budget"))
        }
        groups = {k: str(v["cache_group"]) for k, v in entries.items() if v.get("cache_group")}
        models = {m: _rates(v) for m, v in (cfg.get("models") or {}).items()}
        policy = str(cfg.get("when_ledger_unreachable") or ALLOW)
        if policy not in (ALLOW, REFUSE):
            raise ValueError(f"limits.when_ledger_unreachable {policy!r} is not {ALLOW!r} or {REFUSE!r}")
        isolation = str(cfg.get("cache_isolation") or ISOLATE_KEYS)
        if isolation not in (ISOLATE_KEYS, SHARED_CACHE):
            raise ValueError(f"limits.cache_isolation {isolation!r} is not {ISOLATE_KEYS!r} or {SHARED_CACHE!r}")
        return cls(_rates(cfg), keys, policy, models, access, budgets, isolation, groups)

    def for_key(self, kid: str, model: str) -> KeyLimit:
        """Key `kid`'s limits on `model` (an adapter: on its base model): its own, else the
        model's, else the defaults."""
        own = self.keys.get(kid)
        if own is not None:
            return own
        return self.models.get(base_model_id(model), self.default)

    def may_use(self, kid: str, model: str) -> bool:
        """Whether key `kid` may use `model` (an adapter when its base model is allowed)."""
        allowed = self.access.get(kid)
        return allowed is None or base_model_id(model) in allowed

    @property
    def any(self) -> bool:
        """Whether any key has a limit on any model or a budget (else the ledger is asked only
        for spend)."""
        limited = any(not v.unlimited for v in (self.default, *self.keys.values(), *self.models.values()))
        return limited or bool(self.budgets)


def _chars(value: Any) -> int:
    """Characters of a JSON value a template renders into the prompt (tool definitions,
    documents, a schema): their JSON text, as the tokenizer will see something like it."""
    return len(json.dumps(value, separators=(",", ":"))) if value else 0


def prompt_estimates(body: Mapping[str, Any]) -> list[int]:
    """Estimated prompt tokens of each prompt a chat or completion body carries: a completion
    may hold a list of prompts (each answered apart), a chat one conversation whose tools and
    documents are rendered into it."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [math.ceil(len(prompt) / CHARS_PER_TOKEN)]
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, int) for p in prompt):
            return [len(prompt)]  # one prompt of token ids
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(math.ceil(len(p) / CHARS_PER_TOKEN))
            elif isinstance(p, list):
                out.append(len(p))
        return out or [0]
    chars = 0
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(part.get("text", "")) for part in content if isinstance(part, Mapping))
    chars += _chars(body.get("tools")) + _chars(body.get("documents")) + _chars(body.get("response_format"))
    return [math.ceil(chars / CHARS_PER_TOKEN)]


def estimate_tokens(body: Mapping[str, Any], context_len: int | None = None) -> int:
    """Tokens to reserve for a chat or completion body: what it may cost at most. Each
    prompt's estimate plus its output cap, times `n`; without a cap, what the model's context
    leaves after the prompt (`context_len`, the model's max_model_len; unknown: no output is
    reserved and the request is corrected when it ends). The cap is vLLM's: a chat request's
    max_completion_tokens when set, else max_tokens (vLLM 0.32 ChatCompletionRequest
    build_tok_params). Read from the values as the engine sees them (`engine_view`)."""
    try:
        mct = body.get("max_completion_tokens")
        cap = int(mct if mct is not None else body.get("max_tokens") or 0) or None
        n = max(1, int(body.get("n") or 1))
    except (TypeError, ValueError):
        cap, n = None, 1
    total = 0
    for p in prompt_estimates(body):
        out = cap if cap is not None else max(0, context_len - p) if context_len else 0
        total += p + max(0, out) * n
    return total


# The fields of a request that size its reservation.
SIZING = ("n", "max_tokens", "max_completion_tokens")


def engine_view(body: Mapping[str, Any], typed: Any) -> dict[str, Any]:
    """`body` with the fields that size a reservation as the engine will read them from the
    validated request `typed` (`"3"`, `3.0` and `true` are 3, 3 and 1 there; a completion
    without max_tokens has vLLM's default of 16). Read from the model's fields themselves: vLLM
    marks a chat request's max_tokens deprecated, and reading it as an attribute warns."""
    fields = getattr(typed, "__dict__", {})
    return {**body, **{k: fields[k] for k in SIZING if k in fields}}


async def _awaited(ref: Any) -> Any:
    return await ref


UNREACHABLE_MESSAGE = "Rate limits cannot be checked right now; retry shortly."


class Limiter:
    """The ingress side: one per replica; asks the ledger only for keys that have limits."""

    def __init__(
        self,
        config: LimitsConfig,
        ledger_factory: Callable[[], Any],
        metrics: UsageMeter,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._factory = ledger_factory
        self._ledger: Any = None
        self._metrics = metrics
        self._clock = clock
        self._down_until = 0.0  # while the ledger is known unreachable: decide by the policy
        # Reservation ids: this replica's, then a serial number.
        self._replica = uuid.uuid4().hex[:12]
        self._serial = itertools.count(1)
        # The spend of requests without a reservation, per key, until the next flush.
        self._pending: dict[str, Spend] = {}
        self._flushed = clock()
        self._flushing = False

    async def _handle(self) -> Any:
        if self._ledger is None:
            self._ledger = await asyncio.to_thread(self._factory)
        return self._ledger

    async def warm_up(self, timeout_s: float = LEDGER_START_S) -> bool:
        """Create or find the ledger and wait until it answers (a new actor takes seconds to
        start: that is not an outage). Called when limits are configured, before traffic."""
        try:
            ledger = await asyncio.wait_for(self._handle(), timeout_s)
            await asyncio.wait_for(_awaited(ledger.totals.remote("warm-up", "")), timeout_s)
        except Exception as exc:
            logger.warning("limits ledger not ready after %.0fs: %r", timeout_s, exc)
            self._ledger = None
            return False
        self._down_until = 0.0
        return True

    def _unreachable(self, exc: BaseException | None) -> Decision:
        if exc is not None:
            logger.warning(
                "limits ledger unreachable (%r); %s requests of limited keys for %.0fs",
                exc,
                "letting through" if self.config.when_ledger_unreachable == ALLOW else "refusing",
                LEDGER_RETRY_S,
            )
            self._ledger = None  # look it up again (it may have restarted)
            self._down_until = self._clock() + LEDGER_RETRY_S
        self._metrics.limiter_error()
        if self.config.when_ledger_unreachable == REFUSE:
            return Decision(False, int(LEDGER_RETRY_S), UNCHECKED, UNREACHABLE_MESSAGE)
        return Decision(True)

    async def admit(
        self,
        kid: str,
        model: str,
        body: Mapping[str, Any],
        context_len: int | None = None,
        *,
        budget: bool = True,
    ) -> Decision:
        """Count a request of key `kid` on `model` (the body's, adapter included) in the
        window of (kid, base model), or refuse it: its budget spent (unless `budget` is False:
        a request overflowing past the budget), or a window full. `context_len`: the model's
        context, what a request without max_tokens may generate up to. An admitted request's
        Decision carries its reservation (ticket, and the handle that carried it) for `settle`."""
        limit = self.config.for_key(kid, model)
        cap = self.config.budgets.get(kid) if budget else None
        if limit.unlimited and cap is None:
            return Decision(True)
        if self._clock() < self._down_until:
            return self._unreachable(None)
        tokens = estimate_tokens(body, context_len) if limit.tokens_per_minute > 0 else 0
        base = base_model_id(model)
        try:
            ledger = await asyncio.wait_for(self._handle(), LEDGER_TIMEOUT_S)
        except Exception as exc:
            return self._unreachable(exc)  # never asked: nothing to settle
        rid = f"{self._replica}-{next(self._serial)}"
        rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
        try:
            ref = ledger.admit.remote(kid, base, rpm, tpm, tokens, rid, cap.wire() if cap else None)
            decision = await asyncio.wait_for(_awaited(ref), LEDGER_TIMEOUT_S)
        except Exception as exc:
            # The admit may still land: its reservation is settled (allowed) or released
            # (refused) through the same handle, after it.
            decision = self._unreachable(exc)
            if decision.ok:
                return replace(decision, ticket=rid, ledger=ledger)
            self._send(ledger, "release", kid, base, rid)
            return decision
        if not decision.ok:
            if decision.limit != BUDGET:  # a budget refusal may still overflow: the pipeline counts it
                self._metrics.rate_limited(kid, base, decision.limit or "")
            return decision
        return replace(decision, ledger=ledger)

    def refused(self, kid: str, model: str, decision: Decision) -> None:
        """Count a refusal the pipeline sends (a budget's, which `admit` leaves uncounted)."""
        self._metrics.rate_limited(kid, base_model_id(model), decision.limit or "")

    def overflowed(self, kid: str, model: str, to: str) -> None:
        """Count a request of a key past its budget served by `to` (a model id, or fallback)."""
        self._metrics.over_budget(kid, model, to)

    def settle(self, kid: str, model: str, decision: Decision, used: int, spend: Spend | None = None) -> None:
        """Replace an admitted request's reservation by the tokens it used and add its `spend`
        to the key's, through the handle that carried its admit (this replica's handle may have
        been dropped since); a request that holds no reservation has its spend recorded in the
        next batch. Fire and forget: the answer has been sent already."""
        if decision.ticket is None:
            if spend is not None:
                self.record(kid, spend)
            return
        wire = list(spend) if spend is not None else None
        self._send(decision.ledger or self._ledger, "settle", kid, base_model_id(model), decision.ticket, used, wire)

    def record(self, kid: str, spend: Spend) -> None:
        """Add the spend of a request without a reservation to this replica's batch, sent to the
        ledger once SPEND_FLUSH_S has passed since the last (`flush`)."""
        self._pending[kid] = self._pending.get(kid, Spend()).plus(spend)
        if self._clock() - self._flushed >= SPEND_FLUSH_S and not self._flushing:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop to send from: the next request's record sends it
            self._flushing = True
            in_background(self.flush())

    async def flush(self) -> None:
        """Send the batched spend to the ledger (lost, and logged, if it cannot be reached)."""
        try:
            if not self._pending:
                return
            rows = [[kid, *spend] for kid, spend in self._pending.items()]
            self._pending, self._flushed = {}, self._clock()
            try:
                ledger = await asyncio.wait_for(self._handle(), LEDGER_TIMEOUT_S)
            except Exception as exc:
                logger.warning("limits ledger unreachable: spend of %d key(s) not recorded: %r", len(rows), exc)
                return
            self._send(ledger, "record", rows)
        finally:
            self._flushing = False

    async def spend(self, kid: str) -> dict[str, Any]:
        """Key `kid`'s spend in the current UTC day and month, as the ledger holds it (this
        replica's batch sent first). Raises when the ledger does not answer in time."""
        await self.flush()
        ledger = await asyncio.wait_for(self._handle(), LEDGER_TIMEOUT_S)
        report: dict[str, Any] = await asyncio.wait_for(_awaited(ledger.spend.remote(kid)), LEDGER_TIMEOUT_S)
        return report

    @staticmethod
    def _send(ledger: Any, call: str, *args: Any) -> None:
        if ledger is None:
            logger.warning("limits ledger %s of %s not sent: no ledger handle", call, args[2:3])
            return
        try:
            getattr(ledger, call).remote(*args)
        except Exception as exc:
            logger.warning("limits ledger %s failed: %r", call, exc)


@dataclass
class Reservation:
    """One admitted request's place in its key's window: settled exactly once, whatever the
    request's fate (answered, refused by the cluster, handed to the fallback, cut, failed),
    with the tokens really used (0 for a request that generated nothing). The pipeline
    settles what is still open when the request leaves it (serving/ingress/pipeline.py)."""

    limiter: Limiter
    kid: str
    model: str
    decision: Decision
    settled: bool = False

    def settle(self, used: int, spend: Spend | None = None) -> None:
        if self.settled:
            return
        self.settled = True
        self.limiter.settle(self.kid, self.model, self.decision, used, spend)


# --- usage metrics --------------------------------------------------------------------------------
class UsageMeter:
    """Counters per key id, model and destination, exported on Ray's metrics port
    (declared in serving/core/metrics.py).

    Usage counts the model as the client asked for it (`<model>:<adapter>` for an adapter):
    what a key spent on each adapter is what a bill per adapter needs. 429s count the base
    model, whose window was full.
    """

    def __init__(self) -> None:
        self._requests = metrics.counter(metrics.USAGE_REQUESTS)
        self._prompt = metrics.counter(metrics.USAGE_PROMPT_TOKENS)
        self._completion = metrics.counter(metrics.USAGE_COMPLETION_TOKENS)
        self._cached = metrics.counter(metrics.USAGE_CACHED_TOKENS)
        self._cost = metrics.counter(metrics.USAGE_COST)
        self._limited = metrics.counter(metrics.RATE_LIMITED)
        self._overflows = metrics.counter(metrics.BUDGET_OVERFLOWS)
        self._fallback = metrics.counter(metrics.FALLBACKS)
        self._limiter_errors = metrics.counter(metrics.LIMITER_ERRORS)

    def served(
        self,
        kid: str,
        model: str,
        destination: str,
        prompt: int,
        completion: int,
        cached: int = 0,
        cost: tuple[float, float] | None = None,
    ) -> None:
        """One answered request: its tokens, and its cost (prefill, decode) in USD when priced."""
        tags = {"key": kid, "model": model, "destination": destination}
        self._requests.inc(1, tags)
        metrics.add(self._prompt, prompt, tags)
        metrics.add(self._completion, completion, tags)
        metrics.add(self._cached, cached, tags)
        if cost is not None:
            for phase, usd in zip(metrics.CostPhase, cost, strict=True):
                metrics.add(self._cost, usd, {**tags, "phase": phase.value})

    def over_budget(self, kid: str, model: str, to: str) -> None:
        self._overflows.inc(1, {"key": kid, "model": model, "to": to})

    def rate_limited(self, kid: str, model: str, limit: str) -> None:
        self._limited.inc(1, {"key": kid, "model": model, "limit": limit})

    def fallback(self, reason: str, outcome: str) -> None:
        self._fallback.inc(1, {"reason": reason, "outcome": outcome})

    def limiter_error(self) -> None:
        self._limiter_errors.inc(1)
