"""The policy pack as the Pulumi engine meets it: `policies/__main__.py` running, spoken to over gRPC.

What flows through here: `python -u policies/__main__.py` in a subprocess (as Pulumi's
analyzer host starts it; never imported here, PolicyPack() serves forever) prints its port ->
the engine's own calls: GetAnalyzerInfo (every rule, with its enforcement level) and Analyze
with real rendered inputs as a protobuf Struct -> a violating resource gets a mandatory
diagnostic with the fix in its message, a clean one gets none. The subprocess is killed after.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime import proto
from pulumi.runtime.proto import analyzer_pb2_grpc

from infra.paths import ROOT
from policies import rules
from policies.rules.inputs import EKS_CLUSTER, PROJECT


@pytest.fixture(scope="module")
def analyzer():
    proc = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "policies" / "__main__.py")],
        cwd=ROOT / "policies",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()  # PolicyPack prints its port, then serves
        assert line.isdigit(), (
            f"the pack did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{line}")
        grpc.channel_ready_future(channel).result(timeout=30)
        yield analyzer_pb2_grpc.AnalyzerStub(channel)
        channel.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _analyze(stub, type_: str, name: str, inputs: dict, stack: str = "prod"):
    props = struct_pb2.Struct()
    props.update(inputs)
    request = proto.AnalyzeRequest(
        type=type_,
        properties=props,
        urn=f"urn:pulumi:{stack}::{PROJECT}::{type_}::{name}",
        name=name,
    )
    return stub.Analyze(request, timeout=30).diagnostics


def test_the_engine_sees_every_rule(analyzer) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
    assert info.name == "pd-inference-guardrails"
    levels = {p.name: p.enforcementLevel for p in info.policies}
    expected = {r.name: proto.MANDATORY if r.level is rules.MANDATORY else proto.ADVISORY for r in rules.RULES}
    assert levels == expected


def test_a_violation_fails_the_preview(analyzer, rendered_stacks) -> None:
    cluster = next(r for r in rendered_stacks["prod"].result.resources if r.type == EKS_CLUSTER)
    assert [
        d
        for d in _analyze(analyzer, cluster.type, cluster.name, cluster.inputs)
        if d.enforcementLevel == proto.MANDATORY
    ] == []
    broken = {**cluster.inputs, "endpointPublicAccess": True}
    broken.pop("encryptionConfigKeyArn")
    diagnostics = _analyze(analyzer, cluster.type, cluster.name, broken)
    mandatory = {d.policyName: d.message for d in diagnostics if d.enforcementLevel == proto.MANDATORY}
    assert set(mandatory) == {"eks-endpoint-allow-list", "eks-secrets-encryption"}
    assert "publicAccessCidrs" in mandatory["eks-endpoint-allow-list"]
    assert "encryptionConfigKeyArn" in mandatory["eks-secrets-encryption"]
    advisory = {d.policyName for d in diagnostics if d.enforcementLevel == proto.ADVISORY}
    assert advisory == {"eks-endpoint-private"}
