"""Running the real Pulumi program offline, under Pulumi's mock runtime.

What flows through here: a stack name and its config values -> `__main__.py`, executed as
`pulumi up` would execute it but against a mock engine -> every resource it registered
(type, name, parent, inputs, and the dependencies the SDK sent the engine with it: what
tools/creation_order.py orders) and the stack outputs. `tools.render`, `make bench` and the
tests use this; nothing here talks to AWS or Kubernetes.

Two facts shape it (see the project's field notes):
- Pulumi's default mock monitor rebuilds resource references on worker threads, which races
  ("attached to a different loop") in programs that pass resources as inputs. The monitor
  here does not advertise the resourceReferences feature, so such inputs arrive as URNs.
- Remote components (eks.Cluster, eks.ManagedNodeGroup, helm.v4.Chart) register as ONE
  resource; outputs the program reads from them must come from `new_resource` below.
"""

from __future__ import annotations

import asyncio
import json
import runpy
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import mocks as _mocks
from pulumi.runtime import rpc
from pulumi.runtime.proto import resource_pb2
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.config import PROJECT
from infra.paths import ROOT

PROGRAM = ROOT / "__main__.py"
FAKE_ACCOUNT = "123456789012"


@dataclass
class Registered:
    type: str
    name: str
    parent: str | None
    inputs: dict[str, Any]
    provider: str | None = None  # "urn::id" of an explicit provider, if any
    # Names of every dependency the SDK sent with the registration: explicit depends_on and the
    # resources whose outputs flow into the inputs (`dependencies` of RegisterResourceRequest).
    depends_on: list[str] = field(default_factory=list)
    secret_inputs: list[str] = field(default_factory=list)  # top-level inputs that are (or hold) Pulumi secrets
    urn: str = ""
    # The same dependencies as URNs, as the engine gets them; and per input, the URNs of the
    # resources whose outputs flow into it (`propertyDependencies`).
    dependency_urns: list[str] = field(default_factory=list)
    property_dependencies: dict[str, list[str]] = field(default_factory=dict)
    # A custom resource (the engine creates it) or a remote component (pulumi-eks, Helm v4:
    # one node whose construction waits for its children); neither: a local component, which
    # the engine never creates and a dependency on it stands for its children.
    custom: bool = True
    remote: bool = False
    id: str = ""  # the id the mock gave it (custom resources)

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "name": self.name, "parent": self.parent, "inputs": self.inputs}


@dataclass
class RunResult:
    resources: list[Registered] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, type_: str) -> list[Registered]:
        return [r for r in self.resources if r.type == type_]

    def one(self, type_: str, name: str | None = None) -> Registered:
        found = [r for r in self.of_type(type_) if name is None or r.name == name]
        if len(found) != 1:
            raise LookupError(f"expected one {type_} {name or ''}, found {[r.name for r in found]}")
        return found[0]


_local = threading.local()


def _name_from_urn(urn: str) -> str | None:
    # Children of the stack itself have no parent worth naming.
    if not urn or "::pulumi:pulumi:Stack::" in urn:
        return None
    return urn.rsplit("::", 1)[-1]


def _holds_secret(value: Any) -> bool:
    if isinstance(value, dict) and value.get(rpc._special_sig_key) == rpc._special_secret_sig:
        return True
    if isinstance(value, dict):
        return any(_holds_secret(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_secret(v) for v in value)
    return False


def _plain(value: Any) -> Any:
    """Inputs as JSON-able data (secrets unwrapped: offline they hold placeholders)."""
    if isinstance(value, dict) and value.get(rpc._special_sig_key) == rpc._special_secret_sig:
        return _plain(value.get("value"))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # the wire format has one number type; integers read better
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, pulumi.FileAsset):
        return {"asset": "file", "path": Path(value.path).name}
    if isinstance(value, pulumi.asset.Asset | pulumi.asset.Archive):
        return {"asset": type(value).__name__}
    return str(value)


class _Mocks(pulumi.runtime.Mocks):
    def __init__(self, recorder: list[Registered]):
        self.recorder = recorder

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        parent = getattr(_local, "parent", None)
        dependency_urns = list(getattr(_local, "dependencies", []))
        deps = [n for n in map(_name_from_urn, dependency_urns) if n]
        secret_inputs = sorted(k for k, v in args.inputs.items() if _holds_secret(v))
        rid = f"{args.name}-id"
        self.recorder.append(
            Registered(
                args.typ,
                args.name,
                _name_from_urn(parent or ""),
                _plain(args.inputs),
                args.provider or None,
                deps,
                secret_inputs,
                urn=getattr(_local, "urn", ""),
                dependency_urns=dependency_urns,
                property_dependencies=dict(getattr(_local, "property_dependencies", {})),
                custom=bool(args.custom),
                remote=getattr(_local, "remote", False),
                id=rid,
            )
        )
        name = args.inputs.get("name") or args.name
        state = dict(args.inputs)
        state.setdefault("name", name)
        state.setdefault("arn", f"arn:aws:mock:us-east-1:{FAKE_ACCOUNT}:{args.typ.split(':')[-1].lower()}/{name}")
        if args.typ == "eks:index:Cluster":
            kubeconfig = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": name,
                        "cluster": {"server": f"https://{name}.eks.mock", "certificate-authority-data": "bW9jaw=="},
                    }
                ],
                "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
                "current-context": name,
                "users": [
                    {
                        "name": name,
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1beta1",
                                "command": "aws",
                                "args": ["eks", "get-token", "--cluster-name", name],
                            }
                        },
                    }
                ],
            }
            state.update(
                kubeconfig=kubeconfig,
                kubeconfigJson=json.dumps(kubeconfig),
                oidcIssuer=f"https://oidc.eks.us-east-1.amazonaws.com/id/{name.upper()}",
                oidcProviderArn=f"arn:aws:iam::{FAKE_ACCOUNT}:oidc-provider/oidc.eks.mock/{name}",
                clusterSecurityGroupId="sg-0cluster0000000001",
            )
        elif args.typ == "aws:s3/bucket:Bucket":
            bucket = (args.inputs.get("bucketPrefix") or f"{args.name}-") + "mock0001"
            state.update(bucket=bucket, arn=f"arn:aws:s3:::{bucket}")
        elif args.typ == "aws:kms/key:Key":
            state.update(keyId=f"mock-key-{args.name}")
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            state.update(latestVersion=1)
        elif args.typ == "random:index/randomPassword:RandomPassword":
            # A stand-in of the requested length (the provider generates it at create time).
            state.update(result=("MockAuth0" * 20)[: int(args.inputs.get("length") or 16)])
        elif args.typ == "aws:elasticache/replicationGroup:ReplicationGroup":
            rid = args.inputs.get("replicationGroupId") or args.name
            state.update(
                primaryEndpointAddress=f"master.{rid}.mock01.use1.cache.amazonaws.com",
                readerEndpointAddress=f"replica.{rid}.mock01.use1.cache.amazonaws.com",
            )
        elif args.typ == "aws:ecr/repository:Repository":
            state.update(
                registryId=FAKE_ACCOUNT, repositoryUrl=f"{FAKE_ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/{name}"
            )
        return rid, state

    # Pulumi's MockMonitor.Invoke takes a plain dict as well as the (outputs, failures) tuple that
    # Mocks.call's annotation names (pulumi/runtime/mocks.py, pulumi 3.272): a dict is all we return.
    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:  # type: ignore[override]
        if args.token == "aws:eks/getCluster:getCluster":
            return {"name": args.args.get("name"), "vpcConfig": {"clusterSecurityGroupId": "sg-0eksmanaged000001"}}
        if args.token == "aws:ecr/getAuthorizationToken:getAuthorizationToken":
            return {"userName": "AWS", "password": "mock-ecr-token", "authorizationToken": "bW9jaw==", "id": "mock"}
        return {}


class _Monitor(_mocks.MockMonitor):
    """The mock monitor without resource references (the race fix), recording parents."""

    def SupportsFeature(self, request: resource_pb2.SupportsFeatureRequest) -> Any:
        has = request.id not in ("outputValues", "resourceReferences")
        return type("SupportsFeatureResponse", (object,), {"hasSupport": has})

    def GetDeploymentInfo(self, request: Any) -> resource_pb2.DeploymentInfo:
        info = super().GetDeploymentInfo(request)
        kept = [f for f in info.supportedFeatures if f != resource_pb2.RESOURCE_MONITOR_FEATURE_RESOURCE_REFERENCES]
        return resource_pb2.DeploymentInfo(supportedFeatures=kept)

    def RegisterResource(self, request: resource_pb2.RegisterResourceRequest) -> Any:
        _local.parent = request.parent
        _local.dependencies = list(request.dependencies)
        _local.property_dependencies = {k: list(v.urns) for k, v in request.propertyDependencies.items()}
        _local.urn = self.make_urn(request.parent, request.type, request.name)
        _local.remote = bool(request.remote)
        try:
            return super().RegisterResource(request)
        finally:
            _local.parent = None
            _local.dependencies = []
            _local.property_dependencies = {}
            _local.urn = ""
            _local.remote = False


def config_map(values: dict[str, Any], others: dict[str, Any] | None = None) -> dict[str, str]:
    """Config as Pulumi hands it to a program: namespaced keys, structured values as JSON."""
    out = {f"{PROJECT}:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}
    for k, v in (others or {}).items():
        out[k] = v if isinstance(v, str) else json.dumps(v)
    return out


def project_defaults(project_file: Path = ROOT / "Pulumi.yaml") -> dict[str, Any]:
    """The `default`s of the project's declared config keys (bare names). Pulumi merges them
    into every stack's config before the program runs (pkg/workspace/config.go, mergeConfig)."""
    import yaml

    declared = (yaml.safe_load(project_file.read_text()) or {}).get("config") or {}
    return {k: d["default"] for k, d in declared.items() if isinstance(d, dict) and d.get("default") is not None}


def run(
    stack: str,
    values: dict[str, Any],
    secret_keys: set[str] | None = None,
    others: dict[str, Any] | None = None,
    program: Path = PROGRAM,
) -> RunResult:
    """Run __main__.py for `stack` with these config values.

    Raises what the program raises (a bad stack file: pulumi.RunError with the one-line
    message), with the resources registered before the error as `err.registered`.
    """
    result = RunResult()
    mocks = _Mocks(result.resources)
    # Pulumi's mocks need a current event loop; asyncio.run() elsewhere in the same process
    # (the serving tests) leaves the main thread without one.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        try:
            loop = asyncio.get_event_loop_policy().get_event_loop()
            if loop.is_closed():
                raise RuntimeError("closed")
        except RuntimeError:
            asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=False, monitor=_Monitor(mocks))
    secret_full = [f"{PROJECT}:{k}" for k in (secret_keys or set())]
    # What the program sees under `pulumi up`: the stack's values over the project's defaults.
    merged = {**project_defaults(), **values}
    pulumi.runtime.set_all_config(config_map(merged, others), secret_full)
    settings = pulumi.runtime.settings.SETTINGS
    settings.rpc_manager.clear()
    settings.outputs.clear()

    def main() -> None:
        runpy.run_path(str(program), run_name="__main__")

    try:
        _sync_await(run_pulumi_func(main))
    except Exception as err:
        # Callers check that a rejected stack registered nothing.
        err.registered = list(result.resources)  # type: ignore[attr-defined]
        raise
    root = pulumi.runtime.settings.get_root_resource()
    exported = dict(getattr(root, "outputs", {}) or {})
    if exported:
        resolved = _sync_await(pulumi.Output.from_input(exported).future())
        result.outputs = dict(resolved or {})
    return result
