"""Pulumi's own config check, run over Pulumi.yaml and every stack file we ship or write.

Contract: pulumi/pulumi `pkg/workspace/config.go` (`mergeConfig`, `validateStackConfigValues`;
the function lived in sdk/go/common/workspace/config.go before, mirror of 2026-08), with
`sdk/go/common/workspace/project.go` (`Project.Validate`, `ValidateConfigValue`) and
`sdk/go/common/resource/config/crypt.go` (`symmetricCrypter.DecryptValue`). Reproduced in
`tests.upstream.merge_config`: a declared key with no `default` that a stack lacks stops the
run ("missing configuration values"); every `secure:` value is decrypted before the program
runs; a key declared `secret: true` must hold a secure value in the merged config.
Then the program's own check: with the merged config (Pulumi's defaults applied) the program
either runs, or stops with ONE line naming `pulumi config set --secret <key>`.
"""

from __future__ import annotations

import copy
from string import Template
from typing import Any

import pulumi
import pytest
import yaml

from infra import versions
from infra.config import PROJECT
from infra.paths import ROOT
from tests.conftest import STACKS
from tests.upstream import PulumiConfigError, merge_config
from tools import mock_runtime, newstack, stackfile

PROJECT_DOC = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())


def _stack_doc(stack: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())


def _new_stack_doc() -> dict[str, Any]:
    return yaml.safe_load(newstack.text_for("team-x"))


# --- mirror sanity tests: tests.upstream.merge_config alone, on cases whose answer Pulumi's
# source gives (the messages are Pulumi's). They test the mirror, not the project; the tests
# under "what we ship" apply the same mirror to Pulumi.yaml, every stack and both templates.
def test_mirror_sanity_missing_declared_keys_are_reported_like_pulumi():
    project = {
        "name": "p",
        "config": {"a": {"type": "string"}, "b": {"type": "string"}, "c": {"type": "string", "default": ""}},
    }
    with pytest.raises(PulumiConfigError, match="Stack 'dev' is missing configuration values 'a' and 'b'"):
        merge_config(project, {"config": {}}, "dev")
    assert merge_config(project, {"config": {"p:a": "x", "p:b": "y"}}, "dev")["p:c"] == ""


def test_mirror_sanity_placeholder_ciphertext_and_undeclared_secret_defaults_are_refused():
    project = {"name": "p", "config": {"k": {"type": "string", "secret": True, "default": ""}}}
    # Today's stacks carried this: not base64, so no secrets provider can decrypt it.
    fake = {"config": {"p:k": {"secure": "v1:placeholder:replace-with-pulumi-config-set-secret-apiKeys"}}}
    with pytest.raises(PulumiConfigError, match="failed to decrypt"):
        merge_config(project, fake, "dev")
    # A secret declared with a default and absent from the stack: the default is plain text.
    with pytest.raises(PulumiConfigError, match="must be encrypted as it's secret"):
        merge_config(project, {"config": {}}, "dev")
    real = {"config": {"p:k": {"secure": "v1:AAAAAAAAAAAAAAAA:" + "A" * 44}}}
    merge_config(project, real, "dev")


def test_mirror_sanity_declared_keys_are_type_checked():
    project = {"name": "p", "config": {"zones": {"type": "array", "items": {"type": "string"}}}}
    with pytest.raises(PulumiConfigError, match="must be of type"):
        merge_config(project, {"config": {"p:zones": "us-east-2a"}}, "dev")
    merge_config(project, {"config": {"p:zones": ["us-east-2a"]}}, "dev")


# --- what we ship ------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
def test_pulumi_accepts_every_shipped_stack(stack):
    merge_config(PROJECT_DOC, _stack_doc(stack), stack)


def test_pulumi_accepts_the_new_stack_template():
    merge_config(PROJECT_DOC, _new_stack_doc(), "team-x")


def test_pulumi_accepts_the_pulumi_new_template():
    """templates/pd-inference: `pulumi new` writes each `template.config` default as a plain
    string value, and the prompted secrets encrypted, into the new stack's file
    (pkg/cmd/pulumi/project/newcmd/config.go, encryptTemplateConfig). That project's own
    Pulumi.yaml is the one Pulumi checks them against."""
    template = yaml.safe_load((ROOT / "templates" / "pd-inference" / "Pulumi.yaml").read_text())
    config = {}
    for key, spec in template["template"]["config"].items():
        config[key] = {"secure": "v1:AAAAAAAAAAAAAAAA:" + "A" * 44} if spec.get("secret") else str(spec["default"])
    merge_config(template, {"config": config}, "team-t")
    assert "amiReleaseVersion" in " ".join(template["template"]["config"])


def test_every_key_a_stack_may_leave_out_is_legal_to_leave_out():
    """Only the keys every stack must decide are required; each other declared key has a default."""
    required = {k for k, d in PROJECT_DOC["config"].items() if d.get("default") is None and d.get("value") is None}
    assert required == {"environment", "availabilityZones", "amiReleaseVersion"}
    minimal = {
        "config": {
            f"{PROJECT}:{k}": v
            for k, v in {
                "environment": "dev",
                "availabilityZones": ["us-east-2a", "us-east-2b"],
                "amiReleaseVersion": versions.AMI_RELEASE_VERSION,
            }.items()
        }
    }
    merge_config(PROJECT_DOC, minimal, "minimal")


@pytest.mark.parametrize("stack", STACKS)
def test_no_fake_ciphertext_is_committed(stack):
    text = (ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text()
    assert "placeholder" not in text
    for value in (_stack_doc(stack).get("config") or {}).values():
        assert not (isinstance(value, dict) and "secure" in value), f"{stack}: a committed secure: value"


def test_the_old_stack_files_would_have_been_refused():
    """The check bites: yesterday's prod file (efaZone set, modelBucket set, but placeholder
    ciphertext and no amiReleaseVersion) fails it, as `pulumi up` failed."""
    doc = copy.deepcopy(_stack_doc("prod"))
    del doc["config"][f"{PROJECT}:amiReleaseVersion"]
    with pytest.raises(PulumiConfigError, match="missing configuration value 'amiReleaseVersion'"):
        merge_config(PROJECT_DOC, doc, "prod")
    doc = copy.deepcopy(_stack_doc("prod"))
    doc["config"][f"{PROJECT}:apiKeys"] = {"secure": "v1:placeholder:replace-with-pulumi-config-set-secret-apiKeys"}
    with pytest.raises(PulumiConfigError, match="failed to decrypt"):
        merge_config(PROJECT_DOC, doc, "prod")


# --- then the program, on exactly what Pulumi hands it ------------------------------------------
def _program_values(doc: dict[str, Any], stack: str) -> tuple[dict, set, dict]:
    merged = merge_config(PROJECT_DOC, doc, stack)
    return stackfile.parse(yaml.safe_dump({"config": merged}), stackfile.paths.stack_file(stack))


@pytest.mark.parametrize("stack", STACKS)
def test_program_names_the_secret_to_set_or_runs(stack):
    values, secrets, others = _program_values(_stack_doc(stack), stack)
    try:
        result = mock_runtime.run(stack, values, secrets, others)
    except pulumi.RunError as err:
        line = str(err)
        assert "\n" not in line and line.startswith(f"stacks/Pulumi.{stack}.yaml: ")
        assert "pulumi config set --secret apiKeys" in line
        assert err.registered == []  # type: ignore[attr-defined]
        # Once the owner has set them, the same stack runs: the API keys, and the AUTH token of
        # an external GCS Redis (required there, infra/config/secrets.py).
        deployed, dsecrets, _ = stackfile.read_as_deployed(stack)
        redis = {"gcsRedisPassword"} if values.get("gcsFaultTolerance") == "external-redis" else set()
        assert set(dsecrets) - set(secrets) == {"apiKeys", *redis}
        mock_runtime.run(stack, deployed, dsecrets, others)
    else:  # a stack whose config needs no secret (auth disabled) runs as it is
        assert result.resources


def test_optional_secrets_may_stay_unset():
    """hfToken (public models) is optional: a stack without it runs, and its pods get no
    reference to a Secret that does not exist. (gcsRedisPassword is not: an external GCS
    Redis needs AUTH, tests/infra/config/test_stack.py.)"""
    values, secrets, others = stackfile.read_as_deployed("staging")
    assert "hfToken" not in values
    result = mock_runtime.run("staging", values, secrets, others)
    names = [r.inputs.get("metadata", {}).get("name") for r in result.of_type("kubernetes:core/v1:Secret")]
    assert not any(n and "hf-token" in n for n in names)


def test_new_stack_text_is_a_template_of_the_rule():
    # The written template must keep every required key (otherwise `make stack` writes a file
    # Pulumi refuses): substitute and check, as test_pulumi_accepts_the_new_stack_template does.
    text = Template((ROOT / "templates" / "new-stack.yaml").read_text())
    assert "ami_release_version" in text.template
