"""The serving spec's loading and scaling parts: how engines load their weights, and what each role scales on.

`serving/spec/serving.py` imports this module and renders with it; it imports pydantic and the
standard library only (the Pulumi program imports the spec and must not need Ray or vLLM).

Weights: an `s3://` source is streamed by the Run:ai model streamer (vLLM's
`load_format: runai_streamer`, vllm/model_executor/model_loader/runai_streamer_loader.py,
vLLM 0.29 and 0.32), which reads the safetensors files from S3 straight into GPU memory:
no copy to the node's disk, no second read from it. Its settings are that loader's
`model_loader_extra_config` keys (`concurrency`, `memory_limit`; the loader rejects others).
Ray Serve LLM 2.60 then skips its own node download (ray/llm/_internal/common/utils/
download_utils.py STREAMING_LOAD_FORMATS) and hands vLLM the mirror's `bucket_uri`
(engines/vllm/vllm_engine.py).

Signals: the per-role autoscaling policy (serving/engines/autoscaling.py) and its thresholds. The
planner derives defaults from the SLO and the roofline (infra/sizing/signals.py, passed
in through the render Target); a stack overrides any of them per role under
`serving.<role>.signals`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

STREAMER_LOAD_FORMAT = "runai_streamer"
# The policy classes, by Serve import path (ray.serve.config.AutoscalingPolicy.policy_function).
POLICY_PATHS = {
    "prefill": "serving.engines.autoscaling:PrefillPolicy",
    "decode": "serving.engines.autoscaling:DecodePolicy",
}
# Which signal belongs to which role: a threshold of the other role's is refused.
PREFILL_SIGNALS = ("queue_time_s", "waiting_requests", "ttft_s")
DECODE_SIGNALS = ("running_requests", "kv_cache_usage", "itl_s")


class _Model(BaseModel):
    # The same rules as serving.spec.SpecModel (camelCase keys, unknown keys refused); not
    # imported from there, which imports this module.
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class WeightsPath(str, Enum):
    AUTO = "auto"  # the streamer for s3:// sources, Ray's download otherwise
    STREAMER = "streamer"  # vLLM's runai_streamer (s3:// or a local path)
    DOWNLOAD = "download"  # Ray Serve LLM copies the files to the node, vLLM loads them from disk


class LoadingSpec(_Model):
    """`serving.model.loading`: how the engines get their weights."""

    weights: WeightsPath = WeightsPath.AUTO
    # RUNAI_STREAMER_CONCURRENCY: reader threads (the loader refuses a non-positive value).
    streamer_concurrency: int | None = Field(default=None, ge=1, le=1024)
    # RUNAI_STREAMER_MEMORY_LIMIT: bytes of the streamer's CPU buffer; -1 unlimited.
    streamer_memory_limit_bytes: int | None = Field(default=None, ge=-1)

    def streamed(self, source: str) -> bool:
        if self.weights is WeightsPath.AUTO:
            return source.startswith("s3://")
        return self.weights is WeightsPath.STREAMER

    def problem(self, source: str) -> str | None:
        """Why this loading cannot work with `source`, in one line; None when it can."""
        if self.weights is WeightsPath.STREAMER and not source.startswith(("s3://", "/")):
            return (
                f"weights: streamer reads s3:// or a local path, not the Hugging Face repo id {source!r} "
                "(mirror it to S3, or use weights: download)"
            )
        if not self.streamed(source) and (
            self.streamer_concurrency is not None or self.streamer_memory_limit_bytes is not None
        ):
            return "streamerConcurrency / streamerMemoryLimitBytes are set but the weights are not streamed"
        return None

    def engine_kwargs(self, source: str) -> dict[str, Any]:
        if not self.streamed(source):
            return {}
        extra: dict[str, Any] = {}
        if self.streamer_concurrency is not None:
            extra["concurrency"] = self.streamer_concurrency
        if self.streamer_memory_limit_bytes is not None:
            extra["memory_limit"] = self.streamer_memory_limit_bytes
        kwargs: dict[str, Any] = {"load_format": STREAMER_LOAD_FORMAT}
        if extra:
            kwargs["model_loader_extra_config"] = extra
        return kwargs


class SignalsSpec(_Model):
    """`serving.<role>.signals`: thresholds of the role's autoscaling policy; unset ones come from
    the planner (SLO and roofline). Each is a per-replica level above which the role scales out
    in proportion (Serve's own rule: desired = current x observed / threshold)."""

    policy: bool = Field(default=True, description="false: Serve's default policy (ongoing requests only)")
    # prefill: what makes TTFT grow
    queue_time_s: float | None = Field(default=None, gt=0, le=600)
    waiting_requests: float | None = Field(default=None, gt=0)
    ttft_s: float | None = Field(default=None, gt=0, le=600)
    # decode: what makes ITL grow
    running_requests: float | None = Field(default=None, gt=0)
    kv_cache_usage: float | None = Field(default=None, gt=0, le=1)
    itl_s: float | None = Field(default=None, gt=0, le=60)

    def role_problem(self, role: str) -> str | None:
        other = DECODE_SIGNALS if role == "prefill" else PREFILL_SIGNALS
        wrong = [to_camel(k) for k in other if getattr(self, k) is not None]
        if wrong:
            return f"{', '.join(wrong)} is not a {role} signal (prefill: queueTimeS, waitingRequests, ttftS; decode: runningRequests, kvCacheUsage, itlS)"
        return None


def slo_thresholds(role: str, ttft_s: float, itl_s: float, target_ongoing: float) -> dict[str, float]:
    """Thresholds from the SLO alone (what the planner starts from, and all a CPU run has).

    prefill: half the TTFT budget spent queued is the point to add a replica (the other half is
    the prefill itself and the hops), and p90 TTFT at the SLO. decode: p90 ITL at the SLO, the
    running sequences the role's target names, and 90% of the KV cache (past it vLLM preempts).
    """
    if role == "prefill":
        return {"queue_time_s": ttft_s / 2, "ttft_s": ttft_s}
    return {"running_requests": target_ongoing, "kv_cache_usage": 0.9, "itl_s": itl_s}


def policy_config(
    role: str,
    signals: SignalsSpec,
    planned: dict[str, float],
    *,
    target_ongoing: float,
    metrics_selector: str | None,
) -> dict[str, Any] | None:
    """The Serve `autoscaling_config.policy` of one role (None: Serve's default policy).

    Precedence: the stack's per-role value, then the planner's (`planned`). The Prometheus
    selector picks the role's engine series (None: the policy has Serve's own signals only).
    """
    if not signals.policy:
        return None
    names = PREFILL_SIGNALS if role == "prefill" else DECODE_SIGNALS
    thresholds = {k: planned[k] for k in names if k in planned}
    thresholds.update({k: v for k in names if (v := getattr(signals, k)) is not None})
    kwargs: dict[str, Any] = {"target_ongoing_requests": target_ongoing, "thresholds": thresholds}
    if metrics_selector:
        kwargs["metrics_selector"] = metrics_selector
    return {"policy_function": POLICY_PATHS[role], "policy_kwargs": kwargs}
