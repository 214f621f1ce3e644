"""The serving code's own metrics, as Prometheus names them, and the expressions that read them.

What flows through here: the counter names that `serving/` declares (imported, never retyped:
`serving.ingress.limits`'s usage, 429, fallback and limiter-error counters; `serving.core.failures`'s
retry, local-prefill, refusal and stream-migration counters) -> their Prometheus names as Ray exports them
(`ray_counter`) -> the expressions that the dashboard and the alerts share (one copy each,
e.g. `fallback_share`, `refusal_share`). No Pulumi, no Ray import here.

Ray exports an application's metrics under the `ray` namespace, and a counter
(`ray.util.metrics.Counter`, which `ray.serve.metrics.Counter` extends) with Prometheus's
`_total` suffix: "Since 2.10, this exports both counter (with a suffix "_total") and gauge
metrics" (ray/util/metrics.py, `Counter`); `NAMESPACE = "ray"`
(ray/_private/telemetry/open_telemetry_metric_recorder.py), Ray 2.60. Serve's own counters
follow the same rule (`serve_num_http_requests` -> `ray_serve_num_http_requests_total`, in
the live scrape). Ray Serve adds `application`, `deployment` and `replica` labels.

A labelled counter has no series until its first event (a 429, a fallback, a fault), so
these names are absent from an idle stack's scrape; tests/infra/k8s/metric_sources.py checks
them against the serving code's declarations instead.
"""

from __future__ import annotations

from serving.core.failures import CUT_OUTCOMES
from serving.core.failures import METRICS as RESILIENCE_METRICS
from serving.ingress.limits import (
    METRIC_COMPLETION_TOKENS,
    METRIC_FALLBACK,
    METRIC_LIMITER_ERRORS,
    METRIC_PROMPT_TOKENS,
    METRIC_RATE_LIMITED,
    METRIC_REQUESTS,
)


def ray_counter(name: str) -> str:
    """The Prometheus name of a Ray counter declared as `name`."""
    return f"ray_{name}_total"


# serving.ingress.limits: labels key, model, destination (cluster, fallback) for the usage counters;
# key, model (the base model, whose window was full), limit (rpm, tpm) for 429s; reason, outcome
# (ok, failed) for fallbacks; none for errors.
REQUESTS = ray_counter(METRIC_REQUESTS)
PROMPT_TOKENS = ray_counter(METRIC_PROMPT_TOKENS)
COMPLETION_TOKENS = ray_counter(METRIC_COMPLETION_TOKENS)
RATE_LIMITED = ray_counter(METRIC_RATE_LIMITED)
FALLBACKS = ray_counter(METRIC_FALLBACK)
LIMITER_ERRORS = ray_counter(METRIC_LIMITER_ERRORS)
# The `destination` of a request the external fallback answered (serving/ingress/routing.py).
FALLBACK_DESTINATION = "fallback"
# serving.core.failures (docs/resilience.md): label `reason` on all four, and `model` and
# `status` (503, 504) on refusals. The ingress counts retries and refusals (head pods); the decode tier
# counts prefill retries and local prefills (decode pods).
INGRESS_RETRIES = ray_counter(RESILIENCE_METRICS["ingress_retries"])
INGRESS_REFUSALS = ray_counter(RESILIENCE_METRICS["ingress_refusals"])
PREFILL_RETRIES = ray_counter(RESILIENCE_METRICS["prefill_retries"])
LOCAL_PREFILLS = ray_counter(RESILIENCE_METRICS["local_prefill"])
# serving.core.failures Path: one count per P/D request, labels model, path (remote,
# remote_retry, local) and reason (why local; empty otherwise). Decode pods.
PREFILL_PATH = ray_counter(RESILIENCE_METRICS["prefill_path"])
# serving.core.failures (issue 25, serving/ingress/migration.py): streams cut after their first byte,
# labels model, reason (replica_died, engine_error, stall) and outcome. Ingress (head pods).
STREAM_MIGRATIONS = ray_counter(RESILIENCE_METRICS["migrations"])
# The outcomes that leave the client with a cut stream (the OpenAI-style error event), as
# serving/ingress/relay.py `guarded_stream` counts them; "continued" is the healthy one.
MIGRATION_CUT_OUTCOMES = tuple(o.value for o in CUT_OUTCOMES)
# n > 1 prefills on decode by design (serving.core.failures.Reason.PARALLEL_SAMPLING): not a fault.
DESIGNED_LOCAL_REASON = "parallel_sampling"
# Serve's proxy counts every HTTP request (in the live scrape).
HTTP_REQUESTS = "ray_serve_num_http_requests_total"


def fallback_share(by: str, window: str, sel: str = "") -> str:
    """Requests the external fallback answered / all requests answered, per `by` labels."""
    group = f" by ({by})" if by else ""
    fallback = ", ".join(m for m in (f'destination="{FALLBACK_DESTINATION}"', sel) if m)
    every = f"{{{sel}}}" if sel else ""
    return f"sum{group} (rate({REQUESTS}{{{fallback}}}[{window}])) / sum{group} (rate({REQUESTS}{every}[{window}]))"


def local_prefill_share(by: str, window: str, sel: str = "") -> str:
    """P/D requests prefilled on decode because the remote path failed (not by design) / all
    P/D requests, per `by` labels: above a few percent for long, the stack runs aggregated."""
    group = f" by ({by})" if by else ""
    local = ", ".join(m for m in ('path="local"', f'reason!="{DESIGNED_LOCAL_REASON}"', sel) if m)
    every = f"{{{sel}}}" if sel else ""
    return (
        f"sum{group} (rate({PREFILL_PATH}{{{local}}}[{window}])) / sum{group} (rate({PREFILL_PATH}{every}[{window}]))"
    )


def refusal_share(by: str, window: str) -> str:
    """Requests the ingress found unservable (503/504, or handed to the fallback), per `by`
    labels (e.g. `model`) / all HTTP requests the proxies received. The proxies' count has no
    model label, so a model's share is of all requests: with one model, the stack's share."""
    return (
        f"sum by ({by}) (rate({INGRESS_REFUSALS}[{window}])) / on () group_left () sum(rate({HTTP_REQUESTS}[{window}]))"
    )


def cut_streams_per_minute(by: str, window: str, sel: str = "") -> str:
    """Streams that ended cut mid-answer (a migration failed, or the request could not be
    continued) per minute, per `by` labels."""
    group = f" by ({by})" if by else ""
    cut = ", ".join(m for m in (f'outcome=~"{"|".join(MIGRATION_CUT_OUTCOMES)}"', sel) if m)
    return f"60 * sum{group} (rate({STREAM_MIGRATIONS}{{{cut}}}[{window}]))"
