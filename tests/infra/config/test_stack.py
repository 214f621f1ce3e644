"""The stack config loader: defaults in one place, one clear line per mistake.

What flows through here: hand-made config values -> `infra.config.load` -> a StackConfig, or
a ConfigError whose text is asserted whole. (The table of hostile stack files, run through
both `pulumi up` and `make render`, is in test_hostile_configs.py.)
"""

from __future__ import annotations

import copy

import pytest

from infra import catalog, config, versions
from tools import stackfile

SOURCE = "stacks/Pulumi.prod.yaml"


@pytest.fixture
def prod():
    values, secrets, _ = stackfile.read_as_deployed("prod")
    return values, secrets


def _load(values, secrets):
    return config.load(values, secret_keys=secrets, source=SOURCE)


def _error(values, secrets) -> str:
    with pytest.raises(config.ConfigError) as e:
        _load(values, secrets)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_minimal_stack_gets_documented_defaults():
    cfg = config.load(
        {
            "environment": "dev",
            "amiReleaseVersion": versions.AMI_RELEASE_VERSION,
            "availabilityZones": ["us-east-2a", "us-east-2b"],
            "nodePools": {"prefill": {"instanceType": "g5.xlarge"}, "decode": {"instanceType": "g5.xlarge"}},
            "serving": {"model": {"id": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}},
            "apiKeys": "k",
        },
        secret_keys={"apiKeys"},
        source="stacks/Pulumi.x.yaml",
    )
    assert cfg.kubernetes_version == versions.DEFAULT_KUBERNETES_VERSION
    assert tuple(int(p) for p in cfg.kubernetes_version.split(".")) >= (1, 28)
    assert cfg.endpoint_access is config.EndpointAccess.PRIVATE
    assert cfg.efa_zone_name == "us-east-2a"
    assert cfg.ray_image == versions.RAY_IMAGE
    assert cfg.node_pools.decode.capacity_type is config.CapacityType.ON_DEMAND
    assert cfg.serving.mode.value == "disaggregated"


def test_structured_values_arrive_as_json_text_like_pulumi_sends_them(prod):
    import json

    values, secrets = prod
    as_pulumi = {k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in values.items()}
    assert _load(as_pulumi, secrets) == _load(values, secrets)


def test_issue_example_message(prod):
    values, secrets = prod
    values["nodePools"]["decode"]["instanceType"] = "p5.48xl"
    assert _error(values, secrets) == (
        "stacks/Pulumi.prod.yaml: nodePools.decode.instanceType: 'p5.48xl' is not a supported GPU instance type "
        "(supported: p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5e.48xlarge, p5en.48xlarge, g5.xlarge, g5.12xlarge, g6e.xlarge)"
    )


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda v: v.update(kubernetesVersion="1.27"),
            "kubernetesVersion: '1.27' is not a supported Kubernetes version",
        ),
        (lambda v: v.update(nodPools={}), "nodPools: unknown key"),
        (
            lambda v: v["serving"]["decode"].update(pipelineParallelSize=2),
            "serving: decode.pipelineParallelSize = 2 is refused: vLLM cannot receive KV into a pipeline-parallel decode",
        ),
        (
            lambda v: v.update(endpointAccess="public-and-private", publicAccessCidrs=["100.64.0.0/16"]),
            "endpointAccess: prod clusters keep a private API endpoint",
        ),
        (lambda v: v.pop("apiKeys"), "apiKeys: serving.auth is api-key but no apiKeys secret is set"),
        (lambda v: v["nodePools"]["prefill"].update(minSize=3), "nodePools.prefill: sizes must satisfy"),
        (lambda v: v.update(efaZone="us-east-1d"), "efaZone: 'us-east-1d' is not one of availabilityZones"),
        (
            lambda v: v["serving"].update(placement={"labelKey": "ray.io/node-group"}),
            "serving.placement.labelKey: 'ray.io/node-group': the ray.io/ prefix is reserved for Ray's own node labels",
        ),
        (
            lambda v: v["serving"].update(engineKwargs={"trust_remote_code": True}),
            "serving.engineKwargs: trust_remote_code runs Python code from the model repository",
        ),
    ],
)
def test_one_line_names_file_and_key(prod, mutate, expected):
    values, secrets = prod
    values = copy.deepcopy(values)
    mutate(values)
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: {expected}"), msg


def test_secret_in_plain_text_is_refused(prod):
    values, secrets = prod
    assert _error(values, secrets - {"apiKeys"}) == (
        f"{SOURCE}: apiKeys: must be stored as a secret (pulumi config set --secret apiKeys ...)"
    )


def test_secrets_present_cannot_be_faked_through_a_key(prod):
    values, secrets = prod
    values.pop("apiKeys")
    values["secretsPresent"] = ["apiKeys"]
    assert "secretsPresent: unknown key" in _error(values, secrets)


def test_zones_must_belong_to_the_stack_region(prod):
    values, secrets = prod
    assert config.load(values, secret_keys=secrets, source=SOURCE, region="us-east-1")
    with pytest.raises(config.ConfigError) as e:
        config.load(values, secret_keys=secrets, source=SOURCE, region="us-west-2")
    assert str(e.value) == (
        f"{SOURCE}: availabilityZones: ['us-east-1a', 'us-east-1b', 'us-east-1c'] are not all zones of aws:region 'us-west-2'"
    )


# Real instance types, from aws/eks-charts stable/aws-efa-k8s-device-plugin v0.5.30 values.yaml
# (its list of EFA-capable EC2 types): every shape the format must accept.
REAL_TYPES = [
    "c5n.18xlarge",
    "c7a.metal-48xl",
    "g6e.12xlarge",
    "hpc7g.4xlarge",
    "i7ie.metal-48xl",
    "m8idn.96xlarge",
    "p5.4xlarge",
    "p6-b200.48xlarge",
    "p6e-gb200.36xlarge",
    "r7iz.metal-32xl",
    "trn2u-ac.24xlarge",
    "u7in-32tb.224xlarge",
    "x2iezn.metal",
    "dl2q.24xlarge",
    "m7i.xlarge",
    "t3.micro",
    "m5.large",
]


@pytest.mark.parametrize("good", REAL_TYPES + sorted(catalog.CATALOG))
def test_instance_type_format_accepts_real_types(good):
    assert config.instance_type_format(good) == good


@pytest.mark.parametrize("bad", ["p5.48xl", "m7i.huge", "m7i", "M7i.large", "7i.large", "m7i.2xlarge ", "m7i..large"])
def test_malformed_system_instance_type_is_one_line(prod, bad):
    values, secrets = prod
    values["systemNodes"]["instanceType"] = bad
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: systemNodes.instanceType: ") and "is not an EC2 instance type" in msg


EXISTING_VPC = {
    "vpcId": "vpc-0123456789abcdef0",
    "privateSubnetIds": ["subnet-0aaa0000000000001", "subnet-0bbb0000000000002", "subnet-0ccc0000000000003"],
    "publicSubnetIds": [],
    "efaSubnetId": "subnet-0aaa0000000000001",
}
EXTERNAL_REDIS = "rediss://master.pd-inference-prod.abc123.use1.cache.amazonaws.com:6379"


@pytest.fixture
def external(prod):
    """prod on an external Redis: in an existing VPC (the Redis's), with its AUTH secret."""
    values, secrets = prod
    values.pop("vpcCidr", None)
    values.update(
        gcsFaultTolerance="external-redis",
        gcsRedisAddress=EXTERNAL_REDIS,
        gcsRedisPassword="pw",
        existingVpc=copy.deepcopy(EXISTING_VPC),
    )
    return values, {*secrets, "gcsRedisPassword"}


def test_the_shipped_prod_stack_keeps_its_gcs_in_a_redis_it_creates(prod):
    cfg = _load(*prod)
    assert cfg.gcs_fault_tolerance is config.GcsFaultTolerance.MANAGED and cfg.gcs_redis.failover


def test_gcs_redis_address_accepts_tls_scheme(external):
    assert _load(*external).gcs_redis_address.startswith("rediss://")


def test_an_external_gcs_redis_outside_the_vpc_the_stack_creates_is_refused(external):
    """prod as it was shipped: a new VPC (vpcCidr) and an external ElastiCache endpoint. Nothing
    peers the two; `pulumi up` would succeed and the head's GCS crash-loop."""
    values, secrets = external
    values.pop("existingVpc")
    values["vpcCidr"] = "10.40.0.0/16"
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: gcsFaultTolerance, vpcCidr: external-redis reaches {EXTERNAL_REDIS}, outside"), (
        msg
    )
    assert "existingVpc" in msg and "gcsFaultTolerance managed" in msg


def _managed(prod):
    """prod on gcsFaultTolerance managed (as shipped): no address, no password of its own."""
    values, secrets = prod
    values.pop("gcsRedisAddress", None)
    values.pop("gcsRedisPassword", None)
    values["gcsFaultTolerance"] = "managed"
    return values, {s for s in secrets if s != "gcsRedisPassword"}


def test_managed_gcs_redis_validates_with_its_defaults(prod):
    """`managed` builds the ElastiCache group (infra/components/gcs_redis.py): one place for its defaults."""
    cfg = _load(*_managed(prod))
    assert cfg.gcs_fault_tolerance is config.GcsFaultTolerance.MANAGED
    assert cfg.gcs_redis.node_type == "cache.m7g.large" and cfg.gcs_redis.replicas == 1
    assert cfg.gcs_redis.nodes == 2 and cfg.gcs_redis.failover


def test_managed_gcs_redis_takes_its_size_from_gcs_redis(prod):
    values, secrets = _managed(prod)
    values["gcsRedis"] = '{"nodeType": "cache.r7g.xlarge", "replicas": 2}'  # as Pulumi hands it over
    cfg = _load(values, secrets)
    assert (cfg.gcs_redis.node_type, cfg.gcs_redis.nodes) == ("cache.r7g.xlarge", 3)


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ({"gcsRedisPassword": "pw"}, "gcsRedisPassword", "managed generates its own AUTH token"),
        ({"gcsRedisAddress": "rediss://x.cache.amazonaws.com:6379"}, "gcsRedisAddress", "only used with"),
        ({"gcsRedis": {"replicas": 0}}, "gcsRedis.replicas", "no failover"),
        ({"gcsRedis": {"replicas": 6}}, "gcsRedis.replicas", "less than or equal to 5"),
        ({"gcsRedis": {"nodeType": "m7g.large"}}, "gcsRedis.nodeType", "not an ElastiCache node type"),
        ({"gcsRedis": {"nodeType": "cache.m7g.large", "shards": 2}}, "gcsRedis.shards", "unknown key"),
    ],
)
def test_managed_gcs_redis_mistakes_are_one_line(prod, change, key, words):
    values, secrets = _managed(prod)
    values.update(change)
    if "gcsRedisPassword" in change:
        secrets = {*secrets, "gcsRedisPassword"}
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: {key}: ") and words in msg, msg


def test_gcs_redis_only_with_managed(external):
    values, secrets = external
    values["gcsRedis"] = {"replicas": 2}
    assert "gcsRedis: only used with gcsFaultTolerance managed (not external-redis)" in _error(values, secrets)


def test_a_single_node_group_is_fine_outside_prod(prod):
    values, secrets = _managed(prod)
    values["environment"] = "staging"
    values["gcsRedis"] = {"replicas": 0}
    assert not _load(values, secrets).gcs_redis.failover


# --- gcsFaultTolerance external-redis: TLS and AUTH, in every environment ----------------------
# Ray 2.60 python/ray/_private/services.py (`get_address`: only a `rediss://` address turns
# TLS on; host:port and redis:// connect in plaintext) and KubeRay v1.7.0
# ray-operator/controllers/ray/common/pod.go (REDIS_PASSWORD comes only from
# gcsFaultToleranceOptions.redisPassword: without it the GCS connects without AUTH). The GCS
# keeps the cluster's control state there.
@pytest.mark.parametrize("environment", ["prod", "staging", "dev"])
@pytest.mark.parametrize(
    "address", ["pd.abc123.use1.cache.amazonaws.com:6379", "redis://pd.abc123.use1.cache.amazonaws.com:6379"]
)
def test_an_external_gcs_redis_in_plaintext_is_refused(external, environment, address):
    values, secrets = external
    values["environment"] = environment
    values["gcsRedisAddress"] = address
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: gcsRedisAddress: {address!r} is a plaintext Redis"), msg
    assert "rediss://host:port" in msg


@pytest.mark.parametrize("environment", ["prod", "dev"])
def test_an_external_gcs_redis_needs_its_auth_secret(external, environment):
    values, secrets = external
    assert values["gcsRedisAddress"].startswith("rediss://")
    values["environment"] = environment
    values.pop("gcsRedisPassword", None)
    assert _error(values, secrets - {"gcsRedisPassword"}) == (
        f"{SOURCE}: gcsRedisPassword: gcsFaultTolerance is external-redis but no gcsRedisPassword secret is set "
        "(pulumi config set --secret gcsRedisPassword <the Redis AUTH token>)"
    )


def test_an_external_gcs_redis_over_tls_with_auth_loads(external):
    cfg = _load(*external)
    assert cfg.gcs_fault_tolerance is config.GcsFaultTolerance.EXTERNAL_REDIS
    assert cfg.gcs_redis_address.startswith("rediss://")
