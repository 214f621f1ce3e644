"""The Ray pods' environment: the variables the RayService's containers carry, and why.

What flows through here: the pools' catalog entries, the serving spec, the stack's region and
GCS Redis address -> environment variables (as names and values, or as Kubernetes `env`
entries) that `infra.k8s.rayservice` puts into the head's and the workers' containers:
libfabric and NCCL over EFA for the engines (`efa_engine_env`, `NCCL_EFA_ENV`; the NCCL and
EFA checks reuse them), the CA bundle Ray needs for a TLS GCS, the region under every name the
AWS SDKs read, Prometheus's address for the autoscaling policies, the data plane's Ray switches
and the node drain on SIGTERM. Plain data: no Pulumi here.
"""

from __future__ import annotations

from infra import catalog
from serving.spec import LOG_MONITOR, ServingSpec
from serving.spec.drain import NODE_DRAIN_ENV

# libfabric over EFA for NIXL's LIBFABRIC backend (and NCCL's aws-ofi-nccl). Each entry
# says where it comes from.
EFA_ENV = {
    # Only the EFA provider (ai-dynamo/dynamo tests/deploy/efa/disagg-efa.yaml).
    "FI_PROVIDER": "efa",
    # Python workers fork (Ray, vLLM); libfabric's EFA provider must know (libfabric fi_efa(7)).
    "FI_EFA_FORK_SAFE": "1",
    # No shared-memory transfers inside libfabric: prefill and decode never share a node here
    # (each role has its own node group, and EFA has no loopback between them, dynamo#7764),
    # and libfabric's shm path needs cross-process memory access (CMA/ptrace) that the
    # non-root, capability-free Ray containers lack (dynamo's EFA deploy test sets the same).
    "FI_EFA_ENABLE_SHM_TRANSFER": "0",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}
# GPUDirect RDMA reads, only on the types whose EFA supports them (catalog `efa_rdma`).
EFA_RDMA_ENV = {"FI_EFA_USE_DEVICE_RDMA": "1"}


def efa_engine_env(instances: list[catalog.InstanceType]) -> dict[str, str]:
    """The engines' libfabric environment for these pools (empty when none has EFA).

    The NIXL side channel is set per pod (`VLLM_NIXL_SIDE_CHANNEL_HOST`, the pod IP) and per
    replica (`VLLM_NIXL_SIDE_CHANNEL_PORT`, which Ray Serve LLM's NIXL backend assigns).
    """
    efa = [i for i in instances if i.efa]
    if not efa:
        return {}
    env = dict(EFA_ENV)
    if all(i.efa_rdma for i in efa):
        env.update(EFA_RDMA_ENV)
    return env


# NCCL between the nodes of one engine replica (TP x PP across nodes, the DP + EP all-to-all)
# goes over EFA through aws-ofi-nccl. The image carries it as libnccl-net-ofi.so
# (aws/aws-ofi-nccl src/Makefile.am builds that name; the libnccl-net.so link NCCL would load
# by default exists only with --enable-nccl-net-symlink), and NCCL loads
# libnccl-net-${NCCL_NET_PLUGIN}.so (NCCL user guide, Environment Variables, NCCL_NET_PLUGIN).
# Without it NCCL falls back to TCP sockets without an error. NCCL needs no FI_* setting with
# libfabric >= 1.18 and aws-ofi-nccl >= 1.7 (aws-ofi-nccl doc/efa-env-var.md); the FI_* above
# are NIXL's and harmless to NCCL. NCCL_SOCKET_IFNAME above only picks the bootstrap interface.
NCCL_EFA_ENV = {"NCCL_NET_PLUGIN": "ofi"}

# GCS over TLS (`rediss://`): Ray's C++ Redis client verifies the server against the CA file
# named by RAY_REDIS_CA_CERT and passes none when it is unset (ray src/ray/common/
# ray_config_def.h REDIS_CA_CERT, Ray 2.60), so ElastiCache's certificate fails with
# CERTIFICATE_VERIFY_FAILED (ray#41161, fixed there by naming the system bundle). The ray-llm
# images are Ubuntu: the bundle is at Debian's path. KubeRay's Redis cleanup Job is built from
# the head pod (kuberay v1.7.0 raycluster_controller.go buildRedisCleanupJob), so it inherits it.
REDIS_CA_CERT_ENV = "RAY_REDIS_CA_CERT"
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

# The stack's region, for every AWS SDK in the Ray pods: the nodes' instance metadata is out of
# a pod's reach (hop limit 1, infra/components/launch_templates.py), so an SDK that looked the
# region up there would wait for IMDS and fail. AWS_REGION is the variable of the AWS SDKs
# (Go, Java, JavaScript, C++: the Run:ai streamer's S3 client); botocore, which Ray's S3
# working_dir download and the streamer's listing use, reads AWS_DEFAULT_REGION only
# (botocore/configprovider.py, `region`).
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


def gcs_uses_tls(address: str | None) -> bool:
    """Whether Ray talks TLS to this GCS Redis address (Ray needs the `rediss://` form)."""
    return bool(address) and str(address).startswith("rediss://")


def data_plane_env(serving: ServingSpec) -> list[dict[str, str]]:
    """The data plane's Ray switches (serving.ingress.dataPlane: `ServingSpec.ray_env`, the one
    place that names them, with HAProxy's hard stop after a reload), for every Ray pod's
    container. Ray 2.60 reads them once, at import, in every Ray process
    (ray/serve/_private/constants.py, end of the module: the throughput block and the HAProxy
    block), never from the Serve config: the controller on the head, the HAProxy managers or
    proxies on every proxy node, and the replicas that open direct-ingress and gRPC servers
    must all agree, so every container carries the same values."""
    return [{"name": k, "value": v} for k, v in serving.ray_env().items()]


def region_env(region: str | None) -> list[dict[str, str]]:
    """The stack's region under every name the pods' AWS SDKs read (REGION_ENV)."""
    return [{"name": var, "value": region} for var in REGION_ENV] if region else []


def node_drain_env(serving: ServingSpec) -> dict[str, str]:
    """How long Ray drains a pod's node on SIGTERM (old cluster deleted, pod evicted, node
    drained) before it kills the node's processes: long enough for the node's Serve replicas and
    proxy to finish every stream (serving/spec/drain.py). The pod's terminationGracePeriodSeconds
    adds the teardown on top."""
    return {"name": NODE_DRAIN_ENV, "value": str(serving.drain().node_drain_s)}


# Ray's Prometheus address variable (ray/serve/autoscaling_policy.py PrometheusQueryMixin, and
# Ray's dashboard), Ray 2.60.
PROMETHEUS_HOST_ENV = "RAY_PROMETHEUS_HOST"


def ray_start_params() -> dict[str, str]:
    """The `ray start` flags every Ray pod shares: the node's log monitor as
    serving.spec.base.LOG_MONITOR says, off. KubeRay passes include-log-monitor=false through
    from v1.7.0 on (pod.go convertParamMap, kuberay#4857); earlier releases dropped a "false"."""
    return {"include-log-monitor": "true" if LOG_MONITOR else "false"}
