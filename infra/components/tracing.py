"""Request traces in the cluster: the OpenTelemetry collector, Tempo and Tempo's S3 bucket.

What flows through here: the stack's `observability.tracing` block (retention), the cluster
name, region, LLM namespace and tags, and what the observability stack already made (its
namespace, the chart that installs Grafana, the encrypted StorageClass) ->
- an S3 bucket for Tempo's blocks: private, KMS-encrypted, objects expired a day after
  Tempo's own retention, incomplete uploads aborted after a day (Tempo's docs recommend it);
- an IAM role that Tempo's ServiceAccount assumes through EKS Pod Identity, allowed Tempo's
  documented S3 actions on that bucket only, and its association (made before the chart, so
  the pod is admitted with credentials);
- the Tempo and opentelemetry-collector Helm releases (pinned in infra/versions.py) in
  `monitoring` on the system nodes, and the NetworkPolicies of infra/k8s/tracing.py.
Called by ObservabilityStack only when tracing is on; the Ray pods' side (environment,
exporter ConfigMap, engine argument) is LlmService's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra import versions
from infra.components.buckets import private_bucket
from infra.components.helm import release
from infra.components.iam import trusted_by
from infra.config import Tracing
from infra.k8s import tracing
from infra.k8s.monitoring import MONITORING_NAMESPACE


def create_trace_store(
    owner: pulumi.ComponentResource,
    name: str,
    settings: Tracing,
    *,
    cluster_name: pulumi.Input[str],
    region: str | None,
    llm_namespace: str,
    provider: k8s.Provider,
    depends_on: Sequence[pulumi.Resource],
    tags: dict[str, str],
) -> aws.s3.Bucket:
    """Everything above, parented to `owner`; returns Tempo's bucket."""
    aws_opts = pulumi.ResourceOptions(parent=owner)
    bucket = _bucket(name, settings.retention_days, tags, aws_opts)
    role = aws.iam.Role(
        f"{name}-tempo",
        assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
        tags=tags,
        opts=aws_opts,
    )
    policy = aws.iam.RolePolicy(
        f"{name}-tempo-s3",
        role=role.id,
        policy=bucket.arn.apply(lambda arn: json.dumps(tracing.tempo_bucket_policy(arn))),
        opts=aws_opts,
    )
    identity = aws.eks.PodIdentityAssociation(
        f"{name}-tempo-identity",
        cluster_name=cluster_name,
        namespace=MONITORING_NAMESPACE,
        service_account=tracing.TEMPO_SERVICE_ACCOUNT,
        role_arn=role.arn,
        tags=tags,
        opts=aws_opts,
    )
    tempo = release(
        owner,
        f"{name}-tempo",
        versions.TEMPO,
        MONITORING_NAMESPACE,
        tracing.tempo_values(bucket.bucket, region, settings.retention_days),
        provider,
        depends_on=[*depends_on, policy, identity],
        release_name=tracing.TEMPO_RELEASE,
    )
    release(
        owner,
        f"{name}-otel-collector",
        versions.OTEL_COLLECTOR,
        MONITORING_NAMESPACE,
        tracing.collector_values(),
        provider,
        depends_on=[*depends_on, tempo],
        release_name=tracing.COLLECTOR_RELEASE,
    )
    k8s_opts = pulumi.ResourceOptions(parent=owner, provider=provider, depends_on=list(depends_on))
    for np_ in tracing.network_policies(llm_namespace):
        k8s.networking.v1.NetworkPolicy(
            f"{name}-{np_['metadata']['name']}-netpol", metadata=np_["metadata"], spec=np_["spec"], opts=k8s_opts
        )
    return bucket


def _bucket(name: str, retention_days: int, tags: dict[str, str], opts: pulumi.ResourceOptions) -> aws.s3.Bucket:
    """Tempo's blocks: private, KMS-encrypted, expired a day after Tempo's own retention."""
    bucket = private_bucket(f"{name}-traces", tags, opts)
    aws.s3.BucketLifecycleConfiguration(
        f"{name}-traces-lifecycle",
        bucket=bucket.id,
        rules=[
            aws.s3.BucketLifecycleConfigurationRuleArgs(
                id="expire-after-tempo-retention",
                status="Enabled",
                filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=""),
                expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=retention_days + 1),
                abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                    days_after_initiation=1
                ),
            )
        ],
        opts=opts,
    )
    return bucket
