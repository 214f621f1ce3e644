"""The instance catalog: the one place that knows what each GPU instance type carries.

What flows through here: a node pool's `instanceType` (from the stack file) is looked up
here, and the answer feeds the node group (EFA on or off, instance-store RAID), the device
requests of the Ray worker pods (`nvidia.com/gpu`, `vpc.amazonaws.com/efa`), their CPU,
memory and /dev/shm sizes, the Ray accelerator type of the engines, the capacity planner and
the cost shown by `make render`.

Figures are AWS's published specifications. Prices are indicative on-demand list prices
(us-east-1, USD per hour, after AWS's June 2025 P4/P5 price cut) for cost estimates only.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.spec import KvBackend


def pod_cpus(node_vcpus: int) -> int:
    """CPUs one pod that owns a node may ask for: the rest is head-room for the kubelet, the
    device plugins, the CNI and other DaemonSets (GPU workers and the Ray head alike)."""
    return node_vcpus - max(2, node_vcpus // 16)


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpu_model: str  # marketing name, e.g. "H100 80GB HBM3"
    ray_accelerator: str  # Ray's accelerator type (ray.util.accelerators)
    gpus: int
    gpu_memory_mib: int  # per GPU, as nvidia-smi reports it
    hbm_gbps: int  # per-GPU memory bandwidth, GB/s
    vcpus: int
    memory_gib: int
    efa_interfaces: int  # 0: no EFA
    network_gbps: int  # EFA bandwidth where EFA, else ENA bandwidth
    nvme_disks: int  # instance-store NVMe drives
    nvme_gib_each: int
    max_pods: int  # EKS AL2023 max pods with the VPC CNI defaults
    usd_per_hour: float
    # EFA with RDMA read (GPUDirect RDMA): p4d/p4de and p5-class. libfabric uses it only when
    # FI_EFA_USE_DEVICE_RDMA=1 (AWS EFA docs, "Supported instance types"; aws-ofi-nccl).
    efa_rdma: bool = False

    @property
    def efa(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def nixl_backend(self) -> KvBackend:
        """The NIXL backend that carries the KV cache between nodes of this type.

        EFA: LIBFABRIC. NIXL's UCX backend gets no RDMA on EFA and silently falls back to
        TCP (ai-dynamo/nixl#909, ai-dynamo/dynamo#4185), which is vLLM's default
        (`backends=["UCX"]`, vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py).
        Everything else (ENA-only types, the local CPU run): UCX.
        """
        return KvBackend.LIBFABRIC if self.efa else KvBackend.UCX

    @property
    def gpu_share_gbps(self) -> float:
        """One GPU's share of the node's line rate: what one TP rank's KV transfer gets."""
        return self.network_gbps / self.gpus

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_mib / 1024

    @property
    def nvme_gib(self) -> int:
        return self.nvme_disks * self.nvme_gib_each

    # Sizes of the one Ray worker pod that owns the node. Head-room is left for the
    # kubelet, the device plugins, the CNI and other DaemonSets.
    @property
    def pod_cpus(self) -> int:
        return pod_cpus(self.vcpus)

    @property
    def pod_memory_gib(self) -> int:
        return int(self.memory_gib * 0.85)

    @property
    def shm_gib(self) -> int:
        # NCCL and vLLM use /dev/shm; it is RAM, and counts against the pod's memory limit.
        return max(1, min(256, self.memory_gib // 8))


_TYPES = [
    InstanceType(
        "p4d.24xlarge", "A100 40GB", "A100", 8, 40960, 1555, 96, 1152, 4, 400, 8, 1000, 737, 21.96, efa_rdma=True
    ),
    InstanceType(
        "p4de.24xlarge", "A100 80GB", "A100", 8, 81920, 2039, 96, 1152, 4, 400, 8, 1000, 737, 27.45, efa_rdma=True
    ),
    InstanceType(
        "p5.48xlarge", "H100 80GB HBM3", "H100", 8, 81559, 3350, 192, 2048, 32, 3200, 8, 3576, 100, 55.04, efa_rdma=True
    ),
    InstanceType(
        "p5e.48xlarge",
        "H200 141GB HBM3e",
        "H200",
        8,
        143771,
        4800,
        192,
        2048,
        32,
        3200,
        8,
        3576,
        100,
        63.30,
        efa_rdma=True,
    ),
    InstanceType(
        "p5en.48xlarge",
        "H200 141GB HBM3e",
        "H200",
        8,
        143771,
        4800,
        192,
        2048,
        16,
        3200,
        8,
        3576,
        198,
        63.30,
        efa_rdma=True,
    ),
    # Small, non-EFA types for cheap dev stacks.
    InstanceType("g5.xlarge", "A10G 24GB", "A10G", 1, 23028, 600, 4, 16, 0, 10, 1, 232, 58, 1.006),
    InstanceType("g5.12xlarge", "A10G 24GB", "A10G", 4, 23028, 600, 48, 192, 0, 40, 1, 3539, 234, 5.672),
    InstanceType("g6e.xlarge", "L40S 48GB", "L40S", 1, 46068, 864, 4, 32, 0, 20, 1, 232, 58, 1.861),
]

CATALOG: dict[str, InstanceType] = {t.name: t for t in _TYPES}


def lookup(name: str) -> InstanceType:
    """The catalog entry for `name`; KeyError names the supported types."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a supported GPU instance type (supported: {', '.join(CATALOG)})") from None


# Dense (no sparsity) BF16/FP16 tensor-core peak per GPU, TFLOPS, by Ray accelerator type:
# NVIDIA's A100, H100 SXM and H200 SXM datasheets, the L40S datasheet; the A10G (g5) figure is
# the A10 datasheet's (AWS publishes none for the A10G). Used for the prefill roofline.
DENSE_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "A10G": 125.0, "L40S": 362.0}
