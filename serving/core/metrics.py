"""The serving code's own metrics: one registry of their names, labels and meaning.

What flows through here: nothing per request. Every counter the serving code records is
declared once, here: its name as Ray is told it, its label keys, its description and the
process that records it. The runtime builds its Ray counters from these declarations
(`counter()`: the ingress's usage, limits, fallback, retry, refusal and migration counters,
the decode server's prefill-path counters), and the Pulumi program's dashboards and alerts
read the Prometheus names and label values from here (infra/k8s/serving_metrics.py), so a
renamed counter or label cannot leave a panel reading a series that never comes.

Ray exports an application's counters as `ray_<name>_total` (ray/util/metrics.py `Counter`:
"Since 2.10, this exports both counter (with a suffix "_total") and gauge metrics";
`NAMESPACE = "ray"`, ray/_private/telemetry/open_telemetry_metric_recorder.py, Ray 2.60) and
adds `application`, `deployment` and `replica` labels. A labelled counter has no series until
its first event.

Standard library only at import time (the Pulumi program imports this module; Ray is imported
inside `counter()`, which only replicas call).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

INGRESS = "ingress"  # the OpenAI front door's replicas (the Ray head's pods)
DECODE = "decode"  # the P/D decode server's replicas (decode pods)
KV_SCORER = "kv_scorer"  # the prefill tier's KV scorer (serving/engines/kv_router.py; prefill pods)


@dataclass(frozen=True)
class Metric:
    """One counter of the serving code."""

    name: str  # as declared to Ray
    labels: tuple[str, ...]
    description: str
    recorded_by: str  # INGRESS, DECODE or KV_SCORER

    @property
    def prometheus(self) -> str:
        """The series name Prometheus scrapes."""
        return f"ray_{self.name}_total"


class PrefillPath(str, enum.Enum):
    """How a P/D request was prefilled (PREFILL_PATH's `path` label)."""

    REMOTE = "remote"  # the prefill tier, first attempt: the designed mode
    REMOTE_RETRY = "remote_retry"  # the prefill tier, after a failed attempt
    LOCAL = "local"  # on the decode engine (aggregated); the reason label says why


class KvRoute(str, enum.Enum):
    """How a P/D request's prefill replica was chosen under KV-aware routing (KV_ROUTES' `outcome`)."""

    SCORED = "scored"  # the scorer chose by KV overlap and load: the designed mode
    UNSCORED = "unscored"  # nothing to score by (no text prompt, no worker registered): by load
    TIMEOUT = "timeout"  # the scorer did not answer in time: by load
    ERROR = "error"  # the scorer failed: by load
    SKIPPED = "skipped"  # the scorer failed or timed out moments ago, not asked (its breaker): by load


class MigrationOutcome(str, enum.Enum):
    """What became of a stream cut after its first byte (STREAM_MIGRATIONS' `outcome` label)."""

    CONTINUED = "continued"  # on another decode replica: the client saw one stream
    FAILED = "failed"  # no replica took the continuation in time, the deadline, or the bound
    NOT_MIGRATABLE = "not_migratable"  # a request that cannot be continued (serving/ingress/migration.py)


# The outcomes that leave the client with a cut stream (the OpenAI-style error event).
CUT_OUTCOMES = (MigrationOutcome.FAILED, MigrationOutcome.NOT_MIGRATABLE)

# The `destination` label of the usage counters.
DESTINATION_CLUSTER = "cluster"
DESTINATION_FALLBACK = "fallback"


class CostPhase(str, enum.Enum):
    """USAGE_COST's `phase` label: the part of a request its cost is for."""

    PREFILL = "prefill"  # the prompt tokens the engines computed (cluster), or the prompt's (provider)
    DECODE = "decode"  # the output tokens


# --- the ingress: usage, limits, the external fallback ---------------------------------------
USAGE_REQUESTS = Metric(
    "pd_usage_requests",
    ("key", "model", "destination"),
    "Requests answered, per API key id, model and destination.",
    INGRESS,
)
USAGE_PROMPT_TOKENS = Metric(
    "pd_usage_prompt_tokens",
    ("key", "model", "destination"),
    "Prompt tokens, per API key id, model and destination.",
    INGRESS,
)
USAGE_COMPLETION_TOKENS = Metric(
    "pd_usage_completion_tokens",
    ("key", "model", "destination"),
    "Completion tokens, per API key id, model and destination.",
    INGRESS,
)
USAGE_CACHED_TOKENS = Metric(
    "pd_usage_cached_tokens",
    ("key", "model", "destination"),
    "Prompt tokens served from a prefix cache (the engines', or the provider's), per API key id, model and "
    "destination: the cache-hit share is this over pd_usage_prompt_tokens.",
    INGRESS,
)
USAGE_COST = Metric(
    "pd_usage_cost_usd",
    ("key", "model", "destination", "phase"),
    "What requests cost in USD, per API key id, model, destination and phase: on the cluster, engine time "
    "at the pools' price (prefill: prompt tokens computed; decode: output tokens); on the fallback, the "
    "provider's price per token.",
    INGRESS,
)
RATE_LIMITED = Metric(
    "pd_rate_limited_requests",
    ("key", "model", "limit"),
    "Requests refused with 429, per API key id, base model and limit (rpm, tpm or budget).",
    INGRESS,
)
BUDGET_OVERFLOWS = Metric(
    "pd_budget_overflows",
    ("key", "model", "to"),
    "Requests of keys past their budget served elsewhere instead of refused, per API key id, the model "
    "asked for and where they went (a model id, or fallback).",
    INGRESS,
)
FALLBACKS = Metric(
    "pd_fallback_requests",
    ("reason", "outcome"),
    "Requests sent to the external fallback, per reason and outcome.",
    INGRESS,
)
LIMITER_ERRORS = Metric(
    "pd_limiter_errors",
    (),
    "Limit checks skipped because the limits ledger did not answer.",
    INGRESS,
)
# --- the ingress: the resilient relay --------------------------------------------------------
INGRESS_RETRIES = Metric(
    "pd_ingress_retries",
    ("reason",),
    "Requests the ingress sent to decode again before the first byte, by reason.",
    INGRESS,
)
INGRESS_REFUSALS = Metric(
    "pd_ingress_refusals",
    ("model", "reason", "status"),
    "Requests the cluster could not serve (503/504 or fallback), by model and reason.",
    INGRESS,
)
STREAM_MIGRATIONS = Metric(
    "pd_stream_migrations",
    ("model", "reason", "outcome"),
    "Streams cut after their first byte, by why and what became of them "
    "(continued on another replica, failed, not_migratable).",
    INGRESS,
)
# --- the P/D decode server: the prefill hop --------------------------------------------------
PREFILL_PATH = Metric(
    "pd_prefill_path",
    ("model", "path", "reason"),
    "P/D requests by how they were prefilled (remote, remote_retry, local) and why.",
    DECODE,
)
PREFILL_RETRIES = Metric(
    "pd_prefill_retries",
    ("reason",),
    "Prefill calls sent again (another replica) after a failure, by reason.",
    DECODE,
)
LOCAL_PREFILLS = Metric(
    "pd_local_prefill_fallbacks",
    ("reason",),
    "Requests prefilled on the decode engine instead of remotely, by reason.",
    DECODE,
)
KV_ROUTES = Metric(
    "pd_kv_routes",
    ("model", "outcome"),
    "P/D requests by how KV-aware routing chose their prefill replica (scored, or by load and why).",
    DECODE,
)
KV_ROUTE_TOKENS = Metric(
    "pd_kv_route_tokens",
    ("model", "kind"),
    "Prompt tokens of KV-scored P/D requests (kind prompt), and how many of them the chosen prefill "
    "replica held in its KV cache by the index (kind cached).",
    DECODE,
)
KV_ROUTE_WAIT = Metric(
    "pd_kv_route_wait_seconds",
    ("model",),
    "Seconds decode waited on the KV scorer before a P/D request's prefill call, summed over every "
    "request that asked it (scored, unscored, timed out or failed; not those skipped while the scorer "
    "was taken for down): over those requests, the scorer's round trip as decode sees it, which "
    "every KV-routed request adds to its time to first token.",
    DECODE,
)
KV_BOOKINGS = Metric(
    "pd_kv_bookings",
    ("model", "event"),
    "Prefill load the KV scorer booked on the replica it chose (event booked) and freed when the engine "
    "reported the request finished or decode released it (event freed); booked less freed is what is "
    "still outstanding (and what died with a replica).",
    KV_SCORER,
)

ALL = (
    USAGE_REQUESTS,
    USAGE_PROMPT_TOKENS,
    USAGE_COMPLETION_TOKENS,
    USAGE_CACHED_TOKENS,
    USAGE_COST,
    RATE_LIMITED,
    BUDGET_OVERFLOWS,
    FALLBACKS,
    LIMITER_ERRORS,
    INGRESS_RETRIES,
    INGRESS_REFUSALS,
    STREAM_MIGRATIONS,
    PREFILL_PATH,
    PREFILL_RETRIES,
    LOCAL_PREFILLS,
    KV_ROUTES,
    KV_ROUTE_TOKENS,
    KV_ROUTE_WAIT,
    KV_BOOKINGS,
)


def add(counter: Any, n: float, tags: dict[str, str]) -> None:
    """`counter.inc(n, tags)` for an amount that may be 0: Ray's Counter.inc refuses anything
    but a positive value (ValueError), and nothing happened to count."""
    if n > 0:
        counter.inc(n, tags)


def counter(metric: Metric) -> Any:
    """The Ray counter of `metric` (inside a Serve replica or a Ray worker)."""
    from ray.serve.metrics import Counter

    # Ray annotates tag_keys as Tuple[str] (one element); any tuple of names is accepted.
    tags: Any = metric.labels or None
    return Counter(metric.name, description=metric.description, tag_keys=tags)
