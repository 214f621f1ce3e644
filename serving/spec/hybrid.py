"""The serving spec's parts for hybrid routing: the external fallback and per-key limits.

What flows through here: the `serving.fallback` and `serving.limits` keys of a stack file ->
validated models (a provider's OpenAI-compatible root, model map, when to use it, deadlines,
its price per million tokens; requests and tokens per minute per key id and per model, the
models each key id may use, a key's budget in money and what happens past it, which keys
share a prefix cache, what to do while the ledger is unreachable),
rendered by serving/spec/serving.py into the ingress's `user_config`. Also the key id of an API key
(`k-` + 12 hex of its SHA-256), which stacks and metrics use instead of the key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from enum import Enum
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from serving.spec.base import (
    SpecModel,
)
from serving.spec.models import ADAPTER_SEP, base_model_id

# --- hybrid routing: the external fallback and per-key limits -----------------------------------
# The environment variable holding the fallback provider's API key in the ingress replicas; in
# the cloud it is fed from a Kubernetes Secret (the stack's fallbackApiKey Pulumi secret).
FALLBACK_API_KEY_ENV = "PD_FALLBACK_API_KEY"
# Ray's builders name the ingress deployment after its class (serving.app.AuthenticatedIngress);
# the Serve config addresses it by this name to hand it its user_config.
INGRESS_DEPLOYMENT = "AuthenticatedIngress"
# An API key's id in metric labels and in `limits.keys`: never the key itself.
KEY_ID_RE = re.compile(r"^k-[0-9a-f]{12}$")


def key_id(api_key: str) -> str:
    """`k-` + the first 12 hex digits of the key's SHA-256 (what labels and limits use)."""
    return "k-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


class FallbackWhen(str, Enum):
    UNAVAILABLE = "unavailable"  # an engine deployment has no running replica, or failed before its first byte
    OVERLOADED = "overloaded"  # ongoing requests per decode replica at overflowAt, or Serve's queue is full
    DEADLINE = "deadline"  # a stream's first token did not come within firstTokenTimeoutS


class TokenPrice(SpecModel):
    """What a provider charges per million tokens, in USD (its price list)."""

    prompt_per_million: float = Field(ge=0, description="USD per million prompt (input) tokens.")
    completion_per_million: float = Field(ge=0, description="USD per million completion (output) tokens.")
    cached_prompt_per_million: float | None = Field(
        default=None,
        ge=0,
        description="USD per million prompt tokens the provider served from its cache (default: the prompt price).",
    )


class FallbackSpec(SpecModel):
    """An external OpenAI-compatible API that takes requests the cluster cannot serve."""

    base_url: str = Field(description="The provider's OpenAI-compatible /v1 root, e.g. https://api.example.com/v1.")
    model: str | dict[str, str] = Field(
        description="The provider's model name for serving.model.id, or a map {our model id: theirs}."
    )
    when: list[FallbackWhen] = Field(default_factory=lambda: list(FallbackWhen))
    overflow_at: int | None = Field(
        default=None,
        ge=1,
        description="Ongoing requests per running decode replica at which new requests overflow "
        "to the fallback (default: the decode role's maxOngoingRequests).",
    )
    first_token_timeout_s: float = Field(default=30.0, gt=0, le=600)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=60)
    retries: int = Field(default=2, ge=0, le=5, description="Retries of failed connections (never of answers).")
    prices: dict[str, TokenPrice] = Field(
        default_factory=dict,
        description="Per served model id: the provider's price for that model's requests (what a "
        "fallback request costs its key); a model left out is counted in tokens only.",
    )

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL (an OpenAI-compatible /v1 root)")
        if u.username or u.password:
            raise ValueError("the URL carries credentials: put the key in the fallback API key secret instead")
        if u.query or u.fragment:
            raise ValueError(f"{v!r} has a query or fragment: give the /v1 root only")
        return v.rstrip("/")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | dict[str, str]) -> str | dict[str, str]:
        names = [v] if isinstance(v, str) else [*v.keys(), *v.values()]
        if not names or any(not n.strip() for n in names):
            raise ValueError("model names must not be empty")
        return v

    @field_validator("when")
    @classmethod
    def _when(cls, v: list[FallbackWhen]) -> list[FallbackWhen]:
        if not v:
            raise ValueError("list at least one of unavailable, overloaded, deadline (or drop the fallback section)")
        if len(set(v)) != len(v):
            raise ValueError("an entry is listed twice")
        return v

    @property
    def plain_http(self) -> bool:
        return urlsplit(self.base_url).scheme == "http"

    @property
    def host(self) -> str:
        return urlsplit(self.base_url).hostname or ""

    @property
    def port(self) -> int:
        u = urlsplit(self.base_url)
        return u.port or (80 if u.scheme == "http" else 443)

    def models_for(self, model_id: str) -> dict[str, str]:
        return {model_id: self.model} if isinstance(self.model, str) else dict(self.model)

    def unpriced(self, model_id: str) -> str | None:
        """A model id under `prices` that the fallback does not map (`model_id`: the one-model
        form's), else None."""
        mapped = self.models_for(model_id)
        return next((m for m in self.prices if m not in mapped), None)


class BudgetPeriod(str, Enum):
    DAY = "day"  # a UTC calendar day
    MONTH = "month"  # a UTC calendar month


# `budget.whenExceeded`: refuse (429), the external fallback, or another served model's id.
REFUSE = "refuse"
FALLBACK = "fallback"


class BudgetSpec(SpecModel):
    """A key's spend cap in USD per UTC day or month, over every model it uses: the cluster's
    cost of its requests (engine time at the pools' price) and the provider's for those the
    fallback served. Past it, the key's next request is refused, or overflows."""

    usd: float = Field(gt=0, description="The most the key may spend in one period, in USD.")
    period: BudgetPeriod = BudgetPeriod.MONTH
    when_exceeded: str = Field(
        default=REFUSE,
        description="Past the budget: 'refuse' (429 budget_exceeded, Retry-After at the period's end), "
        "'fallback' (the external provider serves it), or a served model id (a cheaper model serves it).",
    )

    @field_validator("when_exceeded")
    @classmethod
    def _when(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("give 'refuse', 'fallback' or a served model id")
        return v

    @property
    def overflow_model(self) -> str | None:
        """The model id that serves the key past its budget, if `whenExceeded` names one."""
        return None if self.when_exceeded in (REFUSE, FALLBACK) else self.when_exceeded


_GROUP_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class RateLimitSpec(SpecModel):
    """Requests and tokens (prompt + completion) per sliding minute; 0 means no limit."""

    requests_per_minute: int = Field(default=0, ge=0)
    tokens_per_minute: int = Field(default=0, ge=0)


class KeyLimitSpec(SpecModel):
    """One key id's entry in `limits.keys`: its own limits, and the models it may use.

    Naming requestsPerMinute or tokensPerMinute gives the key its own limits on every model
    (the one not named is 0, no limit), replacing `limits.models` and the defaults. An entry
    that names only `models` keeps the limits every other key has: restricting a key's models
    must not lift its limits by accident.
    """

    requests_per_minute: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)
    models: tuple[str, ...] | None = Field(
        default=None,
        description="The served model ids this key may use (absent: every model); an adapter "
        "`<model>:<adapter>` is allowed when its base model is. Any other model answers 404.",
    )
    budget: BudgetSpec | None = Field(default=None, description="The key's spend cap in USD per day or month.")
    cache_group: str | None = Field(
        default=None,
        description="Keys with the same group share one prefix cache (absent: the key has its own).",
    )

    @field_validator("cache_group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        if v is not None and not _GROUP_RE.match(v):
            raise ValueError(f"{v!r} is not a group name (lowercase letters, digits and '-', 1-63)")
        return v

    @field_validator("models")
    @classmethod
    def _models(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("list at least one model id (or drop models: the key may use every model)")
        twice = sorted({m for m in v if v.count(m) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice")
        return v

    @property
    def own_limits(self) -> RateLimitSpec | None:
        """The key's own limits, or None when the entry names neither (it lists only models, a
        budget or a cache group)."""
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            return None
        return RateLimitSpec(
            requests_per_minute=self.requests_per_minute or 0, tokens_per_minute=self.tokens_per_minute or 0
        )


class LimitsSpec(RateLimitSpec):
    """Per-API-key limits and model access. For key k on model m, the limits are k's own
    (`keys`, when its entry names a limit), else `models[m]`, else the defaults above; they
    are counted per (key, model): a key's budget on one model is apart from its budget on
    another. Key ids are `k-` + 12 hex of the key's SHA-256, as in the usage metrics
    (`python -m tools.keyid` prints a key's id)."""

    keys: dict[str, KeyLimitSpec] = Field(default_factory=dict)
    models: dict[str, RateLimitSpec] = Field(
        default_factory=dict,
        description="The limits of every key on a model by its id (a key's own limits replace them).",
    )
    when_ledger_unreachable: Literal["allow", "refuse"] = Field(
        default="allow",
        description="What a limited key's request gets while the shared limits ledger does not answer: "
        "'allow' (served unmetered, counted in pd_limiter_errors: a limiter outage is no serving outage) "
        "or 'refuse' (503 with Retry-After: limits are never exceeded).",
    )
    cache_isolation: Literal["key", "shared"] = Field(
        default="key",
        description="'key': each API key (or its cacheGroup) has a prefix cache of its own: the ingress "
        "salts every request's prefix-cache hashes (vLLM's cache_salt) from the key, so a prompt cached "
        "by one key gives another no hit; 'shared': every key shares one cache (a key can then learn "
        "another's prompt prefixes from cache hits).",
    )

    @field_validator("keys")
    @classmethod
    def _ids(cls, v: dict[str, KeyLimitSpec]) -> dict[str, KeyLimitSpec]:
        bad = [k for k in v if not KEY_ID_RE.match(k)]
        if bad:
            raise ValueError(
                f"{bad[0]!r} is not a key id (k- and 12 hex digits): never put an API key itself in a "
                "stack; get its id with `python -m tools.keyid`"
            )
        return v

    def unknown_model(self, served: Sequence[str]) -> tuple[str, str] | None:
        """(key path under `limits`, message) of the first model id named here that is not
        one of the `served` ids; None when every one is."""
        named = [(f"limits.models.{m}", m) for m in self.models]
        for k, entry in self.keys.items():
            named += [(f"limits.keys.{k}.models[{i}]", m) for i, m in enumerate(entry.models or ())]
            if entry.budget is not None and entry.budget.overflow_model is not None:
                named.append((f"limits.keys.{k}.budget.whenExceeded", entry.budget.overflow_model))
        for path, m in named:
            if m in served:
                continue
            hint = ""
            if ADAPTER_SEP in m and base_model_id(m) in served:
                hint = f"; an adapter is allowed with its base model: list {base_model_id(m)!r}"
            return path, f"{m!r} is not the id of a served model (ids: {', '.join(served)}{hint})"
        return None

    def budget_problem(self, fallback_models: Sequence[str] | None) -> tuple[str, str] | None:
        """(key path under `limits`, message) of the first budget whose overflow cannot be
        served: the fallback without a fallback (`fallback_models`: the model ids it maps, None
        without one), or a model the key may not use; None when every one can."""
        for k, entry in self.keys.items():
            budget = entry.budget
            if budget is None:
                continue
            path = f"limits.keys.{k}.budget.whenExceeded"
            if budget.when_exceeded == FALLBACK and not fallback_models:
                return path, "'fallback' needs serving.fallback (an external provider); or give 'refuse' or a model id"
            over = budget.overflow_model
            if over is not None and entry.models is not None and over not in entry.models:
                return path, f"{over!r} is not one of the models this key may use ({', '.join(entry.models)})"
        return None
