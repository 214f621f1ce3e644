"""Per-key model access, request and token limits, and per-key usage, for the ingress.

What flows through here: each authenticated request's API key -> its key id (`k-` + 12 hex
of its SHA-256; the raw key never leaves the ingress), the model it asks for and an estimate
of its tokens -> `LimitsConfig.may_use`: may the key use that model (`limits.keys.<id>.models`;
an adapter `<model>:<adapter>` when its base model is) -> `Limiter.admit` asks ONE named Ray
actor (`LimitsLedger`, shared by every ingress replica of the application, so the counts hold
across replicas) whether the key is still under its requests-per-minute and tokens-per-minute
limits on that model -> a 429 with Retry-After, or a ticket ->
when the answer is complete, `Limiter.settle` replaces the estimate with the tokens really
used, and `UsageMeter` counts requests, prompt and completion tokens per key id, model and
destination (cluster or fallback) as Ray metrics (Prometheus, through Ray's metrics port).

The limits of key k on model m are k's own (`limits.keys`), else the model's
(`limits.models`), else the defaults. Windows are counted per (key id, base model id): a
key's budget on one model is apart from its budget on another, because a cheap model's
traffic must not starve the key's access to another model, and a token costs differently
on each model (so one per-key budget across models would mean nothing). An adapter's
requests count on its base model's window: adapters share the base model's engines.

Windows are sliding minutes in one-second buckets. Tokens are reserved at admission
(prompt estimate + max_tokens) and corrected when the request ends, so a burst of
concurrent requests cannot spend a minute's budget many times over before any finishes.
The ledger is a detached named actor (it outlives the ingress replicas, so the counts do
not reset when one restarts). Its name carries a hash of its own code (`LEDGER_VERSION`), so
a deploy that changes the ledger gets a new actor instead of calling an old one whose
methods no longer match. It is looked up in a thread (creating or finding a named actor
blocks on the GCS) and asked with a deadline (`LEDGER_TIMEOUT_S`). While it does not answer,
`limits.whenLedgerUnreachable` decides, without asking again for `LEDGER_RETRY_S`: "allow"
(the default: served unmetered, a limiter outage is no serving outage) or "refuse" (503 with
Retry-After, limits never exceeded); `pd_limiter_errors` counts each such decision.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.core import metrics
from serving.ingress.sse import CHARS_PER_TOKEN
from serving.spec import base_model_id

logger = logging.getLogger("ray.serve")

WINDOW_S = 60
LEDGER_TIMEOUT_S = 1.0
# After the ledger failed to answer: decide by the policy, without asking, for this long.
LEDGER_RETRY_S = 5.0
# How long a reconfiguration waits for a new ledger actor to start and answer.
LEDGER_START_S = 30.0
ALLOW, REFUSE = "allow", "refuse"
# Decision.limit of a refusal because the ledger could not be asked (policy "refuse").
UNCHECKED = "unchecked"


@dataclass(frozen=True)
class KeyLimit:
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute <= 0 and self.tokens_per_minute <= 0


def _rates(cfg: Mapping[str, Any]) -> KeyLimit:
    return KeyLimit(int(cfg.get("requests_per_minute") or 0), int(cfg.get("tokens_per_minute") or 0))


@dataclass(frozen=True)
class LimitsConfig:
    """The ingress user_config's `limits` (ServingSpec.ingress_user_config renders it)."""

    default: KeyLimit
    keys: Mapping[str, KeyLimit]  # the keys with limits of their own
    when_ledger_unreachable: str = ALLOW
    models: Mapping[str, KeyLimit] = field(default_factory=dict)  # every other key's, per model id
    access: Mapping[str, frozenset[str]] = field(default_factory=dict)  # key id -> its models (absent: all)

    @classmethod
    def from_user_config(cls, cfg: Mapping[str, Any] | None) -> LimitsConfig:
        cfg = cfg or {}
        entries: Mapping[str, Mapping[str, Any]] = cfg.get("keys") or {}
        # An entry names its own limits, its models, or both (one with models only keeps the
        # limits every key has).
        keys = {k: _rates(v) for k, v in entries.items() if "requests_per_minute" in v or "tokens_per_minute" in v}
        access = {k: frozenset(v["models"]) for k, v in entries.items() if v.get("models") is not None}
        models = {m: _rates(v) for m, v in (cfg.get("models") or {}).items()}
        policy = str(cfg.get("when_ledger_unreachable") or ALLOW)
        if policy not in (ALLOW, REFUSE):
            raise ValueError(f"limits.when_ledger_unreachable {policy!r} is not {ALLOW!r} or {REFUSE!r}")
        return cls(_rates(cfg), keys, policy, models, access)

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
        """Whether any key has a limit on any model (else the ledger is never asked)."""
        return any(not v.unlimited for v in (self.default, *self.keys.values(), *self.models.values()))


@dataclass(frozen=True)
class Decision:
    ok: bool
    retry_after_s: int = 0
    limit: str | None = None  # "rpm" or "tpm" when refused
    message: str = ""
    ticket: tuple[int, int] | None = None  # (second of admission, tokens reserved)


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
        now_s = int(now)
        q = self._trim(key, now_s)
        admitted_s, reserved = ticket
        for b in q:
            if b[0] == admitted_s:
                b[2] += used - reserved
                return
        # The reservation already left the window (a request longer than a minute): the
        # tokens were spent now.
        self._bucket(q, now_s)[2] += used

    def forget_idle(self, now: float) -> None:
        now_s = int(now)
        for key in [k for k, q in self._buckets.items() if not q or q[-1][0] <= now_s - self.window_s]:
            del self._buckets[key]


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
    reserved and the request is corrected when it ends)."""
    try:
        cap = int(body.get("max_completion_tokens") or body.get("max_tokens") or 0) or None
        n = max(1, int(body.get("n") or 1))
    except (TypeError, ValueError):
        cap, n = None, 1
    total = 0
    for p in prompt_estimates(body):
        out = cap if cap is not None else max(0, context_len - p) if context_len else 0
        total += p + max(0, out) * n
    return total


# --- the shared ledger --------------------------------------------------------------------------
class LimitsLedger:
    """The Ray actor every ingress replica asks; one per application (a named actor).
    One window per (key id, base model id): see the module docstring."""

    def __init__(self) -> None:
        self._w = SlidingWindows()
        self._calls = 0

    def admit(self, kid: str, model: str, rpm: int, tpm: int, tokens: int) -> Decision:
        self._calls += 1
        if self._calls % 10_000 == 0:
            self._w.forget_idle(time.time())
        subject = f"this API key on model '{model}'"
        return self._w.admit((kid, model), time.time(), KeyLimit(rpm, tpm), tokens, subject)

    def settle(self, kid: str, model: str, ticket: tuple[int, int], used: int) -> None:
        self._w.settle((kid, model), time.time(), ticket, used)

    def totals(self, kid: str, model: str) -> tuple[int, int]:
        return self._w.totals((kid, model), int(time.time()))


def _ledger_version() -> str:
    """A hash of the ledger's own code: the actor's API and window arithmetic."""
    try:
        code = inspect.getsource(LimitsLedger) + inspect.getsource(SlidingWindows)
    except (OSError, TypeError):  # no source on disk (a frozen build): the module's version
        code = __name__ + str(WINDOW_S)
    return hashlib.sha256(code.encode()).hexdigest()[:10]


LEDGER_VERSION = _ledger_version()


def ledger_name(app_name: str) -> str:
    return f"pd-limits-{app_name}-{LEDGER_VERSION}"


def get_ledger(app_name: str, label_selector: Mapping[str, str] | None = None) -> Any:
    """The application's ledger actor, created by whichever ingress replica asks first.

    Detached, so it outlives the replica that created it (replicas come and go; the
    counts must not); named per application and ledger version, so two apps in one cluster
    do not share and a deploy with a changed ledger never calls an old one. Blocks on the
    GCS: call it off the event loop.
    """
    import ray

    opts: dict[str, Any] = {
        "name": ledger_name(app_name),
        "namespace": "serve",
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
    }
    if label_selector:
        opts["label_selector"] = dict(label_selector)
    return ray.remote(LimitsLedger).options(**opts).remote()


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

    async def admit(self, kid: str, model: str, body: Mapping[str, Any], context_len: int | None = None) -> Decision:
        """Count a request of key `kid` on `model` (the body's, adapter included) in the
        window of (kid, base model), or refuse it. `context_len`: the model's context, what
        a request without max_tokens may generate up to."""
        limit = self.config.for_key(kid, model)
        if limit.unlimited:
            return Decision(True)
        if self._clock() < self._down_until:
            return self._unreachable(None)
        tokens = estimate_tokens(body, context_len) if limit.tokens_per_minute > 0 else 0
        base = base_model_id(model)
        try:
            ledger = await asyncio.wait_for(self._handle(), LEDGER_TIMEOUT_S)
            ref = ledger.admit.remote(kid, base, limit.requests_per_minute, limit.tokens_per_minute, tokens)
            decision = await asyncio.wait_for(_awaited(ref), LEDGER_TIMEOUT_S)
        except Exception as exc:
            return self._unreachable(exc)
        if not decision.ok:
            self._metrics.rate_limited(kid, base, decision.limit or "")
        return decision

    def settle(self, kid: str, model: str, decision: Decision, used: int) -> None:
        """Fire and forget: the answer has been sent already."""
        if decision.ticket is None or self._ledger is None:
            return
        try:
            self._ledger.settle.remote(kid, base_model_id(model), decision.ticket, used)
        except Exception as exc:
            logger.warning("limits ledger settle failed: %s", exc)


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

    def settle(self, used: int) -> None:
        if self.settled:
            return
        self.settled = True
        self.limiter.settle(self.kid, self.model, self.decision, used)


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
        self._limited = metrics.counter(metrics.RATE_LIMITED)
        self._fallback = metrics.counter(metrics.FALLBACKS)
        self._limiter_errors = metrics.counter(metrics.LIMITER_ERRORS)

    def served(self, kid: str, model: str, destination: str, prompt: int, completion: int) -> None:
        tags = {"key": kid, "model": model, "destination": destination}
        self._requests.inc(1, tags)
        metrics.add(self._prompt, prompt, tags)
        metrics.add(self._completion, completion, tags)

    def rate_limited(self, kid: str, model: str, limit: str) -> None:
        self._limited.inc(1, {"key": kid, "model": model, "limit": limit})

    def fallback(self, reason: str, outcome: str) -> None:
        self._fallback.inc(1, {"reason": reason, "outcome": outcome})

    def limiter_error(self) -> None:
        self._limiter_errors.inc(1)
