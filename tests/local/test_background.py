"""local/background.py plan_stack: background_stack's arguments -> what `python -m local` would
deploy, through that command's own parsing and render, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from local.background import plan_stack
from local.config import LocalConfigError, render_local_config

ENV = {"PATH": "/usr/bin"}
MODEL = Path("/models/plan")


def test_the_plan_is_the_render_of_the_same_options():
    plan = plan_stack(mode="both", port=8123, environ=ENV, model_dir=MODEL)
    assert plan.argv[1:3] == ["-m", "local"] and "--no-auth" not in plan.argv
    assert plan.config == render_local_config("both", MODEL, port=8123)
    plan = plan_stack(mode="disaggregated", api_key=None, extra_args=["--decode-replicas", "2"], environ=ENV)
    assert plan.config == render_local_config("disaggregated", MODEL, port=8000, auth=False, decode_replicas=2)


def test_the_environment_and_extra_env_reach_the_command_as_they_would():
    plan = plan_stack(mode="disaggregated", environ={**ENV, "PD_REPLICAS": "2"}, extra_env={"PD_DATA_PLANE": "grpc"})
    assert plan.config == render_local_config(
        "disaggregated", MODEL, port=8000, prefill_replicas=2, decode_replicas=2, data_plane="grpc"
    )
    assert plan.ray_env == plan_stack(mode="both", environ=ENV, extra_args=["--data-plane", "grpc"]).ray_env


@pytest.mark.parametrize(
    "options",
    [
        {"extra_env": {"PD_FALLBACK_BASE_URL": "http://127.0.0.1:9/v1", "PD_FALLBACK_OVERFLOW_AT": "two"}},
        {"extra_env": {"PD_FALLBACK_MODEL": "m"}},
        {"mode": "both", "extra_args": ["--models", "2"]},
    ],
)
def test_a_setting_the_command_refuses_raises_here(options):
    with pytest.raises(LocalConfigError):
        plan_stack(**{"mode": "disaggregated", **options}, environ=ENV)
