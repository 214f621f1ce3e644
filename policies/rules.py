"""The guardrails: CrossGuard rules that `pulumi preview --policy-pack policies` runs.

What flows through here: for every resource the program registers, Pulumi hands each rule
the resource's type and its inputs (for pulumi-eks's Cluster/ManagedNodeGroup and Helm v4
Charts, the component's own camelCase inputs; their children arrive as ordinary AWS and
Kubernetes resources) -> `plain()` turns them into plain data, with values that cannot be
known during a preview replaced by `UNKNOWN` -> a check yields one message per violation,
each saying how to fix it -> Pulumi prints it and, for mandatory rules, fails the preview.

A value that is unknown during a preview passes here: `pulumi up` runs the same rules again
on every resource with its inputs resolved, before it is created.

This module needs only pulumi-policy, pulumi and PyYAML (the pack's own virtualenv): nothing
from infra/. The tests import it directly; `__main__.py` only assembles `POLICIES` into a
PolicyPack.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Secret,
)
from pulumi_policy import proxy as _proxy
from pulumi_policy.proxy import UnknownValueError

PROJECT = "pd-inference"
GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_RESOURCE = "nvidia.com/gpu"
ENVIRONMENT_TAG = "pd-inference/environment"
# The EKS control-plane logs that must be on: who called the API, what they did, how they authenticated.
REQUIRED_LOG_TYPES = ("api", "audit", "authenticator")
# A tag that moves, or no tag at all: the image can change under a running stack.
FLOATING_TAGS = {"latest", "nightly", "main", "master", "edge", "stable", "dev"}
# Env var names that carry credentials: any "_"-separated word of the name.
SECRET_WORDS = {"TOKEN", "TOKENS", "KEY", "KEYS", "PASSWORD", "PASSWD", "SECRET", "SECRETS", "CREDENTIALS"}
SECRET_ENV_NAMES = {"PD_API_KEYS"}

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


def _validator(check: Check) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        props = plain(args.props)
        if not isinstance(props, dict):
            return
        ctx = Context(args.name, args.urn, dict(args.get_config() or {}))
        for message in check(args.resource_type, props, ctx):
            report_violation(message, None)

    return validate


# --- CIDRs ----------------------------------------------------------------------------------
def open_cidr(cidr: Any) -> bool:
    """True for /0 and anything wider than an IPv4 /8 or IPv6 /32 (two /1s are the internet too)."""
    if not isinstance(cidr, str):
        return False
    try:
        net = ipaddress.ip_network(cidr.strip(), strict=False)
    except ValueError:
        return False
    return net.prefixlen < (8 if net.version == 4 else 32)


# --- pod templates ------------------------------------------------------------------------------
def pod_specs(type_: str, props: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(where, role, pod spec) for every pod template in a workload; role is "head", "worker" or "pod"."""
    spec = props.get("spec")
    if type_ == "kubernetes:core/v1:Pod":
        yield "spec", "pod", spec
    elif type_ in WORKLOAD_TYPES:
        yield "spec.template.spec", "pod", dig(spec, "template", "spec")
    elif type_ == "kubernetes:batch/v1:CronJob":
        yield "spec.jobTemplate.spec.template.spec", "pod", dig(spec, "jobTemplate", "spec", "template", "spec")
    elif type_ in RAY_TYPES:
        for prefix, cluster in _ray_clusters(type_, spec):
            yield f"{prefix}.headGroupSpec.template.spec", "head", dig(cluster, "headGroupSpec", "template", "spec")
            for i, group in enumerate(as_list(dig(cluster, "workerGroupSpecs"))):
                name = dig(group, "groupName", default=str(i))
                yield f"{prefix}.workerGroupSpecs[{name}].template.spec", "worker", dig(group, "template", "spec")


def _ray_clusters(type_: str, spec: Any) -> Iterator[tuple[str, Any]]:
    if type_.endswith(":RayService"):
        yield "spec.rayClusterConfig", dig(spec, "rayClusterConfig")
    elif type_.endswith(":RayJob"):
        yield "spec.rayClusterSpec", dig(spec, "rayClusterSpec")
    else:
        yield "spec", spec


def containers(pod_spec: Any) -> Iterator[Mapping[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in as_list(dig(pod_spec, field)):
            if isinstance(c, Mapping):
                yield c


# --- images and charts -------------------------------------------------------------------------
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_EXACT_VERSION = re.compile(r"^v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def image_problem(image: Any) -> str | None:
    """Why an image reference is not pinned, or None if it is (a release tag or a digest)."""
    if not isinstance(image, str):
        return None  # unknown during preview, or not set (the chart's or operator's own default)
    if "@" in image:
        return None if _DIGEST.search(image) else f"image {image!r} has a malformed digest"
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image!r} has no tag (it means :latest)"
    tag = last.split(":", 1)[1]
    if tag.lower() in FLOATING_TAGS or tag.lower().startswith("nightly"):
        return f"image {image!r} uses the floating tag {tag!r}"
    return None


def _chart_images(values: Any, path: str = "values") -> Iterator[tuple[str, str]]:
    """(path, reference) for images set in Helm values: `image: repo:tag` or `image: {repository, tag}`."""
    if isinstance(values, Mapping):
        for k, v in values.items():
            here = f"{path}.{k}"
            if k == "image" and isinstance(v, str):
                yield here, v
            elif k == "image" and isinstance(v, Mapping) and isinstance(v.get("tag"), str):
                repo = v.get("repository") or v.get("name") or "image"
                yield here, f"{repo}:{v['tag']}" if v["tag"] else str(repo)
            else:
                yield from _chart_images(v, here)
    elif isinstance(values, list):
        for i, v in enumerate(values):
            yield from _chart_images(v, f"{path}[{i}]")


def check_images_pinned(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "pin a release tag (e.g. rayproject/ray-llm:2.60.0-py312-cu130) or a digest (@sha256:...)"
    for where, _, pod in pod_specs(type_, props):
        for c in containers(pod):
            problem = image_problem(c.get("image"))
            if problem:
                yield f"{where} container {c.get('name')!r}: {problem}; {fix}"
    if type_ in RAY_TYPES:
        for prefix, cluster in _ray_clusters(type_, props.get("spec")):
            problem = image_problem(dig(cluster, "autoscalerOptions", "image"))
            if problem:
                yield f"{prefix}.autoscalerOptions: {problem}; {fix}"
    if type_ in (HELM_CHART_V4, HELM_RELEASE_V3):
        for where, ref in _chart_images(props.get("values")):
            problem = image_problem(ref)
            if problem:
                yield f"{where}: {problem}; pin the tag, or leave it unset so the pinned chart's own image is used"


def check_helm_pinned(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (HELM_CHART_V4, HELM_RELEASE_V3):
        return
    chart = props.get("chart")
    version = props.get("version")
    if not known(chart) or not known(version):
        return
    if isinstance(chart, str) and chart.startswith((".", "/")) and not version:
        return  # a chart vendored in the repository is pinned by the commit
    if not isinstance(version, str) or not _EXACT_VERSION.match(version.strip()):
        yield (
            f"Helm chart {chart!r} has version {version!r}: pin an exact version (e.g. '1.7.0', in "
            "infra/versions.py); ranges, 'latest' or no version install whatever is newest at deploy time"
        )


# --- the EKS control plane ---------------------------------------------------------------------
def _endpoint(type_: str, props: dict[str, Any]) -> tuple[Any, Any] | None:
    """(public?, allow-list) of a cluster's API endpoint, with the providers' defaults applied."""
    if type_ == EKS_CLUSTER:
        public = props.get("endpointPublicAccess", True)  # pulumi-eks default: public
        cidrs = props.get("publicAccessCidrs")
    elif type_ == AWS_EKS_CLUSTER:
        public = dig(props, "vpcConfig", "endpointPublicAccess", default=True)  # EKS default: public
        cidrs = dig(props, "vpcConfig", "publicAccessCidrs")
    else:
        return None
    return public, cidrs


def check_endpoint_allow_list(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    endpoint = _endpoint(type_, props)
    if endpoint is None:
        return
    public, cidrs = endpoint
    if public is not True or not known(cidrs):
        return
    if not cidrs:
        yield (
            "the EKS API endpoint is public with no CIDR allow-list (the default is 0.0.0.0/0): keep it private "
            "(stack key endpointAccess: private) or list your networks in publicAccessCidrs"
        )
        return
    for c in as_list(cidrs):
        if open_cidr(c):
            yield (
                f"the EKS API endpoint's allow-list contains {c!r}, which is (nearly) the whole internet: "
                "list your own networks in publicAccessCidrs"
            )


def check_public_endpoint(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    endpoint = _endpoint(type_, props)
    if endpoint is None:
        return
    public, cidrs = endpoint
    if public is True:
        listed = ", ".join(str(c) for c in as_list(cidrs)) or "0.0.0.0/0"
        yield (
            f"the EKS API endpoint is reachable from the internet (allowed: {listed}): prefer endpointAccess: "
            "private and reach the API from inside the VPC (VPN, SSM, CI runners in the VPC)"
        )


def check_secrets_encryption(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "give the cluster a KMS key (pulumi-eks encryptionConfigKeyArn) so Secrets are envelope-encrypted in etcd"
    if type_ == EKS_CLUSTER:
        if not props.get("encryptionConfigKeyArn"):
            yield f"Kubernetes Secrets are not envelope-encrypted: {fix}"
    elif type_ == AWS_EKS_CLUSTER:
        config = props.get("encryptionConfig")
        if not known(config):
            return
        key = dig(config, "provider", "keyArn")
        resources = dig(config, "resources", default=[])
        if not key or (known(resources) and "secrets" not in as_list(resources)):
            yield f"Kubernetes Secrets are not envelope-encrypted (encryptionConfig resources ['secrets']): {fix}"


def check_control_plane_logging(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_CLUSTER, AWS_EKS_CLUSTER):
        return
    types = props.get("enabledClusterLogTypes")
    if not known(types):
        return
    missing = [t for t in REQUIRED_LOG_TYPES if t not in as_list(types)]
    if missing:
        yield (
            f"control-plane logging is missing {missing}: set enabledClusterLogTypes to include "
            f"{list(REQUIRED_LOG_TYPES)} (infra/components/cluster.py LOG_TYPES)"
        )


# --- nodes -------------------------------------------------------------------------------------------
# IMDSv2's PUT response hop limit that keeps pod-network containers away from the instance
# metadata service, and so from the node role (AWS EKS best practices, "Restrict access to the
# instance profile assigned to the worker node"; infra/components/launch_templates.py).
IMDS_HOP_LIMIT = 1
_TEMPLATE_FIX = (
    f"give the node group a launch template with metadataOptions.httpTokens 'required' and "
    f"httpPutResponseHopLimit {IMDS_HOP_LIMIT}"
)


def check_imdsv2(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ in (EKS_MNG, EKS_NODE_GROUP_V2):
        if props.get("launchTemplate"):
            return  # the template carries the metadata options; it is checked itself
        if props.get("enableIMDSv2") is not True:
            yield (
                f"nodes accept IMDSv1 (pods could read the node role's credentials with a plain GET): {_TEMPLATE_FIX}"
            )
        else:
            # pulumi-eks's template for enableIMDSv2 hard-codes httpPutResponseHopLimit 2
            # (nodejs/eks/nodes/nodegroup.ts createMNGCustomLaunchTemplate).
            yield f"enableIMDSv2 gives the nodes a hop limit of 2 (pods reach IMDS and the node role): {_TEMPLATE_FIX}"
    elif type_ == AWS_NODE_GROUP:
        if not props.get("launchTemplate"):
            yield f"an EKS node group without a launch template gets IMDSv1: {_TEMPLATE_FIX}"
    elif type_ == LAUNCH_TEMPLATE:
        meta = props.get("metadataOptions")
        if not known(meta):
            return
        if dig(meta, "httpEndpoint") == "disabled":
            return  # no metadata service at all
        tokens = dig(meta, "httpTokens")
        if known(tokens) and tokens != "required":
            yield (
                f"launch template metadataOptions.httpTokens is {tokens!r}: set it to 'required' (IMDSv2) with "
                f"httpPutResponseHopLimit {IMDS_HOP_LIMIT}"
            )
        hops = dig(meta, "httpPutResponseHopLimit")
        if known(hops) and (hops is None or int(hops) > IMDS_HOP_LIMIT):
            what = "unset (an AMI with IMDSv2 support v2.0, as AL2023's, then gives 2)" if hops is None else hops
            yield (
                f"launch template metadataOptions.httpPutResponseHopLimit is {what}: set it to {IMDS_HOP_LIMIT} so "
                "pods cannot reach IMDS and the node role (give pods their own role through EKS Pod Identity)"
            )


_GPU_INSTANCE = re.compile(r"^(p\d|g\d)[a-z0-9-]*\.", re.IGNORECASE)


def _is_gpu_group(props: Mapping[str, Any]) -> bool:
    if props.get("gpu") is True:
        return True
    ami = props.get("amiType")
    if isinstance(ami, str) and ("NVIDIA" in ami.upper() or "GPU" in ami.upper()):
        return True
    return any(isinstance(t, str) and _GPU_INSTANCE.match(t) for t in as_list(props.get("instanceTypes")))


def check_gpu_taint(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_MNG, AWS_NODE_GROUP) or not _is_gpu_group(props):
        return
    taints = props.get("taints")
    if not known(taints):
        return
    for t in as_list(taints):
        if dig(t, "key") == GPU_TAINT_KEY and dig(t, "effect") in ("NO_SCHEDULE", "NoSchedule"):
            return
    yield (
        f"GPU nodes are not tainted: add the taint {GPU_TAINT_KEY}=true:NoSchedule (effect NO_SCHEDULE) so only "
        "pods that tolerate it (the Ray GPU workers, the device plugins) land on these expensive nodes"
    )


def _efa_interfaces(props: Mapping[str, Any]) -> list[Any]:
    return [ni for ni in as_list(props.get("networkInterfaces")) if dig(ni, "interfaceType") in ("efa", "efa-only")]


def _offers_efa(props: Mapping[str, Any]) -> bool:
    """A node group whose own launch template carries the EFA interfaces: the group says so in
    the Cluster Autoscaler's node-template tag for the EFA resource (the program sets it)."""
    tags = props.get("tags")
    return isinstance(tags, Mapping) and any(str(k).endswith("/vpc.amazonaws.com/efa") for k in tags)


def check_efa_single_zone(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ == EKS_MNG:
        subnets = props.get("subnetIds")
        one_subnet = not known(subnets) or (isinstance(subnets, list) and len(subnets) == 1)
        if props.get("enableEfaSupport") is True:
            if not props.get("placementGroupAvailabilityZone"):
                yield (
                    "an EFA node group needs a cluster placement group: set placementGroupAvailabilityZone "
                    "(the stack's efaZone)"
                )
            if not one_subnet:
                yield (
                    f"an EFA node group spans {len(as_list(subnets))} subnets: give it exactly one subnet, the "
                    "private subnet in the placement group's zone (EFA traffic does not cross zones)"
                )
        elif props.get("launchTemplate") and props.get("capacityType") == "CAPACITY_BLOCK" and not one_subnet:
            yield (
                f"a capacity-block node group spans {len(as_list(subnets))} subnets: a Capacity Block lives in one "
                "zone; give the node group exactly one subnet, in that zone"
            )
        elif props.get("launchTemplate") and _offers_efa(props) and not one_subnet:
            yield (
                f"an EFA node group spans {len(as_list(subnets))} subnets: give it exactly one subnet, the private "
                "subnet in the placement group's zone (EFA traffic does not cross zones)"
            )
    elif type_ == LAUNCH_TEMPLATE:
        efa = _efa_interfaces(props)
        if not efa:
            return
        placed = dig(props, "placement", "groupName") or dig(props, "placement", "availabilityZone")
        reserved = dig(props, "instanceMarketOptions", "marketType") == "capacity-block" or dig(
            props, "capacityReservationSpecification", "capacityReservationTarget", "capacityReservationId"
        )
        if not placed and not reserved:
            yield (
                "a launch template with EFA interfaces has no placement: set placement.groupName to a cluster "
                "placement group, or target a capacity block/reservation (which carries its placement)"
            )
        subnets = {dig(ni, "subnetId") for ni in efa} - {None}
        if len(subnets) > 1:
            yield f"the EFA interfaces of one launch template are in {len(subnets)} subnets: use one subnet (one zone)"


def check_spot_in_prod(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_MNG, AWS_NODE_GROUP) or props.get("capacityType") != "SPOT":
        return
    if ctx.is_prod(props):
        yield (
            f"stack {ctx.stack!r} runs a node group on spot capacity: GPU spot nodes are reclaimed on two "
            "minutes' notice and can be unavailable for hours; use on-demand or a capacity block in prod"
        )


# --- the Ray head ---------------------------------------------------------------------------------------
def check_ray_head_no_gpu(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in RAY_TYPES:
        return
    for prefix, cluster in _ray_clusters(type_, props.get("spec")):
        head = dig(cluster, "headGroupSpec")
        if not known(head) or head is None:
            continue
        gpus = dig(head, "rayStartParams", "num-gpus")
        if known(gpus) and str(gpus).strip() != "0":
            yield (
                f'{prefix}.headGroupSpec.rayStartParams num-gpus is {gpus!r}: set it to "0" so Ray never places '
                "model replicas on the head (it runs the GCS, the Serve controller and the proxy)"
            )
        for c in containers(dig(head, "template", "spec")):
            for kind in ("requests", "limits"):
                n = dig(c, "resources", kind, GPU_RESOURCE)
                if n is not None and known(n) and str(n).strip() not in ("0", ""):
                    yield (
                        f"{prefix}.headGroupSpec container {c.get('name')!r} {kind} {GPU_RESOURCE}: {n}: remove it; "
                        "the head runs on the CPU system nodes and needs no GPU"
                    )


# --- KV transfer over the fabric --------------------------------------------------------------
EFA_RESOURCE = "vpc.amazonaws.com/efa"
NIXL_CONNECTORS = {"NixlConnector", "NixlPushConnector"}
NIXL_DEFAULT_BACKENDS = ["UCX"]  # vLLM NixlConnector's default (nixl/base_worker.py, get_from_extra_config)


def _efa_worker_groups(cluster: Any) -> list[str] | None:
    """Names of the worker groups whose pods ask for EFA devices; None when not known yet."""
    groups = dig(cluster, "workerGroupSpecs")
    if not known(groups):
        return None
    out = []
    for i, group in enumerate(as_list(groups)):
        for c in containers(dig(group, "template", "spec")):
            for kind in ("requests", "limits"):
                n = dig(c, "resources", kind, EFA_RESOURCE)
                if n is not None and known(n) and str(n).strip() not in ("0", ""):
                    out.append(str(dig(group, "groupName", default=i)))
    return sorted(set(out))


def _serve_doc(serve_config: Any) -> Any:
    """A serveConfigV2 document (YAML text) parsed, or None when it is not readable YAML."""
    if not isinstance(serve_config, str):
        return None
    try:
        return yaml.safe_load(serve_config)
    except yaml.YAMLError:
        return None


def _mappings(node: Any, path: str = "serveConfigV2") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, mapping) for every mapping in a parsed serveConfigV2 document, depth first."""
    if isinstance(node, Mapping):
        yield path, node
        for k, v in node.items():
            yield from _mappings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _mappings(v, f"{path}[{i}]")


def _nixl_configs(serve_config: Any) -> Iterator[tuple[str, list[Any]]]:
    """(path, backends) of every NIXL kv_transfer_config in a serveConfigV2 document."""
    for path, node in _mappings(_serve_doc(serve_config)):
        kv = node.get("kv_transfer_config")
        if isinstance(kv, Mapping) and kv.get("kv_connector") in NIXL_CONNECTORS:
            extra = kv.get("kv_connector_extra_config")
            backends = extra.get("backends") if isinstance(extra, Mapping) else None
            yield f"{path}.kv_transfer_config", list(backends) if backends else list(NIXL_DEFAULT_BACKENDS)


def check_nixl_backend(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    """On EFA worker groups NIXL must use LIBFABRIC: its UCX backend gets no RDMA on EFA and
    silently falls back to TCP (ai-dynamo/nixl#909, ai-dynamo/dynamo#4185). Without EFA there
    is no libfabric EFA device, so LIBFABRIC is wrong there."""
    if not type_.endswith(":RayService"):
        return
    spec = props.get("spec")
    efa_groups = _efa_worker_groups(dig(spec, "rayClusterConfig"))
    if efa_groups is None:
        return
    for path, backends in _nixl_configs(dig(spec, "serveConfigV2")):
        if efa_groups and (backends != ["LIBFABRIC"]):
            yield (
                f"{path} NIXL backends {backends} on EFA worker groups {efa_groups}: UCX gets no RDMA on EFA and "
                'falls back to TCP without a word (ai-dynamo/nixl#909); set kv_connector_extra_config.backends ["LIBFABRIC"]'
            )
        elif not efa_groups and "LIBFABRIC" in backends:
            yield (
                f"{path} NIXL backends {backends} but no worker group has EFA devices: LIBFABRIC has no EFA "
                'device to use; set kv_connector_extra_config.backends ["UCX"]'
            )


# --- secrets --------------------------------------------------------------------------------------------------
def secret_like(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    upper = name.upper()
    return upper in SECRET_ENV_NAMES or bool(SECRET_WORDS & set(re.split(r"[^A-Z0-9]+", upper)))


def _serve_config_env(serve_config: Any) -> Iterator[tuple[str, str]]:
    """(path, env var name) of literal env vars in a serveConfigV2 document's runtime_env."""
    for path, node in _mappings(_serve_doc(serve_config)):
        env = node.get("env_vars")
        if isinstance(env, Mapping):
            for name in env:
                yield f"{path}.env_vars", str(name)


def check_secrets_by_reference(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "put the value in a Kubernetes Secret (fed from a Pulumi secret) and use valueFrom.secretKeyRef"
    for where, _, pod in pod_specs(type_, props):
        for c in containers(pod):
            for e in as_list(c.get("env")):
                if isinstance(e, Mapping) and secret_like(e.get("name")) and "value" in e:
                    yield f"{where} container {c.get('name')!r} sets {e.get('name')} as a literal value: {fix}"
    if type_ in RAY_TYPES:
        for where, name in _serve_config_env(dig(props, "spec", "serveConfigV2")):
            if secret_like(name):
                yield f"{where} sets {name} as a literal runtime_env variable: {fix} on the pods instead"
        for prefix, cluster in _ray_clusters(type_, props.get("spec")):
            password = dig(cluster, "gcsFaultToleranceOptions", "redisPassword")
            if isinstance(password, Mapping) and "value" in password:
                yield (
                    f"{prefix}.gcsFaultToleranceOptions.redisPassword is a literal value: use "
                    "redisPassword.valueFrom.secretKeyRef (the stack's gcsRedisPassword secret)"
                )
    if type_.startswith("kubernetes:") and type_ != K8S_SECRET and "stringData" in props:
        yield f"stringData on a {type_.rsplit(':', 1)[-1]}: only a Secret (kubernetes:core/v1:Secret) may hold secret data"
    if type_ == K8S_CONFIGMAP:
        for field in ("data", "binaryData"):
            data = props.get(field)
            for k in data if isinstance(data, Mapping) else ():
                if secret_like(k):
                    yield f"ConfigMap {field} key {k!r} looks like a credential: {fix}"


# --- ingress to the endpoint -------------------------------------------------------------------------------------
def _service_ingress(props: Any, where: str = "Service") -> Iterator[str]:
    spec = dig(props, "spec")
    if not isinstance(spec, Mapping):
        return
    ranges = spec.get("loadBalancerSourceRanges")
    annotation = dig(props, "metadata", "annotations", "service.beta.kubernetes.io/load-balancer-source-ranges")
    if isinstance(annotation, str):
        ranges = [*as_list(ranges), *[r for r in annotation.split(",") if r.strip()]]
    if not known(ranges):
        return
    if spec.get("type") == "LoadBalancer" and not ranges:
        yield (
            f"a LoadBalancer {where} without loadBalancerSourceRanges accepts 0.0.0.0/0: list the client CIDRs "
            "(stack key serviceAllowedCidrs)"
        )
    for c in as_list(ranges):
        if open_cidr(c):
            yield f"{where} loadBalancerSourceRanges contains {c!r} (the whole internet): list the client CIDRs"


def check_no_open_ingress(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ == K8S_SERVICE:
        yield from _service_ingress(props)
    elif type_.endswith(":RayService") and isinstance(dig(props, "spec", "serveService"), Mapping):
        # KubeRay creates this Service from the RayService (spec.serveService): same rule.
        yield from _service_ingress(dig(props, "spec", "serveService"), "RayService spec.serveService")
    elif type_ == K8S_NETWORK_POLICY:
        for i, rule in enumerate(as_list(dig(props, "spec", "ingress"))):
            if not known(rule):
                continue
            sources = dig(rule, "from")
            if known(sources) and not sources:
                yield (
                    f"NetworkPolicy ingress rule {i} has no 'from': it admits every source, 0.0.0.0/0 included; "
                    "list pod/namespace selectors or ipBlocks"
                )
            for s in as_list(sources):
                cidr = dig(s, "ipBlock", "cidr")
                if open_cidr(cidr):
                    yield f"NetworkPolicy ingress rule {i} admits ipBlock {cidr!r} (the whole internet): list the client CIDRs"
    elif type_ == SECURITY_GROUP:
        for i, rule in enumerate(as_list(props.get("ingress"))):
            for c in [*as_list(dig(rule, "cidrBlocks")), *as_list(dig(rule, "ipv6CidrBlocks"))]:
                if open_cidr(c):
                    yield f"security group ingress rule {i} admits {c!r}: allow only the networks that need it"
    elif type_ == SECURITY_GROUP_RULE:
        if props.get("type") == "ingress":
            for c in [*as_list(props.get("cidrBlocks")), *as_list(props.get("ipv6CidrBlocks"))]:
                if open_cidr(c):
                    yield f"security group ingress rule admits {c!r}: allow only the networks that need it"
    elif type_ == SG_INGRESS_RULE:
        for c in (props.get("cidrIpv4"), props.get("cidrIpv6")):
            if open_cidr(c):
                yield f"security group ingress rule admits {c!r}: allow only the networks that need it"


# --- the external fallback (hybrid routing) -------------------------------------------------------
def _fallback_urls(serve_config: Any) -> Iterator[tuple[str, str]]:
    """(application name, fallback base URL) in a serveConfigV2 document: the ingress
    deployment's user_config.fallback.base_url, as serving/spec/serving.py renders it."""
    doc = _serve_doc(serve_config)
    for app in as_list(dig(doc, "applications")):
        for dep in as_list(dig(app, "deployments")):
            url = dig(dep, "user_config", "fallback", "base_url")
            if isinstance(url, str):
                yield str(dig(app, "name", default="?")), url


def check_fallback_https(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in RAY_TYPES or ctx.stack in (ctx.config.get("devStacks") or ["dev"]):
        return
    for app, url in _fallback_urls(dig(props, "spec", "serveConfigV2")):
        if url.lower().startswith("http://"):
            yield (
                f"application {app!r} sends requests and the fallback API key to {url!r} over plain http: "
                "use an https:// baseUrl outside dev (stack key serving.fallback.baseUrl)"
            )


# --- the pack -------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    level: EnforcementLevel
    check: Check
    config_schema: PolicyConfigSchema | None = None

    def policy(self) -> ResourceValidationPolicy:
        return ResourceValidationPolicy(
            name=self.name,
            description=self.description,
            enforcement_level=self.level,
            validate=_validator(self.check),
            config_schema=self.config_schema,
        )


MANDATORY = EnforcementLevel.MANDATORY
ADVISORY = EnforcementLevel.ADVISORY
_STACK_SCHEMA = PolicyConfigSchema(
    properties={
        "prodStacks": {"type": "array", "items": {"type": "string"}, "default": ["prod"]},
        "stack": {"type": "string", "description": "the stack name, when the URN does not say it"},
    }
)

RULES: list[Rule] = [
    Rule(
        "eks-endpoint-allow-list",
        "The EKS API endpoint is private, or public only to a CIDR allow-list.",
        MANDATORY,
        check_endpoint_allow_list,
    ),
    Rule(
        "eks-secrets-encryption",
        "Kubernetes Secrets are envelope-encrypted with a KMS key.",
        MANDATORY,
        check_secrets_encryption,
    ),
    Rule(
        "eks-control-plane-logging",
        "The api, audit and authenticator control-plane logs are on.",
        MANDATORY,
        check_control_plane_logging,
    ),
    Rule(
        "nodes-imdsv2-required",
        "Nodes require IMDSv2 with a hop limit of 1 (node groups and their launch templates).",
        MANDATORY,
        check_imdsv2,
    ),
    Rule("gpu-nodes-tainted", "GPU node groups carry the nvidia.com/gpu NoSchedule taint.", MANDATORY, check_gpu_taint),
    Rule(
        "efa-single-zone",
        "EFA node groups sit in one subnet (one zone) with a placement group or capacity block.",
        MANDATORY,
        check_efa_single_zone,
    ),
    Rule("helm-charts-pinned", "Helm charts are pinned to an exact version.", MANDATORY, check_helm_pinned),
    Rule(
        "images-pinned",
        "Container images carry a release tag or a digest, never latest/nightly or none.",
        MANDATORY,
        check_images_pinned,
    ),
    Rule(
        "ray-head-no-gpu",
        "The Ray head asks for no GPU (num-gpus 0, no nvidia.com/gpu).",
        MANDATORY,
        check_ray_head_no_gpu,
    ),
    Rule(
        "nixl-backend-matches-fabric",
        "NIXL moves the KV cache with LIBFABRIC on EFA worker groups and UCX elsewhere.",
        MANDATORY,
        check_nixl_backend,
    ),
    Rule(
        "secrets-by-reference",
        "Tokens, keys and passwords reach pods only by Secret reference.",
        MANDATORY,
        check_secrets_by_reference,
    ),
    Rule(
        "no-open-ingress",
        "Nothing admits 0.0.0.0/0 or ::/0 (Services, NetworkPolicies, security groups).",
        MANDATORY,
        check_no_open_ingress,
    ),
    Rule(
        "fallback-https-outside-dev",
        "The external fallback (serving.fallback.baseUrl) is https outside dev stacks.",
        MANDATORY,
        check_fallback_https,
        PolicyConfigSchema(
            properties={
                "devStacks": {"type": "array", "items": {"type": "string"}, "default": ["dev"]},
                "stack": {"type": "string", "description": "the stack name, when the URN does not say it"},
            }
        ),
    ),
    Rule(
        "no-spot-in-prod", "Prod node groups do not run on spot capacity.", ADVISORY, check_spot_in_prod, _STACK_SCHEMA
    ),
    Rule("eks-endpoint-private", "The EKS API endpoint is private (any stack).", ADVISORY, check_public_endpoint),
]

POLICIES: list[ResourceValidationPolicy] = [r.policy() for r in RULES]
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
