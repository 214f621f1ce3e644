"""observability.tracing in a stack file: defaults per environment, the rate a stack sets, one-line errors.

The defaults are a documented promise (docs/observability.md, "Request traces"): the table
there is read and compared with what each shipped stack gets, so the two cannot drift.
"""

from __future__ import annotations

import copy
import re

import pytest

from infra import config
from infra.paths import ROOT
from tools import stackfile

SOURCE = "stacks/Pulumi.prod.yaml"


def _load(stack: str, observability: dict | None = None) -> config.StackConfig:
    values, secrets, _ = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    if observability is not None:
        values["observability"] = observability
    return config.load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")


def _documented_defaults() -> dict[str, float]:
    doc = (ROOT / "docs" / "observability.md").read_text()
    row = re.search(r"^\| `tracing\.sampleRate` \| (.+?) \|", doc, flags=re.M)
    assert row, "docs/observability.md lost the tracing.sampleRate row"
    return {env: float(rate) for env, rate in re.findall(r"(dev|staging|prod) ([0-9.]+)", row.group(1))}


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
def test_each_environment_traces_at_its_documented_default(stack):
    cfg = _load(stack)
    assert cfg.observability.tracing.enabled
    assert cfg.observability.tracing.rate_for(cfg.environment.value) == _documented_defaults()[cfg.environment.value]


def test_dev_traces_every_request_and_prod_fewer_than_staging():
    rates = {s: (c := _load(s)).observability.tracing.rate_for(c.environment.value) for s in ("dev", "staging", "prod")}
    assert rates["dev"] == 1.0 and rates["prod"] < rates["staging"] < rates["dev"]


def test_a_stack_sets_its_own_rate():
    cfg = _load("prod", {"tracing": {"sampleRate": 0.25, "retentionDays": 30}})
    assert cfg.observability.tracing.rate_for(cfg.environment.value) == 0.25
    assert cfg.observability.tracing.retention_days == 30


@pytest.mark.parametrize(
    "tracing_block, expected",
    [
        ({"sampleRate": 0}, "observability.tracing.sampleRate: Input should be greater than 0"),
        ({"sampleRate": 1.5}, "observability.tracing.sampleRate: 1.5: Input should be less than or equal to 1"),
        ({"sampleRate": "lots"}, "observability.tracing.sampleRate: 'lots': Input should be a valid number"),
        ({"rate": 0.1}, "observability.tracing.rate: unknown key"),
        ({"enabled": False, "sampleRate": 0.1}, "observability.tracing: sampleRate is set but tracing is off"),
        ({"retentionDays": 0}, "observability.tracing.retentionDays: 0: Input should be greater than or equal to 1"),
    ],
)
def test_mistakes_are_one_line_naming_the_key(tracing_block, expected):
    with pytest.raises(config.ConfigError) as e:
        _load("prod", {"tracing": tracing_block})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{SOURCE}: {expected}"), msg


def test_engines_cannot_be_pointed_elsewhere_through_engine_kwargs():
    """The stack's collector owns vLLM's otlp_traces_endpoint: a second source would fork it."""
    values, secrets, _ = stackfile.read_as_deployed("prod")
    values = copy.deepcopy(values)
    values["serving"]["engineKwargs"] = {"otlp_traces_endpoint": "http://elsewhere:4317"}
    with pytest.raises(config.ConfigError) as e:
        config.load(values, secret_keys=secrets, source=SOURCE)
    assert str(e.value).startswith(f"{SOURCE}: serving.engineKwargs: otlp_traces_endpoint set by the spec itself")
