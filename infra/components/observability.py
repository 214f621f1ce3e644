"""Observability: metrics pipeline, GPU metrics, monitors, alerts and dashboards.

What flows through here: the cluster's core (`ClusterCore`: name, provider, region, tags), the
stack's `observability` block, the serving spec (SLOs), the LLM namespace, the GPU instance
types, the KV-transfer alert groups and the scrape targets other components expose ->
- the EBS CSI driver add-on (its own Pod Identity role) and an encrypted gp3 StorageClass,
  so Prometheus, Alertmanager and Grafana keep their data on encrypted volumes;
- kube-prometheus-stack (pinned) in `monitoring` on the system nodes; with
  `amazon-managed-prometheus`, also an AMP workspace that this Prometheus remote-writes to
  (SigV4, through a Pod Identity role allowed `aps:RemoteWrite` on that workspace only);
- NVIDIA's DCGM exporter (pinned) on the GPU nodes only;
- the monitors, the PrometheusRule and the dashboard ConfigMaps of `infra.k8s`, and a
  NetworkPolicy that lets Prometheus reach the Ray pods' metrics port;
- with `tracing.enabled`: the OpenTelemetry collector, Tempo and its S3 bucket
  (infra/components/tracing.py), Grafana's Tempo data source and the dashboard's links from
  the latency panels to the traces.
Everything in-cluster waits for the chart that installs the Prometheus Operator CRDs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra import versions
from infra.components.cluster import ClusterCore
from infra.components.helm import release
from infra.components.iam import trusted_by
from infra.components.outputs import placed
from infra.components.tracing import create_trace_store
from infra.config import MetricsStack, Observability
from infra.k8s import alerts, dashboards, monitoring, tracing
from serving.spec import SloSpec

EBS_CSI_POLICY = "arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"
EBS_CSI_SERVICE_ACCOUNT = "ebs-csi-controller-sa"  # the add-on's controller (aws-ebs-csi-driver chart)
PROMETHEUS_SERVICE_ACCOUNT = "prometheus"
GPU_METRICS_NAMESPACE = "gpu-monitoring"


@dataclass
class ObservabilityArgs:
    cluster: ClusterCore
    """The cluster: its name (the EBS CSI add-on and the Pod Identity associations attach to
    it), Kubernetes provider, region (SigV4 remote write to Amazon Managed Prometheus, Tempo's
    bucket) and tags."""
    settings: Observability
    """The stack's `observability` block: which pipeline, retention, volume size, intervals."""
    slo: SloSpec
    """The serving spec's SLOs, for the burn-rate alerts."""
    llm_namespace: str
    """Namespace of the RayService: its pods are scraped and its rules live there."""
    gpu_instance_types: list[str]
    """Instance types the DCGM exporter may run on (GPU nodes only)."""
    targets: list[monitoring.ScrapeTarget] = field(default_factory=list)
    """Services to scrape besides the Ray pods (KubeRay operator, node autoscaler, ...)."""
    extra_rule_groups: list[dict[str, Any]] = field(default_factory=list)
    """More PrometheusRule groups (the KV-transfer alerts)."""
    kv_offload: bool = False
    """A pool has a KV offload tier: the dashboard gets its row (the alerts come as extra groups)."""
    namespaces: dict[str, pulumi.Input[str]] = field(default_factory=dict)
    """Namespaces other components create (the LLM namespace, KubeRay's), name -> that name as an
    output of the Namespace resource: the monitors, rules and policies put there take it from
    here, so they are created after it."""


class ObservabilityStack(pulumi.ComponentResource):
    prometheus_url: pulumi.Output[str]
    workspace_id: pulumi.Output[str | None]
    traces_bucket: pulumi.Output[str | None]

    def __init__(self, name: str, args: ObservabilityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:observability:ObservabilityStack", name, None, opts)
        cluster = args.cluster
        aws_opts = pulumi.ResourceOptions(parent=self)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=cluster.provider)
        obs = args.settings

        volumes = create_encrypted_volumes(name, cluster, aws_opts, k8s_opts)
        ns = k8s.core.v1.Namespace(f"{name}-ns", metadata={"name": monitoring.MONITORING_NAMESPACE}, opts=k8s_opts)
        # Where the metrics go: this Prometheus only, or also an AMP workspace.
        remote_write: pulumi.Output[str] | None = None
        self.workspace_id = pulumi.Output.from_input(None)
        if obs.stack is MetricsStack.AMAZON_MANAGED_PROMETHEUS:
            amp = create_amp_workspace(name, cluster, aws_opts)
            remote_write, self.workspace_id = amp.remote_write_url, amp.workspace.id
        stack = create_metrics_stack(self, name, args, remote_write, [ns, *volumes.resources])
        create_gpu_metrics(self, name, args, stack, k8s_opts)
        create_monitors(self, name, args, stack, ns, k8s_opts)

        # Request traces: collector -> Tempo -> S3.
        self.traces_bucket = pulumi.Output.from_input(None)
        if obs.tracing.enabled:
            bucket = create_trace_store(
                self,
                name,
                obs.tracing,
                cluster_name=cluster.name,
                region=cluster.region,
                llm_namespace=args.llm_namespace,
                provider=cluster.provider,
                depends_on=[ns, *volumes.resources],
                tags=dict(cluster.tags),
            )
            self.traces_bucket = bucket.bucket

        self.prometheus_url = pulumi.Output.from_input(monitoring.PROMETHEUS_URL)
        self.register_outputs(
            {
                "prometheusUrl": self.prometheus_url,
                "ampWorkspaceId": self.workspace_id,
                "tracesBucket": self.traces_bucket,
            }
        )


@dataclass
class EncryptedVolumes:
    storage_class: k8s.storage.v1.StorageClass
    csi_driver: aws.eks.Addon

    @property
    def resources(self) -> list[pulumi.Resource]:
        """What a workload with a persistent volume waits for: the class and its driver."""
        return [self.storage_class, self.csi_driver]


def create_encrypted_volumes(
    name: str, cluster: ClusterCore, aws_opts: pulumi.ResourceOptions, k8s_opts: pulumi.ResourceOptions
) -> EncryptedVolumes:
    """The EBS CSI driver add-on (its own Pod Identity role) and a gp3 StorageClass that
    encrypts, so Prometheus, Alertmanager, Grafana and Tempo keep their data encrypted."""
    tags = dict(cluster.tags)
    csi_role = aws.iam.Role(
        f"{name}-ebs-csi",
        assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
        tags=tags,
        opts=aws_opts,
    )
    aws.iam.RolePolicyAttachment(f"{name}-ebs-csi-policy", role=csi_role.name, policy_arn=EBS_CSI_POLICY, opts=aws_opts)
    csi = aws.eks.Addon(
        f"{name}-ebs-csi-driver",
        cluster_name=cluster.name,
        addon_name="aws-ebs-csi-driver",
        pod_identity_associations=[
            aws.eks.AddonPodIdentityAssociationArgs(role_arn=csi_role.arn, service_account=EBS_CSI_SERVICE_ACCOUNT)
        ],
        tags=tags,
        opts=aws_opts,
    )
    sc = monitoring.storage_class()
    storage = k8s.storage.v1.StorageClass(
        f"{name}-gp3",
        metadata=sc["metadata"],
        provisioner=sc["provisioner"],
        parameters=sc["parameters"],
        reclaim_policy=sc["reclaimPolicy"],
        volume_binding_mode=sc["volumeBindingMode"],
        allow_volume_expansion=sc["allowVolumeExpansion"],
        opts=k8s_opts,
    )
    return EncryptedVolumes(storage, csi)


@dataclass
class AmpWorkspace:
    workspace: aws.amp.Workspace
    remote_write_url: pulumi.Output[str]


def create_amp_workspace(name: str, cluster: ClusterCore, aws_opts: pulumi.ResourceOptions) -> AmpWorkspace:
    """An Amazon Managed Prometheus workspace and the Pod Identity role that lets this
    Prometheus's service account remote-write to it (`aps:RemoteWrite` there only)."""
    tags = dict(cluster.tags)
    workspace = aws.amp.Workspace(f"{name}-amp", alias=f"{name}-metrics", tags=tags, opts=aws_opts)
    writer = aws.iam.Role(
        f"{name}-amp-writer",
        assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
        tags=tags,
        opts=aws_opts,
    )
    aws.iam.RolePolicy(
        f"{name}-amp-write",
        role=writer.id,
        policy=workspace.arn.apply(
            lambda arn: json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": ["aps:RemoteWrite"], "Resource": [arn]}],
                }
            )
        ),
        opts=aws_opts,
    )
    aws.eks.PodIdentityAssociation(
        f"{name}-prometheus-identity",
        cluster_name=cluster.name,
        namespace=monitoring.MONITORING_NAMESPACE,
        service_account=PROMETHEUS_SERVICE_ACCOUNT,
        role_arn=writer.arn,
        tags=tags,
        opts=aws_opts,
    )
    # The workspace's endpoint ends in "/"; Prometheus writes to .../api/v1/remote_write.
    return AmpWorkspace(workspace, pulumi.Output.concat(workspace.prometheus_endpoint, "api/v1/remote_write"))


def create_metrics_stack(
    owner: pulumi.ComponentResource,
    name: str,
    args: ObservabilityArgs,
    remote_write: pulumi.Output[str] | None,
    depends_on: list[pulumi.Resource],
) -> k8s.helm.v4.Chart:
    """kube-prometheus-stack in `monitoring` (remote-writing to `remote_write` when set; with
    tracing, Grafana gets the Tempo data source), after its namespace and volumes."""
    obs = args.settings
    values = monitoring.metrics_stack_values(
        obs,
        prometheus_service_account=PROMETHEUS_SERVICE_ACCOUNT,
        remote_write_url=remote_write,
        region=args.cluster.region,
    )
    if obs.tracing.enabled and values["grafana"]["enabled"]:
        values["grafana"]["additionalDataSources"] = [tracing.grafana_tempo_datasource()]
    return release(
        owner,
        f"{name}-kube-prometheus-stack",
        versions.KUBE_PROMETHEUS_STACK,
        monitoring.MONITORING_NAMESPACE,
        values,
        args.cluster.provider,
        depends_on=depends_on,
        release_name=monitoring.METRICS_RELEASE,
    )


def create_gpu_metrics(
    owner: pulumi.ComponentResource,
    name: str,
    args: ObservabilityArgs,
    stack: pulumi.Resource,
    k8s_opts: pulumi.ResourceOptions,
) -> None:
    """NVIDIA's DCGM exporter in its own namespace, on the GPU nodes only (after the CRDs)."""
    gpu_ns = k8s.core.v1.Namespace(f"{name}-gpu-ns", metadata={"name": GPU_METRICS_NAMESPACE}, opts=k8s_opts)
    release(
        owner,
        f"{name}-dcgm-exporter",
        versions.DCGM_EXPORTER,
        GPU_METRICS_NAMESPACE,
        monitoring.dcgm_exporter_values(args.gpu_instance_types),
        args.cluster.provider,
        depends_on=[gpu_ns, stack],
    )


def create_monitors(
    owner: pulumi.ComponentResource,
    name: str,
    args: ObservabilityArgs,
    stack: pulumi.Resource,
    ns: k8s.core.v1.Namespace,
    k8s_opts: pulumi.ResourceOptions,
) -> None:
    """What to scrape, alert on and show: the Ray pods' PodMonitor, a ServiceMonitor per
    target and the PrometheusRule (after the chart that installs their CRDs), the dashboard
    ConfigMaps, and the NetworkPolicy that lets Prometheus reach the Ray pods' metrics port."""
    obs, provider = args.settings, args.cluster.provider
    after_crds = pulumi.ResourceOptions(parent=owner, provider=provider, depends_on=[stack])
    objects = [
        monitoring.ray_pod_monitor(args.llm_namespace, obs.scrape_interval_seconds),
        *(monitoring.service_monitor(t) for t in args.targets),
        alerts.prometheus_rule("pd-inference", args.llm_namespace, args.slo, obs, args.extra_rule_groups),
    ]
    for obj in objects:
        meta = obj["metadata"]
        k8s.apiextensions.CustomResource(
            f"{name}-{obj['kind'].lower()}-{meta['namespace']}-{meta['name']}",
            api_version=obj["apiVersion"],
            kind=obj["kind"],
            metadata=placed(meta, args.namespaces),
            spec=obj["spec"],
            opts=after_crds,
        )
    for cm in dashboards.dashboard_configmaps(trace_links=obs.tracing.enabled, kv_offload=args.kv_offload):
        k8s.core.v1.ConfigMap(
            f"{name}-{cm['metadata']['name']}",
            metadata=cm["metadata"],
            data=cm["data"],
            opts=pulumi.ResourceOptions(parent=owner, provider=provider, depends_on=[ns]),
        )
    np_ = monitoring.metrics_network_policy(args.llm_namespace)
    k8s.networking.v1.NetworkPolicy(
        f"{name}-scrape-netpol", metadata=placed(np_["metadata"], args.namespaces), spec=np_["spec"], opts=k8s_opts
    )
