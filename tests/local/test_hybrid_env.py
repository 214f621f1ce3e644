"""local/config.py: make serve's PD_FALLBACK_* and PD_LIMIT_* settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.paths import ROOT
from local.config import LocalConfigError, hybrid_from_env, render_local_config
from serving.spec import INGRESS_DEPLOYMENT

MODEL_DIR = Path("/models/tiny")


def _user_config(config, app="llm"):
    a = next(a for a in config["applications"] if a["name"] == app)
    return next(d["user_config"] for d in a["deployments"] if d["name"] == INGRESS_DEPLOYMENT)


def test_no_variables_no_fallback_no_limits():
    assert hybrid_from_env({}) == {}
    uc = _user_config(render_local_config("disaggregated", MODEL_DIR, port=8000))
    assert uc["fallback"] is None and uc["limits"]["requests_per_minute"] == 0


def test_variables_become_the_spec_sections_in_every_app():
    env = {
        "PD_FALLBACK_BASE_URL": "http://127.0.0.1:9000/v1",
        "PD_FALLBACK_MODEL": "ext-model",
        "PD_FALLBACK_OVERFLOW_AT": "3",
        "PD_LIMIT_RPM": "100",
        "PD_LIMIT_TPM": " 5000 ",
        "PD_FALLBACK_API_KEY": "sk-provider",
    }
    hybrid = hybrid_from_env(env)
    config = render_local_config("both", MODEL_DIR, port=8000, hybrid=hybrid)
    for app in ("llm", "llm-aggregated"):
        uc = _user_config(config, app)
        assert uc["fallback"]["base_url"] == "http://127.0.0.1:9000/v1"
        assert uc["fallback"]["models"] == {"tiny-llama": "ext-model"}
        assert uc["fallback"]["overflow_at"] == 3
        assert (uc["limits"]["requests_per_minute"], uc["limits"]["tokens_per_minute"]) == (100, 5000)
    assert "sk-provider" not in repr(config)  # the key is read by the replicas, never rendered


def test_model_defaults_to_ours():
    assert hybrid_from_env({"PD_FALLBACK_BASE_URL": "http://x/v1"})["fallback"]["model"] == "tiny-llama"


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"PD_LIMIT_RPM": "lots"}, "PD_LIMIT_RPM='lots' is not a whole number"),
        ({"PD_FALLBACK_MODEL": "m"}, "PD_FALLBACK_BASE_URL is not"),
    ],
)
def test_bad_variables_are_named(env, fragment):
    with pytest.raises(LocalConfigError, match=fragment):
        hybrid_from_env(env)


def test_invalid_values_are_one_line_naming_the_field():
    with pytest.raises(LocalConfigError) as err:
        render_local_config(
            "disaggregated", MODEL_DIR, port=8000, hybrid=hybrid_from_env({"PD_FALLBACK_BASE_URL": "ftp://x"})
        )
    msg = str(err.value)
    assert "\n" not in msg and "fallback.baseUrl" in msg and "is not an http(s) URL" in msg


def test_make_serve_refuses_a_bad_setting_before_starting_anything():
    import os

    env = {**os.environ, "PD_LIMIT_TPM": "-5"}
    r = subprocess.run(
        [sys.executable, "-m", "local", "--port", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("error: the PD_FALLBACK_*/PD_LIMIT_* settings are not valid: limits.tokensPerMinute")
