"""The planner's autoscaling thresholds per engine role: from the SLO and the roofline.

What flows through here: the serving spec (SLO, roles) and each role's instance type ->
`role_thresholds()`, the thresholds the RayService render hands to each role's policy
(serving/engines/autoscaling.py) through `Target.role_thresholds`. A stack's `serving.<role>.signals`
overrides any of them (serving/spec/scaling.py `policy_config`).

- from the SLO (serving/spec/scaling.py `slo_thresholds`): prefill queue time at half the TTFT
  objective, p90 TTFT at it; decode p90 ITL at it, running sequences at the role's
  targetOngoingRequests, KV-cache usage at 90%;
- from the roofline (prefill only): the waiting requests one prefill replica clears within the
  half of the TTFT objective that queueing may take. A replica prefills at most
  TP x dense BF16 peak / (2 x parameters) tokens/s (the same bound as the plan's scale-out rate,
  infra/plan/planning.py `_scale_out_rps`), so one prompt of `prompt_tokens` takes
  prompt_tokens / that, and (TTFT / 2) / that many wait before the objective is at risk. It is
  an upper bound (no MFU): measured prefill speed lowers it; override with
  `serving.prefill.signals.waitingRequests`.

No Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping

from infra import catalog
from infra.sizing.fit import resolve
from serving.spec import Mode, ServingSpec
from serving.spec.scaling import slo_thresholds

# The prompt the planner's rates assume (infra/plan/planning.py Workload's default).
PROMPT_TOKENS = 1024


def prefill_seconds_per_prompt(
    parameters_billions: float, tensor_parallel_size: int, inst: catalog.InstanceType, prompt_tokens: int
) -> float | None:
    """Roofline seconds of one prompt on one prefill replica; None without a BF16 figure."""
    tflops = catalog.DENSE_BF16_TFLOPS.get(inst.ray_accelerator or "")
    if tflops is None:
        return None
    tokens_per_s = tensor_parallel_size * tflops * 1e12 / (2 * parameters_billions * 1e9)
    return prompt_tokens / tokens_per_s


def role_thresholds(
    serving: ServingSpec,
    instances: Mapping[str, catalog.InstanceType],
    *,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, dict[str, float]]:
    shape, _ = resolve(serving.model)
    ttft, itl = serving.slo.ttft_seconds, serving.slo.itl_seconds
    out: dict[str, dict[str, float]] = {}
    for role, spec in serving.engine_roles().items():
        thresholds = slo_thresholds(role, ttft, itl, spec.target_ongoing_requests)
        inst = instances.get(role)
        if role == "prefill" and serving.mode is Mode.DISAGGREGATED and shape is not None and inst is not None:
            per_prompt = prefill_seconds_per_prompt(
                shape.parameters_billions, spec.tensor_parallel_size, inst, prompt_tokens
            )
            if per_prompt is not None:
                thresholds["waiting_requests"] = max(1.0, round(ttft / 2 / per_prompt, 1))
        out[role] = thresholds
    return out
