"""Alerts as a PrometheusRule: SLO burn, P/D failure signatures, capacity, GPUs, errors.

What flows through here: the serving spec's SLOs (`serving.slo`), the stack's
`observability` block (how long replicas may stay Pending), the serving code's own counters
(`infra.k8s.serving_metrics`: fallback share, limiter errors, unservable refusals, streams cut
mid-answer), the node autoscaler's failed scale-ups, and the KV-transfer alert groups of
`infra.k8s.kv_alerts` -> one `monitoring.coreos.com/v1` PrometheusRule whose alerts each
carry a `runbook_url` into docs/runbooks.md (one section per alert, same anchor).

SLO burn follows the multi-window, multi-burn-rate recipe of Google's SRE workbook
("Alerting on SLOs"): the share of requests slower than the SLO threshold, read from the
histogram bucket whose upper bound IS the threshold (serving.spec only accepts thresholds that
are bucket bounds of vLLM's histograms), divided by the error budget (1 - objective); page
when 2% of a 30-day budget burns in an hour (14.4x, also over 5 minutes so it stops soon after
recovery), open a ticket when 5% burns in six hours (6x, also over 30 minutes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import Observability
from infra.k8s.monitoring import MONITORING_LABEL, ROLE
from infra.k8s.serving_metrics import (
    LIMITER_ERRORS,
    cut_streams_per_minute,
    fallback_share,
    local_prefill_share,
    refusal_share,
)
from serving.spec import SloSpec

RUNBOOK_BASE = "https://github.com/pd-inference/pd-inference/blob/main/docs/runbooks.md"
# (severity, burn rate, long window, short window): Google SRE workbook, table 5-8.
BURN_WINDOWS = (("critical", 14.4, "1h", "5m"), ("warning", 6.0, "6h", "30m"))
ERROR_RATE_THRESHOLD = 0.05
# Above this share of answers from the external fallback, for FALLBACK_FOR, the cluster is
# short of capacity or broken: every fallback answer is billed per token by the provider.
# A judgement, not a published figure; overflow that is meant to happen stays below it.
FALLBACK_SHARE_THRESHOLD = 0.2
FALLBACK_FOR = "10m"
# Above this share of requests refused as unservable (serving.core.failures: 503/504, or handed
# to the fallback), for 5 minutes: capacity or a role is missing. A judgement, like the
# fallback share: single refusals during a replica restart stay below it.
REFUSAL_SHARE_THRESHOLD = 0.01
# Above this share of P/D requests prefilled on decode because the remote path failed, for
# LOCAL_PREFILL_FOR, the stack has quietly become aggregated (prefill GPUs idle, decode doing
# both). A fault trips the circuit for circuitOpenS and a probe closes it, so even a prefill
# restart stays far below this over 10 minutes. A judgement, like the fallback share.
LOCAL_PREFILL_SHARE_THRESHOLD = 0.2
LOCAL_PREFILL_FOR = "10m"
# Streams cut mid-answer (serving/ingress/migration.py could not continue them: no replica took the
# continuation in time, the bound or the deadline, or a request that cannot be continued),
# at any rate, in every 5-minute window for MIGRATIONS_FAILING_FOR. One decode death cuts at
# most a burst (the streams it held that could not go on), which stays below `for`; cuts that
# keep coming mean decode keeps dying or no replica can take a continuation. A judgement,
# like the shares above: any cut stream is a half answer a client saw.
MIGRATIONS_FAILING_WINDOW = "5m"
MIGRATIONS_FAILING_FOR = "10m"
# The model label of vLLM's own series (vllm/v1/metrics/loggers.py: `model_name`, the served
# model name); the serving code's own counters call it `model` (serving/ingress/limits.py,
# serving/core/failures.py), Serve's series name the application (`llm-model-<id>` for one model
# of the many-model form, `llm` for the one-model form and the many-model front door).
VLLM_MODEL = "model_name"


@dataclass(frozen=True)
class SloTarget:
    """One latency SLO: a vLLM histogram, the roles it is read on, and its threshold."""

    alert: str
    metric: str  # histogram base name
    roles: tuple[str, ...]
    threshold_s: float
    objective: float
    what: str


def runbook(alert: str) -> str:
    return f"{RUNBOOK_BASE}#{alert.lower()}"


def _le(v: float) -> str:
    # Prometheus client libraries print bucket bounds with Go's/Python's float formatting.
    return repr(float(v))


def slo_targets(slo: SloSpec) -> list[SloTarget]:
    return [
        SloTarget(
            "PDTTFTBudgetBurn",
            "ray_vllm_time_to_first_token_seconds",
            ("prefill", "decode"),
            slo.ttft_seconds,
            slo.objective,
            "time to first token",
        ),
        SloTarget(
            "PDITLBudgetBurn",
            "ray_vllm_inter_token_latency_seconds",
            ("decode",),
            slo.itl_seconds,
            slo.objective,
            "inter-token latency",
        ),
    ]


def _bad_ratio(t: SloTarget, window: str) -> str:
    roles = "|".join(t.roles)
    sel = f'{ROLE}=~"{roles}"'
    by = f"{ROLE}, {VLLM_MODEL}"
    return (
        f'(1 - sum by ({by}) (rate({t.metric}_bucket{{{sel}, le="{_le(t.threshold_s)}"}}[{window}]))'
        f" / sum by ({by}) (rate({t.metric}_count{{{sel}}}[{window}])))"
    )


def slo_rules(slo: SloSpec) -> list[dict[str, Any]]:
    rules = []
    for t in slo_targets(slo):
        budget = round(1 - t.objective, 6)
        for severity, burn, long_w, short_w in BURN_WINDOWS:
            limit = round(burn * budget, 6)
            rules.append(
                {
                    "alert": t.alert,
                    "expr": f"{_bad_ratio(t, long_w)} > {limit}\nand\n{_bad_ratio(t, short_w)} > {limit}",
                    "labels": {
                        "severity": severity,
                        "slo": t.alert.removeprefix("PD").removesuffix("BudgetBurn").lower(),
                    },
                    "annotations": {
                        "summary": (
                            f"{{{{ $labels.{VLLM_MODEL} }}}} on {{{{ $labels.{ROLE} }}}}: {t.what} above {t.threshold_s}s for more than "
                            f"{burn}x the error budget of a {t.objective:.2%} SLO (window {long_w})"
                        ),
                        "runbook_url": runbook(t.alert),
                    },
                }
            )
    return rules


def _alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "runbook_url": runbook(name)},
    }


def service_rules(namespace: str, obs: Observability) -> list[dict[str, Any]]:
    return [
        _alert(
            "PDReplicasPending",
            f'sum by (namespace, pod) (kube_pod_status_phase{{namespace="{namespace}", phase="Pending"}}) > 0',
            f"{obs.pending_alert_minutes}m",
            "warning",
            "Ray pod {{ $labels.pod }} has been Pending for more than "
            f"{obs.pending_alert_minutes} minutes (no GPU capacity, quota, or an unschedulable spec)",
        ),
        _alert(
            "PDGpuXidErrors",
            "max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS) > 0",
            "0m",
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported XID {{ $value }}",
        ),
        _alert(
            "PDHighErrorRate",
            # Serve's proxy counts each request under the application whose HTTP ingress took it:
            # `llm` in both forms (the many-model front door calls the models' applications by
            # handle), so this names the front door; a model's failures name it in
            # PDRequestsRefused and the SLO burn alerts.
            'sum by (application) (rate(ray_serve_num_http_error_requests_total{error_code=~"5.."}[5m]))'
            " / sum by (application) (rate(ray_serve_num_http_requests_total[5m])) > "
            f"{ERROR_RATE_THRESHOLD}",
            "5m",
            "critical",
            f"{{{{ $labels.application }}}}: more than {ERROR_RATE_THRESHOLD:.0%} of API requests fail with 5xx "
            "({{ $value | humanizePercentage }})",
        ),
        _alert(
            "PDEngineRestarts",
            # More Serve replicas lived in the last 30 minutes than the autoscaler ever asked
            # for: some replaced dead ones (each start is a new series of its own). Or a Ray
            # container restarted.
            "count by (application, deployment) (count_over_time(ray_serve_deployment_replica_starts_total[30m]))"
            "\n  > on (application, deployment)\n"
            "max by (application, deployment) (max_over_time(ray_serve_autoscaling_target_replicas[30m]))"
            "\nor\n"
            f'sum by (namespace, pod) (increase(kube_pod_container_status_restarts_total{{namespace="{namespace}"}}[15m])) > 0',
            "0m",
            "warning",
            # The application names the model in the many-model form (`llm-model-<id>`).
            "Replicas restarted in the last 30 minutes: "
            "{{ with $labels.application }}{{ . }}/{{ end }}{{ $labels.deployment }}{{ $labels.pod }}",
        ),
    ]


def hybrid_rules() -> list[dict[str, Any]]:
    """Hybrid routing and limits (serving/ingress/routing.py, serving/ingress/limits.py)."""
    return [
        _alert(
            "PDFallbackShareHigh",
            f"{fallback_share('model', '5m')} > {FALLBACK_SHARE_THRESHOLD}",
            FALLBACK_FOR,
            "warning",
            f"{{{{ $labels.model }}}}: more than {FALLBACK_SHARE_THRESHOLD:.0%} of requests answered by the external "
            f"fallback for {FALLBACK_FOR} ({{{{ $value | humanizePercentage }}}})",
        ),
        _alert(
            "PDLimiterErrors",
            f"sum(rate({LIMITER_ERRORS}[5m])) > 0",
            "5m",
            "warning",
            "The limits ledger does not answer: per-key request and token limits are not enforced",
        ),
    ]


def fault_rules() -> list[dict[str, Any]]:
    """Faults and overload (serving/core/failures.py)."""
    return [
        _alert(
            "PDRunningAggregated",
            f"{local_prefill_share('model', '5m')} > {LOCAL_PREFILL_SHARE_THRESHOLD}",
            LOCAL_PREFILL_FOR,
            "warning",
            f"{{{{ $labels.model }}}}: more than {LOCAL_PREFILL_SHARE_THRESHOLD:.0%} of P/D requests prefilled on "
            f"decode for {LOCAL_PREFILL_FOR} ({{{{ $value | humanizePercentage }}}}): the stack is serving aggregated",
        ),
        _alert(
            "PDStreamMigrationsFailing",
            f"{cut_streams_per_minute('model', MIGRATIONS_FAILING_WINDOW)} > 0",
            MIGRATIONS_FAILING_FOR,
            "warning",
            f"{{{{ $labels.model }}}}: streams cut mid-answer for {MIGRATIONS_FAILING_FOR} "
            "({{ $value | humanize }} a minute): migration did not continue them",
        ),
        _alert(
            "PDRequestsRefused",
            f"{refusal_share('model', '5m')} > {REFUSAL_SHARE_THRESHOLD}",
            "5m",
            "warning",
            f"{{{{ $labels.model }}}}: more than {REFUSAL_SHARE_THRESHOLD:.0%} of requests refused as unservable (503/504, or sent to the "
            "fallback) ({{ $value | humanizePercentage }})",
        ),
    ]


def node_autoscaler_rules() -> list[dict[str, Any]]:
    """The Cluster Autoscaler (kubernetes/autoscaler cluster-autoscaler/metrics/metrics.go:
    `failed_scale_ups_total{reason}`, reasons cloudProviderError, apiCallError, timeout, each
    initialised to 0 at start)."""
    return [
        _alert(
            "PDNodeScaleUpFailed",
            "sum by (reason) (increase(cluster_autoscaler_failed_scale_ups_total[15m])) > 0",
            "0m",
            "warning",
            "The node autoscaler failed to add a node in the last 15 minutes ({{ $labels.reason }})",
        ),
    ]


def prometheus_rule(
    name: str, namespace: str, slo: SloSpec, obs: Observability, extra_groups: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    groups = [
        {"name": "pd-slo", "rules": slo_rules(slo)},
        {"name": "pd-service", "rules": service_rules(namespace, obs)},
        {"name": "pd-hybrid", "rules": hybrid_rules()},
        {"name": "pd-faults", "rules": fault_rules()},
        {"name": "pd-nodes", "rules": node_autoscaler_rules()},
        *(extra_groups or []),
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MONITORING_LABEL)},
        "spec": {"groups": groups},
    }
