"""LlmService: the OpenAI-compatible P/D service, as a KubeRay RayService and what it needs.

What flows through here: the cluster's core (`ClusterCore`: name, provider, Pod Identity
agent, region, VPC range, tags), the serving spec, the pools' instance types, the secret
Outputs (API keys, Hugging Face token, Redis password) and the stack's endpoint settings ->
- a code bucket (private, encrypted, versioned) holding serving/ as a content-hashed zip,
  which the RayService's runtime_env points at (no custom image);
- an IAM role the Ray pods assume through EKS Pod Identity: read that zip and, in the model
  bucket, only each model's prefix and each model's LoRA adapters' prefix; nothing else;
- Kubernetes Secrets fed from Pulumi secrets, reaching the pods only as secret references;
- the RayService (`infra.k8s.rayservice.rayservice_manifest`) whose `serveService` is the
  OpenAI API's Service (ClusterIP or an internal NLB limited to the allowed CIDRs; KubeRay
  points it at the active cluster's serving pods), and a NetworkPolicy;
- with request tracing on, the ConfigMap that carries Serve's span exporter
  (serving/tracing.py) into every Ray pod (infra/k8s/tracing.py).
The RayService waits for everything its pods need at admission: the Pod Identity
associations, the role's policy, the ServiceAccounts, the Secrets and the Pod Identity agent
(the webhook wires credentials in only when a pod is admitted). Its output `endpoint` is the
API's base URL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra import catalog
from infra.components.buckets import private_bucket
from infra.components.cluster import ClusterCore
from infra.components.iam import trusted_by
from infra.components.kuberay import KubeRayOperator
from infra.components.outputs import placed
from infra.config import ServiceExposure
from infra.config.kv_offload import KvOffload
from infra.k8s.api_access import namespace_ingress_policy
from infra.k8s.egress import fallback_egress_policy
from infra.k8s.rayservice import PoolBounds, RayServiceInputs, SecretRef, rayservice_manifest, serve_config_yaml
from infra.k8s.tracing import TraceExport, exporter_configmap
from infra.package import write_serving_zip
from infra.paths import BUILD_DIR
from infra.sizing.head import HEAD_BASE_VCPUS
from serving.spec import SERVE_PORT, ServingSpec

API_KEYS_SECRET_KEY = "api-keys"


@dataclass
class LlmServiceArgs:
    cluster: ClusterCore
    """The cluster: its name (the Pod Identity associations' cluster), Kubernetes provider,
    Pod Identity agent (it serves the pods' credentials: the RayService waits for it, and for
    its associations, ServiceAccounts and Secrets), region (the Ray pods' AWS_REGION /
    AWS_DEFAULT_REGION, so their SDKs never ask the instance metadata service, which pods
    cannot reach), VPC range (the NetworkPolicy's API sources when no client CIDRs are given,
    and behind the NLB the forwarding nodes' addresses: infra/k8s/api_access.py) and tags."""
    namespace: str
    """Namespace of the RayService, its Secrets and Services."""
    operator: KubeRayOperator
    """The KubeRay operator: the RayService CRD must exist first, and `namespace` is one of its
    namespaces (every object here takes it from the operator's Namespace resource)."""
    serving: ServingSpec
    """The serving spec: renders serveConfigV2 and sizes the worker groups."""
    instances: dict[str, catalog.InstanceType]
    """Node pool name -> its instance type (GPUs and EFA per pod), for the pools the models use."""
    image: pulumi.Input[str]
    """Ray image of the head and workers: a pinned reference, or the built worker image's Output."""
    exposure: ServiceExposure
    """How the OpenAI API is exposed: ClusterIP or an internal NLB."""
    allowed_cidrs: list[str]
    """Client CIDRs allowed to the API (NLB source ranges, NetworkPolicy)."""
    upgrade_strategy: str
    """RayService upgrade strategy (KubeRay's `upgradeStrategy.type`)."""
    api_keys: pulumi.Output[str] | None = None
    """Secret: comma-separated API keys, delivered as a Kubernetes Secret."""
    fallback_api_key: pulumi.Output[str] | None = None
    """Secret: the external fallback provider's key (stack secret fallbackApiKey), when serving.fallback is set."""
    hf_token: pulumi.Output[str] | None = None
    """Secret: Hugging Face token for gated models."""
    redis_password: pulumi.Output[str] | None = None
    """Secret: password of the GCS fault-tolerance Redis (the stack's gcsRedisPassword, or the
    managed group's generated AUTH token)."""
    gcs_redis_address: pulumi.Input[str] | None = None
    """`host:port` or `redis(s)://host:port` of that Redis (an Output for the managed group);
    None keeps GCS fault tolerance off."""
    model_bucket: str | None = None
    """S3 bucket the pods may read model weights from."""
    tracing: TraceExport | None = None
    """Request tracing (observability.tracing): the collector's address and the sampling
    ratio the Ray pods and engines export with; None: no tracing."""
    pool_bounds: dict[str, PoolBounds] = field(default_factory=dict)
    # By pool name: the pools' KV offload tiers (nodePools.<name>.kvOffload).
    kv_offload: dict[str, KvOffload] = field(default_factory=dict)
    """Node pool name -> its node group sizes: the worker groups' bounds with several models."""
    head_cpus: int = HEAD_BASE_VCPUS
    """CPU request of the Ray head pod: the head sizing's vCPUs at the planned rate
    (`infra.sizing.head`, printed by `make plan`)."""
    cold_start_s: dict[str, float] = field(default_factory=dict)
    """Engine role -> the planner's first request after idle (s), for roles at minReplicas 0
    (infra/plan/planning.py cold_start_seconds): the ingress's Retry-After while decode
    starts from zero."""
    replica_cpus: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model id -> engine role -> the CPUs its replica actor asks Ray for, where the plan sizes
    it above Ray's default (the decode replica's API side: infra/sizing/streaming.py)."""
    token_prices: dict[str, dict[str, float]] = field(default_factory=dict)
    """Model id -> cost phase (prefill, decode) -> USD per token on the cluster
    (infra/plan/costs.py): what the ingress's per-key cost counters multiply by."""


class LlmService(pulumi.ComponentResource):
    endpoint: pulumi.Output[str]
    service_name: str
    code_bucket: pulumi.Output[str]
    rayservice_name: str

    def __init__(self, name: str, args: LlmServiceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:serving:LlmService", name, None, opts)
        aws_opts = pulumi.ResourceOptions(parent=self)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.cluster.provider)
        self.rayservice_name = name
        code = create_code_bucket(name, dict(args.cluster.tags), aws_opts)
        self.code_bucket = code.bucket.bucket
        identity = create_pod_identity(name, args, code.bucket, aws_opts, k8s_opts)
        secrets = create_secrets(name, args, k8s_opts)
        self.service_name = f"{name}-openai"
        # Pod Identity mutates a pod only at admission and only if its association exists
        # (aws/amazon-eks-pod-identity-webhook handler.go), and KubeRay creates the pods as
        # soon as the RayService exists: everything the pods use comes first.
        ready: list[pulumi.Resource] = [
            args.operator,
            code.object,
            *identity.resources,
            *secrets.resources,
            args.cluster.pod_identity_agent,
        ]
        if args.tracing is not None:
            # The pods mount it at start: it must exist before KubeRay creates them.
            cm = exporter_configmap(args.tracing, name, args.namespace)
            ready.append(
                k8s.core.v1.ConfigMap(
                    f"{name}-serve-tracing", metadata=_placed(cm["metadata"], args), data=cm["data"], opts=k8s_opts
                )
            )
        create_rayservice(name, args, code, identity, secrets, self.service_name, ready, self)
        # KubeRay, not Pulumi, owns the serve Service (spec.serveService): an NLB's hostname is
        # read with kubectl (kubectl -n <ns> get svc <name>-openai); the in-cluster name works
        # from inside the VPC.
        self.endpoint = pulumi.Output.from_input(
            f"http://{self.service_name}.{args.namespace}.svc.cluster.local:{SERVE_PORT}/v1"
        )
        create_network_policies(name, args, k8s_opts)
        self.register_outputs({"endpoint": self.endpoint, "codeBucket": self.code_bucket})


@dataclass
class CodeBucket:
    bucket: aws.s3.Bucket
    object: aws.s3.BucketObjectv2
    """The content-hashed zip of serving/."""
    working_dir: pulumi.Output[str]
    """Its s3:// URL: the RayService's runtime_env working_dir."""


def create_code_bucket(name: str, tags: dict[str, str], opts: pulumi.ResourceOptions) -> CodeBucket:
    """serving/ as a content-hashed zip in a private, KMS-encrypted, versioned bucket."""
    bucket = private_bucket(f"{name}-code", tags, opts)
    aws.s3.BucketVersioning(
        f"{name}-code-versioning",
        bucket=bucket.id,
        versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
        opts=opts,
    )
    zip_path, sha = write_serving_zip(BUILD_DIR / "package")
    key = f"serving/{sha}.zip"
    obj = aws.s3.BucketObjectv2(
        f"{name}-code-zip",
        bucket=bucket.id,
        key=key,
        source=pulumi.FileAsset(str(Path(zip_path))),
        content_type="application/zip",
        server_side_encryption="aws:kms",
        tags=tags,
        opts=opts,
    )
    return CodeBucket(bucket, obj, pulumi.Output.concat("s3://", bucket.bucket, "/", key))


@dataclass
class PodIdentity:
    head_service_account: str
    worker_service_account: str
    resources: list[pulumi.Resource]
    """The role's policy, the associations and the ServiceAccounts: what pods need at admission."""


def create_pod_identity(
    name: str,
    args: LlmServiceArgs,
    code_bucket: aws.s3.Bucket,
    aws_opts: pulumi.ResourceOptions,
    k8s_opts: pulumi.ResourceOptions,
) -> PodIdentity:
    """The IAM role the Ray pods assume through EKS Pod Identity (read the code zip and, if
    set, the model bucket; nothing else), its association with the head's and the workers'
    ServiceAccounts, and those accounts."""
    head_sa, worker_sa = f"{name}-head", f"{name}-worker"
    role = aws.iam.Role(
        f"{name}-pods",
        assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
        tags=dict(args.cluster.tags),
        opts=aws_opts,
    )
    model_bucket = args.model_bucket
    prefixes = read_prefixes(args.serving, model_bucket)
    policy = aws.iam.RolePolicy(
        f"{name}-pods-read",
        role=role.id,
        policy=code_bucket.arn.apply(lambda arn: json.dumps(_read_policy(arn, model_bucket, prefixes))),
        opts=aws_opts,
    )
    created: list[pulumi.Resource] = [policy]
    for sa in (head_sa, worker_sa):
        created.append(
            aws.eks.PodIdentityAssociation(
                f"{name}-{sa.removeprefix(name + '-')}-identity",
                cluster_name=args.cluster.name,
                namespace=args.namespace,
                service_account=sa,
                role_arn=role.arn,
                tags=dict(args.cluster.tags),
                opts=aws_opts,
            )
        )
    created.append(
        k8s.core.v1.ServiceAccount(
            f"{name}-head-sa",
            metadata=_placed({"name": head_sa, "namespace": args.namespace}, args),
            # The head's autoscaler talks to the API server; KubeRay binds its Role to this account.
            automount_service_account_token=True,
            opts=k8s_opts,
        )
    )
    created.append(
        k8s.core.v1.ServiceAccount(
            f"{name}-worker-sa",
            metadata=_placed({"name": worker_sa, "namespace": args.namespace}, args),
            automount_service_account_token=False,
            opts=k8s_opts,
        )
    )
    return PodIdentity(head_sa, worker_sa, created)


@dataclass
class Secrets:
    api_keys: SecretRef | None
    fallback_api_key: SecretRef | None
    hf_token: SecretRef | None
    redis_password: SecretRef | None
    resources: list[pulumi.Resource]


def create_secrets(name: str, args: LlmServiceArgs, opts: pulumi.ResourceOptions) -> Secrets:
    """Pulumi secret config -> a Kubernetes Secret each -> references for the pods' env."""
    created: list[pulumi.Resource] = []

    def secret(suffix: str, value: pulumi.Output[str] | None, data_key: str) -> SecretRef | None:
        if value is None:
            return None
        sname = f"{name}-{suffix}"
        created.append(
            k8s.core.v1.Secret(
                f"{name}-{suffix}-secret",
                metadata=_placed({"name": sname, "namespace": args.namespace}, args),
                type="Opaque",
                # Output.secret's generic parameter defeats mypy's inference (pulumi 3.272).
                string_data={data_key: pulumi.Output.secret(value)},  # type: ignore[arg-type]
                opts=opts,
            )
        )
        return SecretRef(sname, data_key)

    return Secrets(
        api_keys=secret("api-keys", args.api_keys, API_KEYS_SECRET_KEY),
        fallback_api_key=secret(
            "fallback-api-key", args.fallback_api_key if args.serving.fallback else None, "api-key"
        ),
        hf_token=secret("hf-token", args.hf_token, "token"),
        redis_password=secret("redis", args.redis_password, "password"),
        resources=created,
    )


def create_rayservice(
    name: str,
    args: LlmServiceArgs,
    code: CodeBucket,
    identity: PodIdentity,
    secrets: Secrets,
    service_name: str,
    depends_on: list[pulumi.Resource],
    parent: pulumi.Resource,
) -> k8s.apiextensions.CustomResource:
    """The RayService (`infra.k8s.rayservice.rayservice_manifest`), after `depends_on`."""
    # A built image's reference is an Output; the manifest is plain data, so it carries a
    # stand-in that is swapped for the Output afterwards (everything else stays known).
    image_ref = args.image if isinstance(args.image, str) else _IMAGE_STAND_IN
    # The managed Redis's address is an Output too: the same stand-in swap.
    redis_address = args.gcs_redis_address
    redis_ref = redis_address if isinstance(redis_address, str) or redis_address is None else _REDIS_STAND_IN
    inputs = RayServiceInputs(
        name=name,
        namespace=args.namespace,
        image=image_ref,
        serving=args.serving,
        instances=args.instances,
        working_dir="",
        head_service_account=identity.head_service_account,
        worker_service_account=identity.worker_service_account,
        api_keys=secrets.api_keys,
        fallback_api_key=secrets.fallback_api_key,
        hf_token=secrets.hf_token,
        redis_password=secrets.redis_password,
        gcs_redis_address=redis_ref,
        upgrade_strategy=args.upgrade_strategy,
        region=args.cluster.region,
        service_name=service_name,
        head_cpus=args.head_cpus,
        cold_start_s=dict(args.cold_start_s),
        replica_cpus={m: dict(r) for m, r in args.replica_cpus.items()},
        token_prices={m: dict(p) for m, p in args.token_prices.items()},
        tracing=args.tracing,
        pool_bounds=dict(args.pool_bounds),
        kv_offload=dict(args.kv_offload),
        **_exposure(args.exposure, args.allowed_cidrs),
    )
    # Everything but serveConfigV2 is known at preview, so policies see the pods even
    # before the code bucket exists; only the Serve config waits for the bucket's name.
    spec = _swap(rayservice_manifest(inputs)["spec"], _IMAGE_STAND_IN, args.image)
    if redis_ref == _REDIS_STAND_IN:
        spec = _swap(spec, _REDIS_STAND_IN, redis_address)
    spec["serveConfigV2"] = code.working_dir.apply(lambda wd: serve_config_yaml(replace(inputs, working_dir=wd)))
    return k8s.apiextensions.CustomResource(
        f"{name}-rayservice",
        api_version="ray.io/v1",
        kind="RayService",
        metadata=_placed({"name": name, "namespace": args.namespace, "labels": {"app.kubernetes.io/name": name}}, args),
        spec=spec,
        opts=pulumi.ResourceOptions(parent=parent, provider=args.cluster.provider, depends_on=depends_on),
    )


def create_network_policies(name: str, args: LlmServiceArgs, opts: pulumi.ResourceOptions) -> None:
    """Only Ray's own pods, the operator and the API's clients may reach the namespace
    (infra/k8s/api_access.py: behind the NLB, the forwarding nodes too); with an external
    fallback, the ingress pods' egress too (infra/k8s/egress.py)."""
    ingress = namespace_ingress_policy(
        name,
        args.namespace,
        args.allowed_cidrs,
        args.cluster.vpc_cidr,
        behind_nlb=args.exposure is ServiceExposure.INTERNAL_NLB,
    )
    k8s.networking.v1.NetworkPolicy(
        f"{name}-netpol", metadata=_placed(ingress["metadata"], args), spec=ingress["spec"], opts=opts
    )
    if args.serving.fallback is not None:
        egress = fallback_egress_policy(
            name, args.namespace, args.cluster.vpc_cidr, args.serving.fallback.port, tracing=args.tracing is not None
        )
        k8s.networking.v1.NetworkPolicy(
            f"{name}-egress-netpol", metadata=_placed(egress["metadata"], args), spec=egress["spec"], opts=opts
        )


def _placed(meta: dict[str, Any], args: LlmServiceArgs) -> Any:
    """`meta` with its namespace from the operator's Namespace resource (created after it)."""
    return placed(meta, args.operator.namespaces)


_IMAGE_STAND_IN = "registry.invalid/built-worker-image:pending"
_REDIS_STAND_IN = "rediss://gcs-redis.invalid:6379"


def _swap(node: Any, old: str, new: Any) -> Any:
    """`node` with every string equal to `old` replaced by `new` (an Output is fine)."""
    if isinstance(node, dict):
        return {k: _swap(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_swap(v, old, new) for v in node]
    return new if node == old else node


def _exposure(exposure: ServiceExposure, allowed_cidrs: list[str]) -> dict:
    """The serve Service's type, NLB annotations and source ranges for the stack's exposure."""
    if exposure is not ServiceExposure.INTERNAL_NLB:
        return {"service_type": "ClusterIP"}
    return {
        "service_type": "LoadBalancer",
        "service_annotations": {
            "service.beta.kubernetes.io/aws-load-balancer-type": "nlb",
            "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
        },
        "load_balancer_source_ranges": list(allowed_cidrs),
    }


def model_key_prefix(source: str, bucket: str | None) -> str | None:
    """The key prefix of an s3:// model source in `bucket` ("" for the whole bucket); None otherwise."""
    if not bucket or not source.startswith(f"s3://{bucket}"):
        return None
    return source[len(f"s3://{bucket}") :].strip("/")


def read_prefixes(serving: ServingSpec, bucket: str | None) -> list[str] | None:
    """The key prefixes the pods may read in the model bucket: each model's weights (an s3://
    source there) and each model's LoRA adapters; None when none is in the bucket (a Hugging
    Face model with a modelBucket keeps the whole-bucket read it always had). "" is the whole
    bucket, which then covers everything."""
    found: list[str] = []
    for m in serving.served:
        weights = model_key_prefix(m.model.source, bucket)
        if weights is not None:
            found.append(weights)
        if m.lora is not None and bucket and m.lora.bucket == bucket:
            found.append(m.lora.prefix)
    if not found:
        return None
    if "" in found:
        return [""]
    return list(dict.fromkeys(found))


def _read_policy(code_bucket_arn: str, model_bucket: str | None, prefixes: list[str] | None = None) -> dict:
    """Read the serving code, and the models' and adapters' files under their prefixes only (the
    Run:ai streamer, Ray's mirror download and its LoRA download list a prefix, then get its objects)."""
    statements = [
        {
            "Sid": "ServingCode",
            "Effect": "Allow",
            "Action": ["s3:GetObject"],
            "Resource": [f"{code_bucket_arn}/serving/*"],
        },
    ]
    if model_bucket:
        listing: dict = {
            "Sid": "ModelList",
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{model_bucket}"],
        }
        objects = [f"arn:aws:s3:::{model_bucket}/*"]
        scoped = [p for p in prefixes or [] if p]
        if scoped and "" not in (prefixes or []):
            listing["Condition"] = {"StringLike": {"s3:prefix": [x for p in scoped for x in (p, f"{p}/*")]}}
            objects = [f"arn:aws:s3:::{model_bucket}/{p}/*" for p in scoped]
        statements += [
            listing,
            {"Sid": "ModelRead", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": objects},
        ]
    return {"Version": "2012-10-17", "Statement": statements}
