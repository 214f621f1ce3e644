"""What a check receives: the engine's arguments for one resource as plain data and a Context.

What flows through here: the analyzer's `ResourceValidationArgs` (resource type, inputs as
unknown-checking proxies, possibly still wrapped secrets, name, URN, the policy's config) ->
`validator()`: `plain()` turns the inputs into dicts, lists and scalars, with a value that cannot
be known during a preview replaced by `UNKNOWN` -> the rule's check runs on (type, props,
Context) -> each message it yields is reported as one violation.

Also here: the resource types the rules look at, named once for every module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pulumi_policy import ReportViolation, ResourceValidationArgs, Secret
from pulumi_policy import proxy as _proxy
from pulumi_policy.proxy import UnknownValueError

PROJECT = "pd-inference"
ENVIRONMENT_TAG = "pd-inference/environment"

# Resource types the rules look at.
EKS_CLUSTER = "eks:index:Cluster"
EKS_MNG = "eks:index:ManagedNodeGroup"
EKS_NODE_GROUP_V2 = "eks:index:NodeGroupV2"
AWS_EKS_CLUSTER = "aws:eks/cluster:Cluster"
AWS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SG_INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
HELM_CHART_V4 = "kubernetes:helm.sh/v4:Chart"
HELM_RELEASE_V3 = "kubernetes:helm.sh/v3:Release"
K8S_SERVICE = "kubernetes:core/v1:Service"
K8S_SECRET = "kubernetes:core/v1:Secret"
K8S_CONFIGMAP = "kubernetes:core/v1:ConfigMap"
K8S_NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
RAY_TYPES = ("kubernetes:ray.io/v1:RayService", "kubernetes:ray.io/v1:RayCluster", "kubernetes:ray.io/v1:RayJob")
WORKLOAD_TYPES = {
    "kubernetes:apps/v1:Deployment",
    "kubernetes:apps/v1:StatefulSet",
    "kubernetes:apps/v1:DaemonSet",
    "kubernetes:apps/v1:ReplicaSet",
    "kubernetes:batch/v1:Job",
    "kubernetes:core/v1:ReplicationController",
    "kubernetes:core/v1:PodTemplate",
}


# --- inputs as plain data -----------------------------------------------------------------
class _Unknown:
    """A value Pulumi cannot know during a preview (it depends on a resource not yet created)."""

    def __repr__(self) -> str:
        return "<unknown during preview>"


UNKNOWN: Any = _Unknown()
# The engine's markers for unknown values of each type (strings inside the serialized inputs).
UNKNOWN_SENTINELS = frozenset(
    getattr(_proxy, n) for n in dir(_proxy) if n.startswith("UNKNOWN_") and n.endswith("_VALUE")
)
_SIG_KEY = "4dabf18193072939515e22adb298388d"
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"


def plain(value: Any) -> Any:
    """Resource inputs (possibly the analyzer's unknown-checking proxies) as dicts, lists and scalars."""
    if isinstance(value, Secret):
        return plain(value.value)
    if isinstance(value, str):
        return UNKNOWN if value in UNKNOWN_SENTINELS else value
    if isinstance(value, Mapping):
        keys = list(value)
        if _SIG_KEY in keys and _item(value, _SIG_KEY) == _SECRET_SIG:  # a secret, still wrapped
            return _item(value, "value")
        return {k: _item(value, k) for k in keys}
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_item(value, i) for i in range(len(value))]
    return value


def _item(container: Any, key: Any) -> Any:
    try:
        return plain(container[key])
    except UnknownValueError:
        return UNKNOWN


def known(value: Any) -> bool:
    return value is not UNKNOWN


def dig(obj: Any, *path: Any, default: Any = None) -> Any:
    """obj[path[0]][path[1]]...; `default` where a step is missing; UNKNOWN where one is unknown."""
    for step in path:
        if obj is UNKNOWN:
            return UNKNOWN
        if (isinstance(obj, Mapping) and step in obj) or (
            isinstance(obj, list) and isinstance(step, int) and -len(obj) <= step < len(obj)
        ):
            obj = obj[step]
        else:
            return default
    return obj


def as_list(value: Any) -> list[Any]:
    if value is None or value is UNKNOWN:
        return []
    return list(value) if isinstance(value, list) else [value]


# --- the stack a resource belongs to ------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """What a check may know beyond the resource: its name, URN and the policy's config."""

    name: str
    urn: str
    config: Mapping[str, Any]

    @property
    def stack(self) -> str | None:
        """The stack: policy config `stack` (tests, overrides), else the URN, else pulumi.get_stack()."""
        if self.config.get("stack"):
            return str(self.config["stack"])
        m = re.match(r"^urn:pulumi:([^:]+)::", self.urn or "")
        if m:
            return m.group(1)
        try:
            import pulumi

            return pulumi.get_stack()
        except Exception:  # not running under the Pulumi engine
            return None

    def is_prod(self, props: Mapping[str, Any]) -> bool:
        prod_stacks = self.config.get("prodStacks") or ["prod"]
        raw_tags = props.get("tags")
        tags: Mapping[str, Any] = raw_tags if isinstance(raw_tags, Mapping) else {}
        return self.stack in prod_stacks or tags.get(ENVIRONMENT_TAG) == "prod"


Check = Callable[[str, dict[str, Any], Context], Iterable[str]]


def validator(check: Check) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        props = plain(args.props)
        if not isinstance(props, dict):
            return
        ctx = Context(args.name, args.urn, dict(args.get_config() or {}))
        for message in check(args.resource_type, props, ctx):
            report_violation(message, None)

    return validate
