"""The serving code's own metrics as Prometheus names them, and the expressions that read them.

What flows through here: the counters that serving/core/metrics.py declares (its registry:
names, labels, which process records them; nothing retyped here) -> their Prometheus names ->
the expressions that the dashboard and the alerts share (one copy each, e.g. `fallback_share`,
`refusal_share`). No Pulumi, Ray or web-framework import: the registry is standard library
only, and so is the failure taxonomy whose label values these expressions name.

A labelled counter has no series until its first event (a 429, a fallback, a fault), so these
names are absent from an idle stack's scrape; tests/infra/k8s/metric_sources.py checks them
against the registry, and the registry against what the serving code records.
"""

from __future__ import annotations

from serving.core import metrics as m
from serving.core.failures import Reason

# The ingress (head pods): usage per key id, model and destination; 429s per key, base model
# and limit (rpm, tpm, budget); fallbacks per reason and outcome (ok, failed); limiter errors.
REQUESTS = m.USAGE_REQUESTS.prometheus
PROMPT_TOKENS = m.USAGE_PROMPT_TOKENS.prometheus
COMPLETION_TOKENS = m.USAGE_COMPLETION_TOKENS.prometheus
RATE_LIMITED = m.RATE_LIMITED.prometheus
# Per key id, model and destination: prompt tokens served from a prefix cache, and what requests
# cost in USD by phase (prefill, decode); requests of keys past their budget served elsewhere.
CACHED_TOKENS = m.USAGE_CACHED_TOKENS.prometheus
COST = m.USAGE_COST.prometheus
BUDGET_OVERFLOWS = m.BUDGET_OVERFLOWS.prometheus
FALLBACKS = m.FALLBACKS.prometheus
LIMITER_ERRORS = m.LIMITER_ERRORS.prometheus
# The `destination` of a request the external fallback answered.
FALLBACK_DESTINATION = m.DESTINATION_FALLBACK
# The ingress: retries before the first byte (reason) and refusals (model, reason, status).
INGRESS_RETRIES = m.INGRESS_RETRIES.prometheus
INGRESS_REFUSALS = m.INGRESS_REFUSALS.prometheus
# The decode server (decode pods): prefill retries and local prefills (reason), and one count
# per P/D request by how it was prefilled (model, path: remote, remote_retry, local; reason).
PREFILL_RETRIES = m.PREFILL_RETRIES.prometheus
LOCAL_PREFILLS = m.LOCAL_PREFILLS.prometheus
KV_ROUTES = m.KV_ROUTES.prometheus
KV_ROUTE_TOKENS = m.KV_ROUTE_TOKENS.prometheus
KV_ROUTE_WAIT = m.KV_ROUTE_WAIT.prometheus
KV_BOOKINGS = m.KV_BOOKINGS.prometheus
PREFILL_PATH = m.PREFILL_PATH.prometheus
# Streams cut after their first byte (model, reason, outcome), counted by the ingress.
STREAM_MIGRATIONS = m.STREAM_MIGRATIONS.prometheus
# The outcomes that leave the client with a cut stream (the OpenAI-style error event);
# "continued" is the healthy one.
MIGRATION_CUT_OUTCOMES = tuple(o.value for o in m.CUT_OUTCOMES)
# Requests that prefill on decode by design, not because the remote path failed.
DESIGNED_LOCAL_REASONS = tuple(r.value for r in Reason.designed_local())
# Serve's proxy counts every HTTP request (in the live scrape).
HTTP_REQUESTS = "ray_serve_num_http_requests_total"


def fallback_share(by: str, window: str, sel: str = "") -> str:
    """Requests the external fallback answered / all requests answered, per `by` labels."""
    group = f" by ({by})" if by else ""
    fallback = ", ".join(s for s in (f'destination="{FALLBACK_DESTINATION}"', sel) if s)
    every = f"{{{sel}}}" if sel else ""
    return f"sum{group} (rate({REQUESTS}{{{fallback}}}[{window}])) / sum{group} (rate({REQUESTS}{every}[{window}]))"


def local_prefill_share(by: str, window: str, sel: str = "") -> str:
    """P/D requests prefilled on decode because the remote path failed (not by design) / all
    P/D requests, per `by` labels: above a few percent for long, the stack runs aggregated."""
    group = f" by ({by})" if by else ""
    designed = "|".join(DESIGNED_LOCAL_REASONS)
    local = ", ".join(s for s in ('path="local"', f'reason!~"{designed}"', sel) if s)
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
    cut = ", ".join(s for s in (f'outcome=~"{"|".join(MIGRATION_CUT_OUTCOMES)}"', sel) if s)
    return f"60 * sum{group} (rate({STREAM_MIGRATIONS}{{{cut}}}[{window}]))"
