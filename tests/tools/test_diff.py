"""`make diff A=... B=...` (`python -m tools.diff`): what differs between two stacks, by key path.

What flows through here: two stack files -> `tools.diff` (their values, and every resource the
real program registers under mocks) -> a report whose lines the tests read as a reviewer
would: the instance types and node counts that differ, secrets never shown, identical
resources counted, not listed.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
import yaml

from infra.paths import ROOT
from tools import diff, render, stackfile


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.diff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _ciphertext() -> str:
    """Shaped like Pulumi's symmetric-crypter output (v1:<12-byte nonce>:<ciphertext+tag>)."""
    return f"v1:{base64.b64encode(os.urandom(12)).decode()}:{base64.b64encode(os.urandom(40)).decode()}"


# The secrets each stack's owner has set in a deployed checkout (the shipped files hold none).
DEPLOYED_SECRETS = {"staging": ("apiKeys", "hfToken"), "prod": ("apiKeys",)}


@pytest.fixture(scope="module")
def staging_prod(tmp_path_factory) -> str:
    stacks_dir = tmp_path_factory.mktemp("stacks")
    for stack, keys in DEPLOYED_SECRETS.items():
        doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())
        for key in keys:
            doc["config"][f"pd-inference:{key}"] = {"secure": _ciphertext()}
        (stacks_dir / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run(
        [sys.executable, "-m", "tools.diff", "staging", "prod"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PD_STACKS_DIR": str(stacks_dir)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    return r.stdout


def _block(out: str, header: str) -> list[str]:
    """The change lines under one resource's header line."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip() == header)
    block = []
    for line in lines[i + 1 :]:
        if not line.startswith("      "):
            break
        block.append(line.strip())
    return block


def test_stack_files_differences_by_key_path(staging_prod):
    for line in [
        "~ environment: staging -> prod",
        "~ aws:region: us-east-2 -> us-east-1",
        "~ nodePools.prefill.instanceType: p4de.24xlarge -> p5.48xlarge",
        "~ nodePools.decode.instanceType: p4de.24xlarge -> p5.48xlarge",
        "~ nodePools.decode.minSize: 1 -> 2",
        "~ nodePools.decode.desiredSize: 1 -> 2",
        "~ nodePools.decode.maxSize: 2 -> 6",
        "+ natGateways: per-zone",
        "+ adminRoleArns[]: arn:aws:iam::123456789012:role/platform-oncall",
    ]:
        assert f"  {line}\n" in staging_prod, line


def test_secrets_are_named_never_shown(staging_prod):
    assert "  - hfToken: <secret>\n" in staging_prod
    assert "placeholder" not in staging_prod  # neither ciphertext nor the render's stand-in values
    assert "apiKeys" not in staging_prod  # both have it: a secret is not compared


def test_node_groups_name_instance_type_and_node_counts(staging_prod):
    decode = _block(staging_prod, "~ eks:index:ManagedNodeGroup gpu-decode-ng")
    assert '~ instanceTypes: ["p4de.24xlarge"] -> ["p5.48xlarge"]' in decode
    assert "~ scalingConfig.desiredSize: 1 -> 2" in decode
    assert "~ scalingConfig.minSize: 1 -> 2" in decode
    assert "~ scalingConfig.maxSize: 2 -> 6" in decode
    prefill = _block(staging_prod, "~ eks:index:ManagedNodeGroup gpu-prefill-ng")
    assert "~ scalingConfig.maxSize: 2 -> 3" in prefill
    assert not any("desiredSize" in line for line in prefill)  # 1 in both


def test_manifests_are_diffed_and_named_by_file(staging_prod):
    rs = _block(staging_prod, "~ kubernetes:ray.io/v1:RayService llm-rayservice (manifests/rayservice-llm-llm.yaml)")
    # serveConfigV2 is a YAML string in the manifest; its keys are compared, not its text.
    assert "~ spec.serveConfigV2.applications[0].args.prefill_config.accelerator_type: A100 -> H100" in rs
    assert (
        "~ spec.rayClusterConfig.workerGroupSpecs[0].template.spec.nodeSelector"
        "[node.kubernetes.io/instance-type]: p4de.24xlarge -> p5.48xlarge"
    ) in rs
    assert "~ spec.serveService.spec.type: ClusterIP -> LoadBalancer" in rs
    assert "  + kubernetes:core/v1:Secret llm-redis-secret\n" in staging_prod
    assert "  - kubernetes:core/v1:Secret llm-hf-token-secret\n" in staging_prod


def test_identical_resources_are_summarized_not_listed(staging_prod):
    summary = [line for line in staging_prod.splitlines() if line.startswith("  = ")]
    assert len(summary) == 1 and "identical resources (" in summary[0]
    n = int(summary[0].split()[1])
    assert n > 10
    # The namespaces and KubeRay's chart are the same in both: counted, not listed.
    assert "kubernetes:core/v1:Namespace" not in staging_prod
    assert "5 kubernetes:Namespace" in summary[0]
    # A change common to many resources (the environment tag) is said once.
    common = [line for line in staging_prod.splitlines() if "~ tags.pd-inference/environment: staging -> prod" in line]
    assert len(common) == 1 and "resources]" in common[0]
    # The EFA launch templates' instance tags (tagSpecifications) are another path: fewer than
    # COMMON_MIN resources carry it, so each is listed with its template.
    nested = [
        line for line in staging_prod.splitlines() if "tagSpecifications[0].tags.pd-inference/environment" in line
    ]
    assert len(nested) < diff.COMMON_MIN


def test_identical_stacks_show_no_differences(tmp_path, monkeypatch):
    d = tmp_path / "stacks"
    d.mkdir()
    text = stackfile.path_of("dev").read_text()
    (d / "Pulumi.dev.yaml").write_text(text)
    (d / "Pulumi.dev-copy.yaml").write_text(text)
    monkeypatch.setattr(stackfile, "STACKS_DIR", d)
    a, b = diff.from_stack("dev"), diff.from_stack("dev-copy")
    report = diff.compare(a, b)
    assert report.empty, diff.format_report(report)
    out = diff.format_report(report)
    assert out.endswith("No differences.")
    assert "identical values" in out
    assert f"= {len(a.resources)} identical resources" in out
    # The names differ (pd-inference-dev vs pd-inference-dev-copy): normalizing them is what
    # makes the two equal.
    raw = [r for r in b.resources if "pd-inference-dev-copy" in json.dumps(r.inputs)]
    assert raw


def test_changes_by_key_path():
    a = {"spec": {"replicas": 1, "ports": [{"port": 80}], "zones": ["a", "b"]}, "gone": {"x": 1}}
    b = {"spec": {"replicas": 2, "ports": [{"port": 80}, {"port": 443}], "zones": ["a", "b", "c"]}, "new": "y"}
    lines = [c.line() for c in diff.changes(a, b)]
    assert lines == [
        "~ spec.replicas: 1 -> 2",
        "+ spec.ports[1].port: 443",
        "+ spec.zones[]: c",
        "- gone.x: 1",
        "+ new: y",
    ]
    policy_a = json.dumps({"Statement": [{"Action": ["s3:GetObject"]}]})
    policy_b = json.dumps({"Statement": [{"Action": ["s3:GetObject", "s3:ListBucket"]}]})
    assert [c.line() for c in diff.changes({"policy": policy_a}, {"policy": policy_b})] == [
        "+ policy.Statement[0].Action[]: s3:ListBucket"
    ]
    assert diff.changes({"k": [1, 2]}, {"k": [2, 1]})[0].line() == "~ k: [1, 2] -> [2, 1]"


def test_rendered_directories_for_pull_requests(tmp_path, rendered_stacks):
    base, head = tmp_path / "base" / "dev", tmp_path / "head" / "dev"
    render.write(rendered_stacks["dev"], base)
    render.write(rendered_stacks["dev"], head)
    r = _cli("--rendered", "--markdown", "--title", "dev", str(base), str(head))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "### dev: no changes\n"

    # The head changes the decode pool: the summary says so, folded, by key path.
    res = json.loads((head / "resources.json").read_text())
    ng = next(x for x in res if x["name"] == "gpu-decode-ng")
    ng["inputs"]["scalingConfig"]["maxSize"] = 5
    (head / "resources.json").write_text(json.dumps(res))
    r = _cli(
        "--rendered",
        "--markdown",
        "--title",
        "dev",
        "--labels",
        "base branch",
        "this pull request",
        str(base),
        str(head),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("### dev: 1 changed, 0 added, 0 removed\n")
    assert "Differences from base branch (A) to this pull request (B)" in r.stdout
    assert "<details>" in r.stdout and "~~~diff\n" in r.stdout
    assert "      ~ scalingConfig.maxSize: 3 -> 5\n" in r.stdout

    # A stack new in the pull request has no base render.
    r = _cli("--rendered", "--allow-missing", "--markdown", "--title", "dev", str(tmp_path / "none"), str(head))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"### dev: 0 changed, {len(res)} added, 0 removed")


@pytest.mark.parametrize(
    "args, starts",
    [
        (["staging", "nosuch"], "stacks/Pulumi.nosuch.yaml: no such stack file"),
        (["--rendered", "/nonexistent/a", "/nonexistent/b"], "/nonexistent/a/resources.json: no such file"),
    ],
)
def test_errors_are_one_line(args, starts):
    r = _cli(*args)
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith(starts) and r.stderr.count("\n") == 1
