"""Per-role autoscaling policies: prefill scales on what makes TTFT grow, decode on what makes ITL grow.

The extension point (Ray 2.60, read in the installed package):
- `ray.serve.config.AutoscalingConfig.policy` (`AutoscalingPolicy`, PublicAPI stable):
  `policy_function` is an import path of a function or a class; a class is instantiated once
  with `policy_kwargs` (ray/serve/_private/autoscaling_state.py `_resolve_policy_callable`)
  and called with an `AutoscalingContext` (ray/serve/config.py, PublicAPI stable) on every
  control-loop tick. It returns (desired replicas, policy state). Serve wraps a deployment's
  policy in `_apply_autoscaling_config` (ray/serve/autoscaling_policy.py): min/max bounds,
  upscale/downscale delays, scaling factors, and the cold-start path (0 replicas and a request
  waiting -> scale up at once, without the delay) apply to these policies as to Serve's own.
- The context carries Serve's own signals only: ongoing requests (`total_num_requests`,
  running + queued), requests queued at handles (`total_queued_requests`), replica counts, and
  custom metrics that replicas report from a `record_autoscaling_stats` method of the
  deployment class. The engine classes are Ray Serve LLM's (the P/D builder fixes the decode
  class), which define no such method; so vLLM's own metrics do not reach the context.
- `ray.serve.autoscaling_policy.PrometheusQueryMixin` (PublicAPI **alpha**) fills that gap: a
  policy class mixing it in reads PromQL results refreshed by a background thread from
  `RAY_PROMETHEUS_HOST` (the Serve controller's environment), None when it is unset,
  unreachable or stale. Through it these policies read vLLM's engine metrics per role.

What each policy does: every signal gives a pressure, observed per replica / threshold; the
policy asks for current replicas x the largest pressure (Serve's own proportional rule,
`_core_replica_queue_length_policy`). While no engine signal is fresh (no Prometheus, or
none of the role's series yet) the one signal is ongoing requests against the role's
targetOngoingRequests: the policy is then Serve's default. vLLM exports no waiting prompt
*tokens*; prefill uses waiting requests.

The Serve controller unpickles this module by value (AutoscalingPolicy.serialize_policy
registers the policy's module with cloudpickle), on a process without the application's
working_dir: it imports the standard library and Ray only, never another serving module.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ray.serve.autoscaling_policy import PrometheusQueryMixin
from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve")

# PromQL per signal, `{sel}` replaced by the role's selector; Ray exports vLLM's metrics with a
# `ray_` prefix and `vllm:` turned into `vllm_` (the names infra/k8s/dashboard_panels.py reads). Sums
# over the role's replicas; the policy divides by the running replicas where a level is per
# replica.
WINDOW = "1m"
QUERIES = {
    "queue_time_s": (
        "sum(rate(ray_vllm_request_queue_time_seconds_sum{{{sel}}}[{w}]))"
        " / sum(rate(ray_vllm_request_queue_time_seconds_count{{{sel}}}[{w}]))"
    ),
    "waiting_requests": "sum(ray_vllm_num_requests_waiting{{{sel}}})",
    "ttft_s": "histogram_quantile(0.9, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket{{{sel}}}[{w}])))",
    "running_requests": "sum(ray_vllm_num_requests_running{{{sel}}})",
    "kv_cache_usage": "max(ray_vllm_kv_cache_usage_perc{{{sel}}})",
    "itl_s": "histogram_quantile(0.9, sum by (le) (rate(ray_vllm_inter_token_latency_seconds_bucket{{{sel}}}[{w}])))",
}
# Levels summed over replicas (divided by the running replicas); the others are already
# per replica (a mean queue time, a quantile, the fullest KV cache).
SUMMED = frozenset({"waiting_requests", "running_requests"})


def query(signal: str, selector: str) -> str:
    return QUERIES[signal].format(sel=selector, w=WINDOW)


def pressures(
    ctx: AutoscalingContext,
    target_ongoing_requests: float,
    thresholds: dict[str, float],
    observed: dict[str, float],
) -> dict[str, float]:
    """observed / threshold per signal (1.0: at the threshold).

    Ongoing requests (Serve's own signal) count only while no engine signal is fresh: a P/D
    decode replica holds every request while its prefill runs remotely, so a burst of long
    prompts shows as ongoing requests on decode although decode's engine is idle; the
    engine's running sequences say what decode actually carries."""
    replicas = max(1, ctx.current_num_replicas)
    out = {}
    for name, limit in thresholds.items():
        value = observed.get(name)
        if value is None or math.isnan(value):
            continue
        per_replica = value / replicas if name in SUMMED else value
        out[name] = per_replica / limit
    if not out:
        out["ongoing_requests"] = ctx.total_num_requests / (target_ongoing_requests * replicas)
    return out


def decide(ctx: AutoscalingContext, pressure: dict[str, float]) -> tuple[float, dict[str, Any]]:
    """Desired replicas: current x the largest pressure; the signal that set it goes to the state."""
    if ctx.current_num_replicas == 0:
        # Serve's wrapper scales 0 -> up itself when requests wait; otherwise stay where Serve is.
        return ctx.target_num_replicas, {"pd_signal": None}
    signal = max(pressure, key=lambda k: pressure[k])
    return ctx.current_num_replicas * pressure[signal], {"pd_signal": signal, "pd_pressure": round(pressure[signal], 3)}


class _RolePolicy(PrometheusQueryMixin):
    signals: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        target_ongoing_requests: float,
        thresholds: dict[str, float],
        metrics_selector: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = set(thresholds) - set(self.signals)
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown signals {sorted(unknown)}")
        self.target_ongoing_requests = target_ongoing_requests
        self.thresholds = dict(thresholds)
        self.queries = {s: query(s, metrics_selector) for s in self.thresholds} if metrics_selector else {}
        self._last_wanted: int | None = None
        super().__init__(prometheus_queries=list(self.queries.values()), **kwargs)

    def observed(self) -> dict[str, float]:
        metrics = self.prometheus_metrics or {}
        return {s: metrics[q] for s, q in self.queries.items() if q in metrics}

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        observed = self.observed()
        pressure = pressures(ctx, self.target_ongoing_requests, self.thresholds, observed)
        desired, state = decide(ctx, pressure)
        want = math.ceil(desired) if desired > ctx.current_num_replicas else math.floor(desired)
        want = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, want))
        if ctx.current_num_replicas and want != ctx.current_num_replicas and want != self._last_wanted:
            # Serve logs that it scales, not why: the signal that asked, once per new ask.
            logger.info(
                "%s %s/%s: %d -> %d replicas asked by %s (pressure %.2f; observed %s)",
                type(self).__name__,
                ctx.app_name,
                ctx.deployment_name,
                ctx.current_num_replicas,
                want,
                state.get("pd_signal"),
                state.get("pd_pressure") or 0.0,
                {k: round(v, 3) for k, v in observed.items()},
            )
        self._last_wanted = want
        return desired, state


class PrefillPolicy(_RolePolicy):
    """Prefill: queue time, waiting requests, p90 TTFT against the SLO (and ongoing requests)."""

    signals = ("queue_time_s", "waiting_requests", "ttft_s")


class DecodePolicy(_RolePolicy):
    """Decode: running sequences, KV-cache usage, p90 ITL against the SLO (and ongoing requests)."""

    signals = ("running_requests", "kv_cache_usage", "itl_s")
