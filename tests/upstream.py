"""Upstream rules, reproduced for the contract tests: what the real tools do with our inputs.

What flows through here: our rendered inputs (Pulumi.yaml and a stack file, a RayService
manifest, Helm values, pod templates) -> what Pulumi, KubeRay, the EFA chart, the EKS Pod
Identity webhook and pulumi-eks would produce from them. Each function names its source
(repository, path, version) and follows that code's logic, not our assumptions; the tests
assert on the results. Nothing here is imported by the program.
"""

from __future__ import annotations

import base64
import binascii
import copy
import math
from dataclasses import dataclass
from typing import Any

# --- pulumi/pulumi pkg/workspace/config.go (mergeConfig, validateStackConfigValues) ------
# (sdk/go/common/workspace/project.go: Project.Validate, ValidateConfigValue;
#  sdk/go/common/resource/config/crypt.go: symmetricCrypter.DecryptValue), mirror of 2026-08.


class PulumiConfigError(Exception):
    """What `pulumi preview/up` prints before it runs the program."""


def _type_ok(type_name: str, items: dict | None, value: Any) -> bool:
    # ValidateConfigValue: strings are strings; integers may be whole floats or numeric text;
    # booleans may be "true"/"false"; arrays check each item against `items`.
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        if isinstance(value, bool):
            return False
        if isinstance(value, int) or (isinstance(value, float) and value == math.trunc(value)):
            return True
        if isinstance(value, str):
            try:
                int(value)
            except ValueError:
                return False
            return True
        return False
    if type_name == "boolean":
        return isinstance(value, bool) or value in ("true", "false")
    if type_name == "object":
        return isinstance(value, dict)
    if not isinstance(value, list) or items is None:
        return False
    return all(_type_ok(items["type"], items.get("items"), v) for v in value)


def _decryptable(ciphertext: Any) -> bool:
    """Could any Pulumi secrets provider decrypt this `secure:` value?

    symmetricCrypter (passphrase and cloud KMS providers): "v1:<b64 nonce>:<b64 ciphertext>"
    with a 12-byte AES-GCM nonce and at least the 16-byte tag. The Pulumi Cloud provider's
    values are plain base64. Anything else fails before the program starts.
    """
    if not isinstance(ciphertext, str) or not ciphertext:
        return False
    parts = ciphertext.split(":")
    try:
        if len(parts) == 3:
            if parts[0] != "v1":
                return False
            nonce = base64.b64decode(parts[1], validate=True)
            body = base64.b64decode(parts[2], validate=True)
            return len(nonce) == 12 and len(body) >= 16
        if len(parts) == 1:
            return len(base64.b64decode(parts[0], validate=True)) >= 16
    except (binascii.Error, ValueError):
        return False
    return False


def merge_config(project: dict[str, Any], stack_doc: dict[str, Any], stack: str) -> dict[str, Any]:
    """The stack's config after Pulumi's project/stack merge; PulumiConfigError where Pulumi stops.

    Returns {full key: value} with project defaults applied (secure values stay {"secure": ...}).
    """
    name = project["name"]
    declared: dict[str, dict[str, Any]] = project.get("config") or {}
    # Project.Validate
    for key, decl in declared.items():
        decl = decl if isinstance(decl, dict) else {"default": decl}
        if "default" in decl and "value" in decl:
            raise PulumiConfigError(f"project config '{key}' cannot have both a 'default' and 'value' attribute")
        if ":" not in key or key.startswith(name + ":"):
            if decl.get("type") == "array" and "items" not in decl:
                raise PulumiConfigError(
                    f"The configuration key '{key}' declares an array but does not specify the underlying type via the 'items' attribute"
                )
            if (
                "type" in decl
                and decl.get("default") is not None
                and not _type_ok(decl["type"], decl.get("items"), decl["default"])
            ):
                raise PulumiConfigError(
                    f"The default value specified for configuration key '{key}' is not of the expected type"
                )
    config: dict[str, Any] = {}
    for full, value in (stack_doc.get("config") or {}).items():
        full = str(full)
        config[full if ":" in full else f"{name}:{full}"] = value
    missing, from_project = [], set()
    for key in sorted(declared):
        decl = declared[key] if isinstance(declared[key], dict) else {"default": declared[key]}
        full = key if ":" in key else f"{name}:{key}"
        has_default, has_value = decl.get("default") is not None, decl.get("value") is not None
        if full not in config and not has_value and not has_default and full.split(":", 1)[0] == name:
            missing.append(key)
            continue
        if full not in config:
            config[full] = decl["default"] if has_default else decl["value"]
            from_project.add(full)  # set as plain (not secure) values
    if missing:
        keys = sorted(missing)
        quoted = f"'{keys[0]}'" if len(keys) == 1 else ", ".join(f"'{k}'" for k in keys[:-1]) + f" and '{keys[-1]}'"
        raise PulumiConfigError(
            f"Stack '{stack}' is missing configuration value{'s' if len(keys) > 1 else ''} {quoted}"
        )
    # validateStackConfigValues: decrypt every secure value first, then check declared keys.
    for full, value in config.items():
        if isinstance(value, dict) and set(value) == {"secure"} and not _decryptable(value["secure"]):
            raise PulumiConfigError(f"Stack '{stack}': failed to decrypt configuration key '{full}'")
    for key in sorted(declared):
        decl = declared[key] if isinstance(declared[key], dict) else {}
        full = key if ":" in key else f"{name}:{key}"
        if "type" not in decl:
            continue
        value = config[full]
        secure = isinstance(value, dict) and set(value) == {"secure"}
        if decl.get("secret") and not secure:
            raise PulumiConfigError(f"Stack '{stack}' with configuration key '{key}' must be encrypted as it's secret")
        if secure:
            continue  # the decrypted text is a string; typed checks need the key, which we lack
        if not isinstance(value, (dict, list)):
            # Primitive values reach the check as text (config.Value holds strings; %v of bools).
            value = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if not _type_ok(decl["type"], decl.get("items"), value):
            raise PulumiConfigError(f"Stack '{stack}' with configuration key '{key}' must be of type '{decl['type']}'")
    return config


# --- ray-project/kuberay v1.7.0 ray-operator/controllers/ray/common/pod.go, service.go ----
RAY_CLUSTER_LABEL = "ray.io/cluster"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"
RAY_GROUP_LABEL = "ray.io/group"
RAY_SERVE_LABEL = "ray.io/serve"
DEFAULT_SERVING_PORT = 8000  # utils.DefaultServingPort
SERVE_PROXY_HEALTH_PATH = "/-/healthz"  # utils.RayServeProxyHealthPath


def label_pod(node_type: str, cluster: str, group: str, template_labels: dict[str, str]) -> dict[str, str]:
    """pod.go labelPod: KubeRay's labels, then the template's (node-type, group, cluster win)."""
    labels = {
        "ray.io/is-ray-node": "yes",
        RAY_CLUSTER_LABEL: cluster,
        RAY_NODE_TYPE_LABEL: node_type,
        RAY_GROUP_LABEL: group,
        "ray.io/identifier": f"{cluster}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    for k, v in template_labels.items():
        if k not in (RAY_NODE_TYPE_LABEL, RAY_GROUP_LABEL, RAY_CLUSTER_LABEL):
            labels[k] = v
    return labels


def rayservice_pod(
    rayservice: dict[str, Any], cluster: str, group: str | None, head_proxy_healthy: bool = True
) -> dict[str, Any]:
    """The Pod KubeRay builds for a RayService's head (group None) or a worker group.

    BuildPod (pod.go): RayService pods get ray.io/serve "true" (workers, for good) or "false"
    (head, until the RayService controller's proxy health check flips it,
    rayservice_controller.go updateHeadPodServeLabel). Then labelPod's labels, and
    initLivenessAndReadinessProbe for containers without their own probes.
    """
    spec = rayservice["spec"]["rayClusterConfig"]
    if group is None:
        node_type, group_name, grp = "head", "headgroup", spec["headGroupSpec"]
    else:
        node_type, group_name = "worker", group
        grp = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == group)
    template = copy.deepcopy(grp["template"])
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    labels[RAY_SERVE_LABEL] = "true" if node_type == "worker" else "false"
    labels = label_pod(node_type, cluster, group_name, labels)
    if node_type == "head":
        labels[RAY_SERVE_LABEL] = "true" if head_proxy_healthy else "false"
    pod_spec = template["spec"]
    container = pod_spec["containers"][0]  # utils.RayContainerIndex
    _init_probes(container, node_type)
    return {"metadata": {"labels": labels}, "spec": pod_spec}


def ray_start_flags(ray_start_params: dict[str, str]) -> list[str]:
    """pod.go convertParamMap: the flags KubeRay puts after `ray start`. A value "true" or
    "false" is an on-off switch (`--key` when true, nothing at all when false), except for the
    options that take an explicit boolean (specialParameterOptions: log-color,
    include-dashboard, include-log-monitor since v1.7.0, kuberay#4857), which get `--key=value`
    like every other entry. Keys in sorted order."""
    special = ("log-color", "include-dashboard", "include-log-monitor")
    flags = []
    for key in sorted(ray_start_params):
        value = ray_start_params[key]
        if value.lower() in ("true", "false") and key not in special:
            if value.lower() == "true":
                flags.append(f"--{key}")
        else:
            flags.append(f"--{key}={value}")
    return flags


def _find_port(container: dict[str, Any], name: str, default: int) -> int:
    for p in container.get("ports") or []:
        if p.get("name") == name:
            return int(p["containerPort"])
    return default


def _init_probes(container: dict[str, Any], node_type: str) -> None:
    """initLivenessAndReadinessProbe, RayService case: a worker's readiness probe also wgets
    the Serve proxy's health path on the container's "serve" port (default 8000)."""
    if container.get("readinessProbe") is None:
        commands = ["raylet"] if node_type == "worker" else ["raylet", "gcs"]
        probe: dict[str, Any] = {"checks": commands}
        if node_type == "worker":
            port = _find_port(container, "serve", DEFAULT_SERVING_PORT)
            probe["checks"] = [*commands, f"serve-proxy:{port}{SERVE_PROXY_HEALTH_PATH}"]
        container["readinessProbe"] = probe


def incremental_upgrade(rayservice: dict[str, Any]) -> bool:
    """utils.IsIncrementalUpgradeEnabled (feature gate on by default in v1.7.0)."""
    return ((rayservice["spec"].get("upgradeStrategy") or {}).get("type")) == "NewClusterWithIncrementalUpgrade"


def serve_service(rayservice: dict[str, Any], active_cluster: str) -> dict[str, Any] | None:
    """service.go BuildServeService for a RayService: the user's spec.serveService with the
    selector replaced by {ray.io/cluster: <active cluster>, ray.io/serve: "true"}, the head's
    serve ports merged in, name defaulting to <rayservice>-serve-svc. With incremental
    upgrades the custom serveService is ignored (None here: per-cluster services + Gateway).
    reconcileServices rewrites the selector whenever the active cluster changes."""
    if incremental_upgrade(rayservice):
        return None
    custom = rayservice["spec"].get("serveService")
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    auto = [
        {"name": p["name"], "port": p["containerPort"]}
        for p in head.get("ports") or []
        if p.get("name") == "serve" or str(p.get("name", "")).startswith("serve-")
    ]
    if not auto and custom is None:
        raise ValueError("KubeRay: specify a port named 'serve' in the Ray head container")
    selector = {RAY_CLUSTER_LABEL: active_cluster, RAY_SERVE_LABEL: "true"}
    name = rayservice["metadata"]["name"]
    if custom is None:
        return {"metadata": {"name": f"{name}-serve-svc"}, "spec": {"selector": selector, "ports": auto}}
    svc = copy.deepcopy(custom)
    svc.setdefault("spec", {})["selector"] = selector
    user_ports = {p.get("name"): p for p in svc["spec"].get("ports") or []}
    if auto:
        svc["spec"]["ports"] = [user_ports.get(p["name"], p) for p in auto]
    svc.setdefault("metadata", {}).setdefault("name", f"{name}-serve-svc")
    svc["metadata"].setdefault("annotations", {})
    return svc


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --- aws/eks-charts stable/aws-efa-k8s-device-plugin v0.5.30 templates/daemonset.yaml ----
EFA_CHART_DEFAULT_LABEL_KEYS = ["node.kubernetes.io/instance-type"]


def efa_daemonset_affinity(values: dict[str, Any], chart_default_values: list[str]) -> dict[str, Any]:
    """The DaemonSet's affinity the chart renders: one nodeSelectorTerm per
    supportedInstanceLabels.keys entry (`key In supportedInstanceLabels.values`), the last
    term also excluding EKS Auto Mode nodes. A top-level `affinity` value is not read.
    Helm merges user values over the chart's: maps deep, lists replaced whole."""
    sil = values.get("supportedInstanceLabels") or {}
    keys = sil.get("keys", EFA_CHART_DEFAULT_LABEL_KEYS)
    types = sil.get("values", chart_default_values)
    terms = [{"matchExpressions": [{"key": k, "operator": "In", "values": list(types)}]} for k in keys]
    auto = {"key": "eks.amazonaws.com/compute-type", "operator": "NotIn", "values": ["auto"]}
    if terms:
        terms[-1]["matchExpressions"].append(auto)
    else:  # the expression lands under nodeSelectorTerms with no term: Kubernetes rejects it
        terms = [{"matchExpressions": [auto]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def node_matches(affinity: dict[str, Any], node_labels: dict[str, str]) -> bool:
    """Kubernetes nodeAffinity: terms are ORed, expressions within a term ANDed."""
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    def ok(e: dict[str, Any]) -> bool:
        v = node_labels.get(e["key"])
        if e["operator"] == "In":
            return v in e["values"]
        if e["operator"] == "NotIn":
            return v not in e["values"]
        raise ValueError(e["operator"])

    return any(all(ok(e) for e in t["matchExpressions"]) for t in terms)


# --- aws/amazon-eks-pod-identity-webhook (v0.6.17+) pkg/handler/handler.go, main.go -------
POD_IDENTITY_VOLUME = "eks-pod-identity-token"
POD_IDENTITY_MOUNT = "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount"
POD_IDENTITY_FULL_URI = "http://169.254.170.23/v1/credentials"
POD_IDENTITY_AUDIENCE = "pods.eks.amazonaws.com"


def pod_identity_mutate(pod: dict[str, Any], namespace: str, associations: set[tuple[str, str]]) -> dict[str, Any]:
    """getPodSpecPatch in container-credentials mode: pods whose (namespace, service account)
    has an association get a projected token volume of their own, mounted read-only into
    every container not named in the skip-containers annotation, and the env pointing the
    SDK at the Pod Identity agent (unless the container already sets those variables).
    automountServiceAccountToken is not consulted: it governs only the default API token."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    if (namespace, spec.get("serviceAccountName", "default")) not in associations:
        return pod
    skip = set()
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    if "eks.amazonaws.com/skip-containers" in ann:
        skip = {s.strip() for s in ann["eks.amazonaws.com/skip-containers"].split(",")}
    token_path = f"{POD_IDENTITY_MOUNT}/{POD_IDENTITY_VOLUME}"
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        if c["name"] in skip:
            continue
        names = {e["name"] for e in c.get("env") or []}
        if not names & {"AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"}:
            c.setdefault("env", []).extend(
                [
                    {"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": POD_IDENTITY_FULL_URI},
                    {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "value": token_path},
                ]
            )
        if POD_IDENTITY_VOLUME not in {m["name"] for m in c.get("volumeMounts") or []}:
            c.setdefault("volumeMounts", []).append(
                {"name": POD_IDENTITY_VOLUME, "readOnly": True, "mountPath": POD_IDENTITY_MOUNT}
            )
    if POD_IDENTITY_VOLUME not in {v["name"] for v in spec.get("volumes") or []}:
        spec.setdefault("volumes", []).insert(
            0,
            {
                "name": POD_IDENTITY_VOLUME,
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": POD_IDENTITY_AUDIENCE,
                                "expirationSeconds": 86400,
                                "path": POD_IDENTITY_VOLUME,
                            }
                        }
                    ]
                },
            },
        )
    pod.setdefault("metadata", {}).setdefault("labels", {})["eks.amazonaws.com/pod-identity"] = "enabled"
    return pod


# --- boto/botocore botocore/credentials.py ContainerProvider, utils.py ContainerMetadataFetcher
_CONTAINER_ALLOWED_HOSTS = ("169.254.170.2", "169.254.170.23", "fd00:ec2::23", "localhost")


def botocore_container_credentials(env: dict[str, str], files: set[str]) -> bool:
    """Would botocore's ContainerProvider fetch credentials in this environment? It runs when
    AWS_CONTAINER_CREDENTIALS_(RELATIVE|FULL)_URI is set; a full URI must be https or an
    allowed host; the token comes from AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE (read per call)."""
    from urllib.parse import urlparse

    full = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    if not full and not env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return False
    if full:
        u = urlparse(full)
        if u.scheme != "https" and u.hostname not in _CONTAINER_ALLOWED_HOSTS:
            return False
    token_file = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
    return token_file is None or token_file in files


# --- pulumi/pulumi-eks v4.x nodejs/eks/nodes/nodegroup.ts (createManagedNodeGroup) ---------
_CUSTOM_USER_DATA = ("kubeletExtraArgs", "bootstrapExtraArgs", "bottlerocketSettings", "nodeadmExtraOptions")
_CUSTOM_LAUNCH_TEMPLATE = (*_CUSTOM_USER_DATA, "enableIMDSv2", "userData", "amiId", "enableEfaSupport")


def mng_image(inputs: dict[str, Any]) -> dict[str, Any]:
    """Where an eks.ManagedNodeGroup's AMI comes from, given its (camelCase) inputs.

    requiresCustomLaunchTemplate -> pulumi-eks builds a launch template; if custom user data
    is needed (nodeadm options, userData or amiId) the template's imageId is amiId or, without
    it, getRecommendedAMI: an SSM lookup of .../<ami type>/recommended/image_id on EVERY run,
    and amiType/releaseVersion are dropped from the node group. Otherwise EKS picks the AMI
    from amiType (+ releaseVersion: none means "latest at creation", not re-resolved)."""
    if inputs.get("launchTemplate") and any(inputs.get(k) is not None for k in _CUSTOM_LAUNCH_TEMPLATE):
        raise ValueError("pulumi-eks refuses launchTemplate with " + ", ".join(_CUSTOM_LAUNCH_TEMPLATE))
    custom_user_data = any(inputs.get(k) is not None for k in (*_CUSTOM_USER_DATA, "userData", "amiId"))
    if custom_user_data:
        if inputs.get("amiId"):
            return {"source": "amiId", "pinned": True, "value": inputs["amiId"]}
        return {"source": "ssm-recommended", "pinned": False, "value": None}
    return {
        "source": "eks-release",
        "pinned": inputs.get("releaseVersion") is not None,
        "value": inputs.get("releaseVersion"),
        "amiType": inputs.get("amiType"),
    }


def mng_root_volume(inputs: dict[str, Any], templates: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The root EBS volume an eks.ManagedNodeGroup's nodes boot with, given its (camelCase)
    inputs and the launch templates of the stack by id.

    createMNGCustomLaunchTemplate (pulumi-eks v4, nodegroup.ts): when requiresCustomLaunchTemplate
    holds (enableEfaSupport, enableIMDSv2, nodeadm options, ...), pulumi-eks builds the template;
    its blockDeviceMappings are [{deviceName: /dev/xvda (AL2023), ebs: {volumeSize: diskSize}}]
    when diskSize is set, and nothing else: no `encrypted`, so the volume is encrypted only if
    the AMI's snapshot or the account's EBS default says so. With the user's launchTemplate,
    its own /dev/xvda mapping applies. Without any template, EKS's default template (diskSize)."""
    if inputs.get("launchTemplate"):
        lt = templates[inputs["launchTemplate"]["id"]]
        for m in lt.get("blockDeviceMappings") or []:
            if m.get("deviceName") == "/dev/xvda":
                ebs = m.get("ebs") or {}
                return {"source": "own-template", "encrypted": str(ebs.get("encrypted")).lower() == "true"}
        return {"source": "own-template", "encrypted": False}
    if any(inputs.get(k) is not None for k in _CUSTOM_LAUNCH_TEMPLATE):
        return {"source": "pulumi-eks-template", "encrypted": False, "volumeSize": inputs.get("diskSize")}
    return {"source": "eks-default", "encrypted": False}


def mng_metadata_options(inputs: dict[str, Any], templates: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The instance metadata options an eks.ManagedNodeGroup's nodes boot with, given its
    (camelCase) inputs and the stack's launch templates by id.

    With the user's launchTemplate, its metadataOptions. Else createMNGCustomLaunchTemplate
    (pulumi-eks v4, nodegroup.ts) sets, whenever enableIMDSv2 is given, {httpTokens: required
    (or optional when false), httpPutResponseHopLimit: 2, httpEndpoint: enabled}: the hop limit
    is not configurable there. Else None: EKS's default template, the AMI's defaults."""
    if inputs.get("launchTemplate"):
        return templates[inputs["launchTemplate"]["id"]].get("metadataOptions")
    if inputs.get("enableIMDSv2") is not None:
        tokens = "required" if inputs["enableIMDSv2"] else "optional"
        return {"httpTokens": tokens, "httpPutResponseHopLimit": 2, "httpEndpoint": "enabled"}
    return None


def efa_network_interfaces(network_cards: int, security_groups: list[str]) -> list[dict[str, Any]]:
    """getEfaNetworkInterfaces (pulumi-eks v4, nodejs/eks/nodes/instances.ts): one interface per
    network card (maximumNetworkCards of DescribeInstanceTypes), card 0 "efa" at device index 0,
    every other card "efa-only" at device index 1, deleted with the instance."""
    return [
        {
            "deleteOnTermination": "true",
            "networkCardIndex": i,
            "deviceIndex": 0 if i == 0 else 1,
            "interfaceType": "efa" if i == 0 else "efa-only",
            "securityGroups": list(security_groups),
        }
        for i in range(max(network_cards, 1))
    ]


# --- awslabs/amazon-eks-ami (v20260724) AL2023: how a container's RLIMIT_MEMLOCK is set ----
# nodeadm/internal/containerd/base-runtime-spec.json: the default base runtime spec's
# process.rlimits; nodeadm/internal/containerd/base_runtime_spec.go writes it (merged with the
# NodeConfig's containerd.baseRuntimeSpec, lists replaced whole: the e2e case
# nodeadm/test/e2e/cases/containerd-base-runtime-spec) to /etc/containerd/base-runtime-spec.json.
BASE_RUNTIME_SPEC_RLIMITS = ("RLIMIT_NOFILE",)
# templates/al2023/runtime/rootfs/etc/systemd/system/nodeadm-run.service: After=cloud-final.service;
# it restarts containerd (nodeadm/internal/containerd/daemon.go EnsureRunning -> RestartDaemon,
# systemd D-Bus, no daemon-reload: a drop-in written before it counts only after a reload).
CONTAINERD_DROP_IN_DIR = "/etc/systemd/system/containerd.service.d"


def container_memlock(node_configs: list[dict[str, Any]], drop_ins: dict[str, str], reloaded: bool) -> str | None:
    """RLIMIT_MEMLOCK of a container on an AL2023 node: the base runtime spec's entry if it has
    one (the OCI runtime sets the listed rlimits), else inherited from containerd (runc and the
    shim are its children): LimitMEMLOCK of its drop-ins when systemd reloaded them before
    nodeadm-run restarted it, else None (systemd's finite default)."""
    rlimits = [{"type": t} for t in BASE_RUNTIME_SPEC_RLIMITS]
    for cfg in node_configs:
        spec = (((cfg.get("spec") or {}).get("containerd") or {}).get("baseRuntimeSpec") or {}).get("process") or {}
        if "rlimits" in spec:
            rlimits = spec["rlimits"]
    for r in rlimits:
        if r.get("type") == "RLIMIT_MEMLOCK":
            return str(r.get("hard"))
    if not reloaded:
        return None
    limit = None
    for path in sorted(drop_ins):  # systemd applies drop-ins in lexical order; the last wins
        section = None
        for line in drop_ins[path].splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and line.startswith("LimitMEMLOCK="):
                limit = line.split("=", 1)[1]
    return limit


# --- ElastiCache replication groups: what pulumi-aws (bridging hashicorp/terraform-provider-aws
# internal/service/elasticache/replication_group.go, mirror of 2026-08) and the ElastiCache API
# (CreateReplicationGroup, AuthToken; "Authenticating with the Valkey and Redis OSS AUTH command")
# refuse, and the single-shard Redis KubeRay's GCS fault tolerance takes (ray-project/ray
# doc/source/cluster/kubernetes/user-guides/kuberay-gcs-ft.md, Prerequisites).
_AUTH_TOKEN_SPECIALS = set("!&#$^<>-")


def elasticache_replication_group_errors(inputs: dict[str, Any]) -> list[str]:
    """Why a `aws:elasticache/replicationGroup:ReplicationGroup` with these (camelCase) inputs
    would be refused at preview/create time, or be no GCS store; [] when it passes."""
    import re

    errors = []
    rid = str(inputs.get("replicationGroupId", ""))
    # validateReplicationGroupID
    if not (
        1 <= len(rid) <= 40
        and re.fullmatch(r"[0-9A-Za-z-]+", rid)
        and rid[0].isalpha()
        and "--" not in rid
        and not rid.endswith("-")
    ):
        errors.append(
            f"replicationGroupId {rid!r}: 1-40 letters, digits, hyphens; a letter first; no '--'; no '-' last"
        )
    # replicationGroupValidateMultiAZAutomaticFailover / ...AutomaticFailoverNumCacheClusters
    if inputs.get("multiAzEnabled") and not inputs.get("automaticFailoverEnabled"):
        errors.append("automatic_failover_enabled must be true if multi_az_enabled is true")
    if inputs.get("automaticFailoverEnabled") and int(inputs.get("numCacheClusters") or 0) < 2:
        errors.append('"num_cache_clusters": must be at least 2 if automatic_failover_enabled is true')
    token = inputs.get("authToken")
    if token is not None:
        # validReplicationGroupAuthToken (provider) and the API's AuthToken constraints
        if not 16 <= len(token) <= 128 or re.search(r'[@"/]', token):
            errors.append('auth_token: 16 to 128 characters, excluding @, ", and /')
        if any(not (c.isascii() and c.isprintable()) for c in token) or (
            set(c for c in token if not c.isalnum()) - _AUTH_TOKEN_SPECIALS
        ):
            errors.append("AuthToken: printable ASCII; the only special characters allowed are !&#$^<>-")
        if inputs.get("transitEncryptionEnabled") is not True:
            errors.append("AuthToken can be specified only where TransitEncryptionEnabled is true")
    if inputs.get("engine") not in ("redis", "valkey"):
        errors.append(f"engine {inputs.get('engine')!r}: redis or valkey")
    # validValkeyVersionString (engine_version.go): Valkey versions are <major>.<minor>, 7 to 9
    version = inputs.get("engineVersion")
    if inputs.get("engine") == "valkey" and version is not None and not re.fullmatch(r"[7-9]\.\d+", str(version)):
        errors.append(f"engine_version {version!r} is invalid. For Valkey use <major>.<minor>.")
    # KubeRay GCS fault tolerance: a single-shard Redis (cluster mode disabled), 1+ nodes
    if inputs.get("clusterMode") == "enabled" or int(inputs.get("numNodeGroups") or 1) != 1:
        errors.append("KubeRay's GCS fault tolerance takes a single-shard Redis (cluster mode disabled)")
    return errors


# --- kubernetes/autoscaler cluster-autoscaler-1.35.2 (chart cluster-autoscaler-9.59.0) --------
# cloudprovider/aws/aws_cloud_provider.go GPULabel; utils/gpu/gpu.go GPUVendorResourceNames,
# NodeHasGpuAllocatable; processors/customresources/gpu_processor.go
# FilterOutNodesWithUnreadyResources. The only custom-resource processors are GPU, DRA and CSI
# (processors/customresources/): no other extended resource, such as vpc.amazonaws.com/efa,
# is waited for.
CA_AWS_GPU_LABEL = "k8s.amazonaws.com/accelerator"
CA_GPU_RESOURCES = ("nvidia.com/gpu", "habana.ai/gaudi", "gpu.intel.com/xe", "amd.com/gpu", "microsoft.com/directx")


def ca_counts_node_ready(node_labels: dict[str, str], allocatable: dict[str, int]) -> bool:
    """Whether the Cluster Autoscaler treats a Kubernetes-Ready node as ready capacity. A node
    with the GPU label and no GPU allocatable yet becomes "unready" (ResourceUnready): capacity
    still coming, which the pending pods are expected to use. A ready node they do not fit on
    leaves them unschedulable, and the autoscaler scales up again."""
    has_label = CA_AWS_GPU_LABEL in node_labels
    has_gpu = any(int(allocatable.get(r, 0)) > 0 for r in CA_GPU_RESOURCES)
    return not (has_label and not has_gpu)


# --- ray-project/ray 2.60.0: the GCS Redis client over TLS -----------------------------------
# src/ray/common/ray_config_def.h REDIS_CA_CERT (env RAY_REDIS_CA_CERT, default ""), used by
# src/ray/gcs/store_client/redis_context.cc to build hiredis's SSL context: an empty value is
# passed as a NULL CA file, and BoringSSL then has no trust anchors, so verifying ElastiCache's
# certificate fails (ray#41161, CERTIFICATE_VERIFY_FAILED; fixed by the maintainers with the
# system bundle). KubeRay v1.7.0 raycluster_controller.go buildRedisCleanupJob builds the Redis
# cleanup Job from the head pod (its Ray container, env included).
def ray_redis_ca_file(env: list[dict[str, Any]]) -> str | None:
    """The CA file Ray's Redis client verifies the GCS server against; None: no trust anchors."""
    for e in env:
        if e.get("name") == "RAY_REDIS_CA_CERT" and e.get("value"):
            return str(e["value"])
    return None


def redis_cleanup_job_env(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """The Ray container env of KubeRay's Redis cleanup Job: the head's, plus KubeRay's own."""
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return [*copy.deepcopy(head.get("env") or []), {"name": "RAY_redis_db_connect_retries", "value": "120"}]


# --- Ray 2.60.0 Serve: where HTTP proxies run ------------------------------------------------
# serve/_private/controller.py _update_proxy_nodes: with proxy_location EveryNode, proxies run
# on the head and on the nodes returned by deployment_state get_active_node_ids (nodes holding
# a replica actor). serve/_private/deployment_scheduler.py _schedule_replica: a replica with
# placement bundles is pinned to bundle 0 of its placement group (PACK by default); a gang
# (Ray Serve LLM data parallelism, serving_patterns/data_parallel/dp_server.py: one replica per
# DP rank, one gang placement group, PACK) puts rank r's actor on bundle r x bundles_per_rank.
def serve_replica_nodes(
    node_gpus: int, nodes: int, replicas: int, bundles_per_replica: int, gang_size: int = 1
) -> set[int]:
    """Indices of the nodes (0..nodes-1, `node_gpus` one-GPU bundles each) that hold a replica
    actor, when `replicas` replicas of `bundles_per_replica` one-GPU bundles are packed onto them
    in order (gangs of `gang_size` replicas share one placement group, packed the same way)."""
    holding: set[int] = set()
    slot = 0  # next free one-GPU slot, counted across nodes in order
    for _ in range(replicas // gang_size):
        # PACK: a placement group that fits no partly used node starts on a fresh one.
        need = bundles_per_replica * gang_size
        if slot % node_gpus and slot % node_gpus + need > node_gpus:
            slot += node_gpus - slot % node_gpus
        for rank in range(gang_size):
            first_bundle = slot + rank * bundles_per_replica
            holding.add(first_bundle // node_gpus)
        slot += need
    if slot > nodes * node_gpus:
        raise ValueError(f"{replicas} replicas of {bundles_per_replica} GPUs do not fit {nodes} x {node_gpus}")
    return holding


# --- KubeRay v1.7.0 + Ray 2.60.0: does a container's readiness probe pass? -----------------------
# KubeRay's injected RayService worker probe (mirrored above as {"checks": [...]}) needs the
# raylet (the dashboard agent's api/local_raylet_healthz) and the Serve proxy's /-/healthz. A
# probe of the container's own: an httpGet on the dashboard agent's port (KubeRay's default
# 52365, utils.DefaultDashboardAgentListenPort) path /api/healthz answers 200 when the local
# raylet is alive, and on the head also the GCS (ray dashboard/modules/reporter/healthz_agent.py
# unified_health; public without token auth, dashboard/http_server_agent.py PUBLIC_EXACT_PATHS);
# one on the serve port's /-/healthz needs a proxy there.
DASHBOARD_AGENT_PORT = 52365


def readiness_passes(probe: dict[str, Any], raylet_alive: bool, proxy_port: int | None) -> bool:
    """The probe's verdict on a node whose raylet is (not) alive and whose Serve proxy listens
    on `proxy_port` (None: no proxy on this node)."""
    if "checks" in probe:  # KubeRay's injected probe
        ok = raylet_alive
        for check in probe["checks"]:
            if check.startswith("serve-proxy:"):
                port = int(check.split(":")[1].split("/")[0])
                ok = ok and proxy_port == port
        return ok
    http = probe.get("httpGet")
    if http is None:
        raise ValueError(f"probe not modelled: {probe}")
    if http.get("path") == "/api/healthz" and int(http.get("port")) == DASHBOARD_AGENT_PORT:
        return raylet_alive
    if http.get("path") == "/" + SERVE_PROXY_HEALTH_PATH.lstrip("/"):
        return raylet_alive and proxy_port == int(http.get("port"))
    return False


# --- kubernetes/kubernetes staging/src/k8s.io/endpointslice/utils.go (commit e637659d) ---------
# getEndpointPorts + findPort: a Service port whose targetPort is a NAME resolves, per pod, to
# the container port of that name (and protocol); a pod without it gets no endpoint port for
# that Service port, so no traffic for it. A numeric targetPort goes to every selected pod.
def endpoint_port(service_port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, int):
        return target
    protocol = service_port.get("protocol", "TCP")
    for c in pod["spec"]["containers"]:
        for p in c.get("ports") or []:
            if p.get("name") == target and p.get("protocol", "TCP") == protocol:
                return int(p["containerPort"])
    return None


# --- ray-project/ray 2.60.0 python/ray/_private/label_utils.py, ray_constants.py --------------
# validate_node_labels (called by parse_node_labels_json and by ray.init's labels): custom node
# label keys may not start with RAY_DEFAULT_LABEL_KEYS_PREFIX "ray.io/", reserved for the labels
# Ray sets itself (resource_and_label_spec.py _get_default_labels: ray.io/node-group from
# RAY_NODE_TYPE_NAME, which KubeRay v1.7.0 pod.go fills from the pod's ray.io/group label,
# "headgroup" on the head; ray.io/market-type, zone, region, accelerator-type). KubeRay passes a
# group's `labels` as `ray start --labels k=v,...` (pod.go updateRayStartParamsLabels), whose
# string parser (parse_node_labels_string) checks only the syntax, and Ray's own label then
# yields to the custom value (_resolve_labels).
RAY_RESERVED_LABEL_PREFIX = "ray.io/"


def ray_custom_label_errors(labels: dict[str, str]) -> list[str]:
    """What validate_node_labels refuses among these custom node labels ([] if nothing)."""
    return [
        f"Custom label keys `{k}` cannot start with the prefix `{RAY_RESERVED_LABEL_PREFIX}`"
        for k in labels
        if k.startswith(RAY_RESERVED_LABEL_PREFIX)
    ]


# --- torvalds/linux drivers/infiniband/core/umem.c (ib_umem_get), mm/mlock.c (can_do_mlock) ----
# What pinning host memory for an RDMA registration (ibv_reg_mr, under fi_mr_reg) needs of the
# calling process. (Device memory registered through dma-buf, ib_umem_dmabuf_get, is not
# counted against the limit.)
RLIM_INFINITY = "infinity"


def ib_umem_get(memlock: str | None, capabilities: set[str], pinned_bytes: int, page_size: int = 4096) -> str:
    """ "ok", "EPERM" or "ENOMEM" for pinning `pinned_bytes` (plus nothing pinned before).

    can_do_mlock(): allowed when RLIMIT_MEMLOCK != 0 or the process has CAP_IPC_LOCK, else EPERM.
    Then pinned pages > RLIMIT_MEMLOCK >> PAGE_SHIFT without CAP_IPC_LOCK -> ENOMEM.
    `memlock` is the limit in bytes as text, "infinity" (RLIM_INFINITY), or None for the
    default a process gets without any setting: 8 MiB (linux include/uapi/linux/resource.h
    MLOCK_LIMIT, systemd >= 253 DefaultLimitMEMLOCK)."""
    ipc_lock = "IPC_LOCK" in capabilities or "CAP_IPC_LOCK" in capabilities
    if memlock is None:
        limit = 8 << 20
    elif memlock in (RLIM_INFINITY, "unlimited"):
        return "ok"
    else:
        limit = int(memlock)
    if limit == 0 and not ipc_lock:
        return "EPERM"
    pages = -(-pinned_bytes // page_size)
    if pages > limit // page_size and not ipc_lock:
        return "ENOMEM"
    return "ok"


# --- ofiwg/libfabric prov/efa/src/efa_fork_support.c, efa_env.c; man/fi_efa.7.md ------------------
_FORK_SAFE_VARS = ("FI_EFA_FORK_SAFE", "RDMAV_FORK_SAFE", "IBV_FORK_SAFE")
_TRUE = ("1", "on", "true", "yes", "y")


class LibfabricAbort(Exception):
    """The EFA provider prints why and calls abort() at initialization."""


def efa_uses_huge_pages(env: dict[str, str]) -> bool:
    """Does the EFA provider allocate its internal buffers from huge pages with this environment?

    efa_fork_support_request_initialize: any of FI_EFA_FORK_SAFE (a libfabric bool),
    RDMAV_FORK_SAFE or IBV_FORK_SAFE (set at all) turns rdma-core fork support on, and with it
    huge pages off; FI_EFA_USE_HUGE_PAGE=1 together with fork support aborts. Otherwise
    FI_EFA_USE_HUGE_PAGE decides, and unset means huge pages (fi_efa(7): "By default, EFA
    provider will use huge page unless FI_EFA_FORK_SAFE is set")."""
    fork = str(env.get("FI_EFA_FORK_SAFE", "0")).lower() in _TRUE or any(k in env for k in _FORK_SAFE_VARS[1:])
    setting = env.get("FI_EFA_USE_HUGE_PAGE")
    explicit = None if setting is None else str(setting).lower() in _TRUE
    if fork:
        if explicit:
            raise LibfabricAbort("FI_EFA_USE_HUGE_PAGE=1 with fork support: libfabric aborts")
        return False
    return explicit is not False


# --- Where each mirror above was read ---------------------------------------
# Every public function of this module names the upstream repository, the paths and the tag or
# commit its logic was read from, and, where the project pins that upstream (a chart, an image,
# an AMI release, a Python package), the pin's value at the time of reading. A pin that moves
# without its mirrors being re-read and updated here fails tests/test_upstream_mirrors.py.
# `pin` names an attribute path in infra/versions.py ("KUBERAY_OPERATOR.version") or a
# package of requirements.txt ("requirements.txt:pulumi-eks").


@dataclass(frozen=True)
class Mirror:
    repo: str
    paths: tuple[str, ...]
    ref: str  # a tag, or a commit (12+ hex digits) of the default branch
    pin: tuple[str, str] | None  # (where the project pins it, the value the mirror was checked against)
    note: str = ""


_PULUMI = Mirror(
    "pulumi/pulumi",
    (
        "sdk/go/common/workspace/config.go",
        "sdk/go/common/workspace/project.go",
        "sdk/go/common/resource/config/crypt.go",
    ),
    "v3.272.0",
    ("requirements.txt:pulumi", "3.272.0"),
    "read in 2026-08 against the pinned SDK/CLI release (deploy.yml PULUMI_VERSION)",
)
_KUBERAY = Mirror(
    "ray-project/kuberay",
    ("ray-operator/controllers/ray/common/pod.go", "ray-operator/controllers/ray/common/service.go"),
    "v1.7.0",
    ("KUBERAY_OPERATOR.version", "1.7.0"),
)
_EFA_CHART = Mirror(
    "aws/eks-charts",
    ("stable/aws-efa-k8s-device-plugin/templates/daemonset.yaml",),
    "v0.5.30",
    ("EFA_DEVICE_PLUGIN.version", "v0.5.30"),
)
_KUBERNETES = Mirror(
    "kubernetes/kubernetes",
    ("pkg/apis/core/v1/helper/helpers.go (MatchNodeSelectorTerms)", "staging/src/k8s.io/apimachinery/pkg/labels"),
    "v1.35.0",
    ("DEFAULT_KUBERNETES_VERSION", "1.35"),
    "label selectors and required node affinity: terms ORed, expressions ANDed",
)
_POD_IDENTITY = Mirror(
    "aws/amazon-eks-pod-identity-webhook",
    ("pkg/handler/handler.go", "main.go"),
    "v0.6.17",
    ("DEFAULT_KUBERNETES_VERSION", "1.35"),
    "EKS runs the webhook; its release follows the cluster's Kubernetes version",
)
_BOTOCORE = Mirror(
    "boto/botocore",
    ("botocore/credentials.py (ContainerProvider)", "botocore/utils.py (ContainerMetadataFetcher)"),
    "0e6e2404b85d",
    ("RAY_IMAGE", "rayproject/ray-llm:2.60.0-py312-cu130"),
    "botocore 1.43.67 (2026-08-07); the image's boto3 fetches the S3 working_dir",
)
_PULUMI_EKS = Mirror(
    "pulumi/pulumi-eks",
    ("nodejs/eks/nodes/nodegroup.ts", "nodejs/eks/nodes/instances.ts"),
    "v4.4.0",
    ("requirements.txt:pulumi-eks", "4.4.0"),
)
_EKS_AMI = Mirror(
    "awslabs/amazon-eks-ami",
    (
        "nodeadm/internal/containerd/base-runtime-spec.json",
        "nodeadm/internal/containerd/base_runtime_spec.go",
        "templates/al2023/runtime/rootfs/etc/systemd/system/nodeadm-run.service",
    ),
    "v20260724",
    ("AMI_RELEASE_VERSION", "1.35.6-20260714"),
    "read at v20260724; unchanged from the pinned v20260714 in these files",
)
_ELASTICACHE = Mirror(
    "pulumi/pulumi-aws",
    ("bridged hashicorp/terraform-provider-aws internal/service/elasticache/replication_group.go",),
    "v7.51.1",
    ("requirements.txt:pulumi-aws", "7.51.1"),
    "read in 2026-08 against the pinned provider; plus the ElastiCache API (AuthToken) and ray's kuberay-gcs-ft.md",
)

_CLUSTER_AUTOSCALER = Mirror(
    "kubernetes/autoscaler",
    (
        "cluster-autoscaler/cloudprovider/aws/aws_cloud_provider.go (GPULabel)",
        "cluster-autoscaler/utils/gpu/gpu.go",
        "cluster-autoscaler/processors/customresources/gpu_processor.go",
    ),
    "cluster-autoscaler-1.35.2",
    ("CLUSTER_AUTOSCALER.version", "9.59.0"),
    "chart cluster-autoscaler-9.59.0 ships CA 1.35.x",
)
_RAY_REDIS = Mirror(
    "ray-project/ray",
    ("src/ray/common/ray_config_def.h (REDIS_CA_CERT)", "src/ray/gcs/store_client/redis_context.cc"),
    "ray-2.60.0",
    ("RAY_VERSION", "2.60.0"),
    "plus KubeRay v1.7.0 raycluster_controller.go buildRedisCleanupJob (the Job is built from the head)",
)
_RAY_SERVE = Mirror(
    "ray-project/ray",
    (
        "python/ray/serve/_private/controller.py (_update_proxy_nodes)",
        "python/ray/serve/_private/deployment_scheduler.py (_schedule_replica)",
        "python/ray/dashboard/modules/reporter/healthz_agent.py",
        "python/ray/_private/label_utils.py (validate_node_labels)",
    ),
    "ray-2.60.0",
    ("RAY_VERSION", "2.60.0"),
    "read in the installed wheel; KubeRay v1.7.0 pod.go for the injected probe",
)
_ENDPOINTSLICE = Mirror(
    "kubernetes/kubernetes",
    ("staging/src/k8s.io/endpointslice/utils.go (getEndpointPorts, findPort)",),
    "v1.35.0",
    ("DEFAULT_KUBERNETES_VERSION", "1.35"),
    "read at master commit e637659d: a named targetPort resolves per pod, the same in v1.35.0",
)

MIRRORS: dict[str, Mirror] = {
    "ca_counts_node_ready": _CLUSTER_AUTOSCALER,
    "ray_redis_ca_file": _RAY_REDIS,
    "redis_cleanup_job_env": _RAY_REDIS,
    "serve_replica_nodes": _RAY_SERVE,
    "readiness_passes": _RAY_SERVE,
    "ray_custom_label_errors": _RAY_SERVE,
    "endpoint_port": _ENDPOINTSLICE,
    "merge_config": _PULUMI,
    "label_pod": _KUBERAY,
    "rayservice_pod": _KUBERAY,
    "ray_start_flags": _KUBERAY,
    "incremental_upgrade": _KUBERAY,
    "serve_service": _KUBERAY,
    "selects": _KUBERNETES,
    "efa_daemonset_affinity": _EFA_CHART,
    "node_matches": _KUBERNETES,
    "pod_identity_mutate": _POD_IDENTITY,
    "botocore_container_credentials": _BOTOCORE,
    "mng_image": _PULUMI_EKS,
    "mng_root_volume": _PULUMI_EKS,
    "mng_metadata_options": _PULUMI_EKS,
    "efa_network_interfaces": _PULUMI_EKS,
    "container_memlock": _EKS_AMI,
    "elasticache_replication_group_errors": _ELASTICACHE,
    "ib_umem_get": Mirror(
        "torvalds/linux",
        ("drivers/infiniband/core/umem.c (ib_umem_get)", "mm/mlock.c (can_do_mlock)"),
        "0446cad9ca38",
        ("AMI_RELEASE_VERSION", "1.35.6-20260714"),
        "the same two checks in later kernels (pinned_vm, pin_user_pages_fast); the AMI release brings the kernel",
    ),
    "efa_uses_huge_pages": Mirror(
        "ofiwg/libfabric",
        ("prov/efa/src/efa_fork_support.c", "prov/efa/src/efa_env.c", "man/fi_efa.7.md"),
        "af8ddbe92f03",
        ("EFA_INSTALLER_VERSION", "1.49.0"),
        "main of 2026-08-21 (v2.6.0rc1+); the EFA installer 1.49.0 carries the libfabric the image runs",
    ),
    "async_engine_kwargs": Mirror(
        "ray-project/ray",
        ("python/ray/llm/_internal/serve/engines/vllm/vllm_models.py (VLLMEngineConfig.from_llm_config)",),
        "ray-2.60.0",
        ("RAY_VERSION", "2.60.0"),
        "engine_kwargs named by vLLM's FrontendArgs go to frontend_kwargs, the rest to AsyncEngineArgs",
    ),
}


# --- ray/llm/_internal/serve/engines/vllm/vllm_models.py (VLLMEngineConfig.from_llm_config, Ray 2.60) --
def async_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of an LLMConfig's engine_kwargs Ray hands vLLM's AsyncEngineArgs: every key
    that is not a field of vLLM's FrontendArgs (those go to the OpenAI layer, e.g.
    enable_prompt_tokens_details, tool_call_parser)."""
    import dataclasses

    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    frontend = {f.name for f in dataclasses.fields(FrontendArgs)}
    return {k: v for k, v in engine_kwargs.items() if k not in frontend}
