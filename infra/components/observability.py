"""Observability: metrics pipeline, GPU metrics, monitors, alerts and dashboards.

What flows through here: the stack's `observability` block, the serving spec (SLOs), the LLM
namespace, the GPU instance types, the KV-transfer alert groups and the scrape targets other
components expose ->
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
from infra.components.helm import release
from infra.components.iam import trusted_by
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
    provider: k8s.Provider
    """Kubernetes provider of the cluster."""
    cluster_name: pulumi.Input[str]
    """EKS cluster name: the EBS CSI add-on and the Pod Identity associations attach to it."""
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
    region: str | None = None
    """AWS region, for SigV4 remote write to Amazon Managed Prometheus."""
    tags: dict[str, str] = field(default_factory=dict)
    """AWS tags of every AWS resource this component creates."""


class ObservabilityStack(pulumi.ComponentResource):
    prometheus_url: pulumi.Output[str]
    workspace_id: pulumi.Output[str | None]
    traces_bucket: pulumi.Output[str | None]

    def __init__(self, name: str, args: ObservabilityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:observability:ObservabilityStack", name, None, opts)
        aws_opts = pulumi.ResourceOptions(parent=self)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider)
        tags = dict(args.tags)
        obs = args.settings

        # --- encrypted volumes: the EBS CSI driver and a gp3 class that encrypts ------------
        csi_role = aws.iam.Role(
            f"{name}-ebs-csi",
            assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
            tags=tags,
            opts=aws_opts,
        )
        aws.iam.RolePolicyAttachment(
            f"{name}-ebs-csi-policy", role=csi_role.name, policy_arn=EBS_CSI_POLICY, opts=aws_opts
        )
        csi = aws.eks.Addon(
            f"{name}-ebs-csi-driver",
            cluster_name=args.cluster_name,
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

        # --- where the metrics go --------------------------------------------------------------
        ns = k8s.core.v1.Namespace(f"{name}-ns", metadata={"name": monitoring.MONITORING_NAMESPACE}, opts=k8s_opts)
        remote_write: pulumi.Output[str] | None = None
        self.workspace_id = pulumi.Output.from_input(None)
        if obs.stack is MetricsStack.AMAZON_MANAGED_PROMETHEUS:
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
                cluster_name=args.cluster_name,
                namespace=monitoring.MONITORING_NAMESPACE,
                service_account=PROMETHEUS_SERVICE_ACCOUNT,
                role_arn=writer.arn,
                tags=tags,
                opts=aws_opts,
            )
            # The workspace's endpoint ends in "/"; Prometheus writes to .../api/v1/remote_write.
            remote_write = pulumi.Output.concat(workspace.prometheus_endpoint, "api/v1/remote_write")
            self.workspace_id = workspace.id

        values = monitoring.metrics_stack_values(
            obs,
            prometheus_service_account=PROMETHEUS_SERVICE_ACCOUNT,
            remote_write_url=remote_write,
            region=args.region,
        )
        if obs.tracing.enabled and values["grafana"]["enabled"]:
            values["grafana"]["additionalDataSources"] = [tracing.grafana_tempo_datasource()]
        stack = release(
            self,
            f"{name}-kube-prometheus-stack",
            versions.KUBE_PROMETHEUS_STACK,
            monitoring.MONITORING_NAMESPACE,
            values,
            args.provider,
            depends_on=[ns, storage, csi],
            release_name=monitoring.METRICS_RELEASE,
        )

        # --- GPU metrics: DCGM exporter on the GPU nodes only ------------------------------------
        gpu_ns = k8s.core.v1.Namespace(f"{name}-gpu-ns", metadata={"name": GPU_METRICS_NAMESPACE}, opts=k8s_opts)
        release(
            self,
            f"{name}-dcgm-exporter",
            versions.DCGM_EXPORTER,
            GPU_METRICS_NAMESPACE,
            monitoring.dcgm_exporter_values(args.gpu_instance_types),
            args.provider,
            depends_on=[gpu_ns, stack],
        )

        # --- what to scrape, alert on and show ----------------------------------------------------
        after_crds = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[stack])
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
                metadata=meta,
                spec=obj["spec"],
                opts=after_crds,
            )
        for cm in dashboards.dashboard_configmaps(trace_links=obs.tracing.enabled):
            k8s.core.v1.ConfigMap(
                f"{name}-{cm['metadata']['name']}",
                metadata=cm["metadata"],
                data=cm["data"],
                opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[ns]),
            )
        np_ = monitoring.metrics_network_policy(args.llm_namespace)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-scrape-netpol", metadata=np_["metadata"], spec=np_["spec"], opts=k8s_opts
        )

        # --- request traces: collector -> Tempo -> S3 ------------------------------------------
        self.traces_bucket = pulumi.Output.from_input(None)
        if obs.tracing.enabled:
            bucket = create_trace_store(
                self,
                name,
                obs.tracing,
                cluster_name=args.cluster_name,
                region=args.region,
                llm_namespace=args.llm_namespace,
                provider=args.provider,
                depends_on=[ns, storage, csi],
                tags=tags,
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
