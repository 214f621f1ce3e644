"""Serve autoscaling per role, as the spec renders it and Ray Serve reads it.

Upstream: ray/serve/config.py `AutoscalingConfig` (Ray 2.60): min/max/initial replicas,
target_ongoing_requests, upscale_delay_s, downscale_delay_s; unknown keys are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from local.config import LOCAL_DECODE_AUTOSCALING, render_local_config
from serving.spec import RoleSpec, ServingSpec, Target

MODEL = {"id": "m", "source": "org/model"}


def test_each_role_renders_its_own_autoscaling_for_serve():
    from ray.serve.config import AutoscalingConfig

    spec = ServingSpec.model_validate(
        {
            "model": MODEL,
            "prefill": {"maxReplicas": 3, "targetOngoingRequests": 4, "upscaleDelayS": 10},
            "decode": {"minReplicas": 2, "maxReplicas": 6, "targetOngoingRequests": 32, "downscaleDelayS": 900},
        }
    )
    args = spec.app_args(Target(accelerator_type="H100"))
    p = args["prefill_config"]["deployment_config"]["autoscaling_config"]
    d = args["decode_config"]["deployment_config"]["autoscaling_config"]
    assert (p["max_replicas"], p["target_ongoing_requests"], p["upscale_delay_s"]) == (3, 4, 10)
    assert (d["min_replicas"], d["max_replicas"], d["target_ongoing_requests"], d["downscale_delay_s"]) == (
        2,
        6,
        32,
        900,
    )
    for cfg in (p, d):
        AutoscalingConfig.model_validate(cfg)  # Serve accepts every key we render


def test_a_target_no_replica_can_reach_is_refused():
    with pytest.raises(ValidationError, match="targetOngoingRequests"):
        RoleSpec.model_validate({"targetOngoingRequests": 100, "maxOngoingRequests": 64})


def test_make_serve_runs_decode_with_autoscaling_and_the_aggregated_app_without():
    config = render_local_config("both", Path("/tmp/model"), port=8000)
    apps = {a["name"]: a["args"] for a in config["applications"]}
    decode = apps["llm"]["decode_config"]["deployment_config"]["autoscaling_config"]
    assert (decode["min_replicas"], decode["max_replicas"]) == (1, 2)
    assert decode["target_ongoing_requests"] == LOCAL_DECODE_AUTOSCALING["targetOngoingRequests"]
    agg = apps["llm-aggregated"]["llm_configs"][0]["deployment_config"]["autoscaling_config"]
    assert agg["max_replicas"] == 1
