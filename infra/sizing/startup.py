"""Time to serve: how long one engine replica takes from a Pending pod to serving, per role.

What flows through here: a role's node pool (instance type from the catalog, local storage),
the model (its checkpoint size from the fit's shape, its source: a Hugging Face repo id or an
`s3://` mirror), whether the stack's VPC routes S3 through a gateway endpoint, and the GPU
share of the weights -> `time_to_serve()`, one `TimeToServe` per role:

    new node  = node provisioning + image pull + weights download + weights load + engine start
    warm node = weights download + weights load + engine start     (node up, image cached)

- image pull   = image GB / pull rate (a plain containerd pull: download, then unpack);
- download     = the whole checkpoint, on every node of the replica (Ray Serve LLM's
                 `initialize_node` runs `download_model_files` on each node of the placement
                 group; a repo id is fetched by vLLM into the node's Hugging Face cache), at
                 the slowest of: the source, the path (NAT gateway or not), the instance's line
                 rate and the local disk it lands on (NVMe RAID0, or the gp3 root volume);
- load         = the weights of one GPU from local disk to its memory (ranks load in parallel);
- engine start = vLLM's engine initialisation after the weights: torch.compile, memory
                 profiling, KV-cache allocation, CUDA graph capture and warm-up.
A pod's container gets a fresh writable layer, so downloaded weights do not survive the pod:
a replaced replica on a warm node downloads them again.

Every constant below is a published or measured figure with its source; where none exists
for these instance types the constant says so, and how to measure it. Pure arithmetic: no
Pulumi, Ray or vLLM import, nothing downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra import catalog

GIB = 1024**3

# --- measured start-up figures --------------------------------------------------------------
# anyscale/ray-serve-llm-perf-examples, replica_initialization/ (commit 04ba8ab4), Ray Serve
# LLM + vLLM on p5.48xlarge, Meta-Llama-3-70B bf16 (131.4 GiB) at TP 4, logs in
# experiment_terminal_output/:
# - llama70b-base.txt: "Time spent downloading weights for meta-llama/Meta-Llama-3-70B:
#   196.465363 seconds" (Hugging Face Hub -> the node, 131.4 GiB): 0.67 GiB/s;
HF_HUB_GIBPS = 131.4 / 196.465
# - llama70b-s3-runai.txt: "[RunAI Streamer] Overall time to stream 131.4 GiB of all files:
#   91.06s, 1.4 GiB/s" (`load_format: runai_streamer`, the replica's checkpoint from S3 in the
#   same region straight into GPU memory: no copy on the node's disk, no load from it). This is
#   the streamer's rate (STREAMER_GIBPS), what the render uses for s3:// sources
#   (serving/spec/scaling.py). Ray's own S3 mirror download (ray.llm CloudModelDownloader, boto3
#   in a thread pool) is taken to read at this rate too: no published figure of its own;
S3_GIBPS = 131.4 / 91.06
STREAMER_GIBPS = S3_GIBPS
# - llama70b-s3-runai-sharded.txt: "Overall time to stream 32.9 GiB of all files: 24.98s" per
#   rank (`runai_streamer_sharded`, a checkpoint re-saved per rank by vLLM's save_sharded_state):
#   faster still, but it needs that re-saved checkpoint; the render does not use it.
# - llama70b-base.txt: "Loading weights took 15.82 seconds" for "Model loading took 32.8601
#   GiB" per rank (local disk -> GPU, the 4 ranks in parallel);
LOAD_GIBPS_PER_GPU = 32.8601 / 15.82
# - llama70b-base.txt: "init engine (profile, create kv cache, warmup model) took 91.82
#   seconds", of which "torch.compile takes 60.79 s in total" and "Graph capturing finished
#   in 16 secs". Measured for a dense 70B at TP 4 (vLLM V1); the MoE Qwen3-235B at TP 8 took
#   170.53 s (qwen235B-base.txt), and 44.59 s with a warm torch.compile cache
#   (llama70B-compile-cache.txt). Ray worker start and the vLLM import come on top (seconds).
ENGINE_START_S = 91.82

# --- container image ------------------------------------------------------------------------
# AWS Machine Learning Blog, "Reducing container cold start times using SOCI index on DLAMI
# and DLC" (2026-06-03): "Standard Docker image pulls of 15-20 GB can take 4-6 minutes per
# instance". The ray-llm image (CUDA, PyTorch, vLLM, Ray, NIXL) is of that class; its own size
# was not looked up (no registry access offline): `docker buildx imagetools inspect --raw
# rayproject/ray-llm:<tag>` and the sum of its layers' sizes replaces IMAGE_GB. Taken: 15 GB
# pulled in 4 minutes.
IMAGE_GB = 15.0
IMAGE_PULL_GBPS = 15.0 / 240  # decimal GB per second

# --- the path and the disk ------------------------------------------------------------------
# Amazon VPC User Guide, "NAT gateway basics": "A NAT gateway supports 5 Gbps of bandwidth and
# automatically scales up to 100 Gbps." The planner takes the 5 Gbps it starts from.
NAT_GBPS = 5.0
# Amazon EBS User Guide, "General Purpose SSD volumes": gp3 delivers a baseline of 3,000 IOPS
# and 125 MiB/s; the pools' root volumes are gp3 without provisioned throughput.
GP3_BASELINE_GIBPS = 125 / 1024
# The instance-store NVMe drives in RAID0 (localStorage: raid0): no published per-drive rate
# for these types, taken as faster than every source above (so they never bound the download).

# --- node provisioning ----------------------------------------------------------------------
# EC2 launch, boot, EKS join, the NVIDIA and EFA device plugins advertising their resources.
# No published figure for GPU instances: AWS ParallelCluster's baseline for a new compute node
# is about 5 minutes from request to start (aws/aws-parallelcluster#4236, the maintainers'
# reply), and EKS's own measurements (awslabs/amazon-eks-ami#1099) note that GPU types boot
# "much longer" than the ~40 s of a c5. Taken: 5 minutes; measure yours as the node's
# creationTimestamp minus the Pending pod's, plus the node's Ready time.
NODE_PROVISION_S = 300.0


class Source:
    HF_HUB = "Hugging Face Hub via NAT"
    S3_ENDPOINT = "S3 via gateway endpoint"
    S3_NAT = "S3 via NAT"


@dataclass(frozen=True)
class TimeToServe:
    """One replica of one role, in seconds; weights figures are None when the shape is unknown."""

    role: str
    node_s: float
    image_s: float
    source: str  # Source.*
    disk: str  # where the weights land: "NVMe RAID0" or "gp3 root volume"
    checkpoint_gib: float | None
    download_gibps: float  # the slowest of source, path, line rate and disk
    bound_by: str  # which of them
    download_s: float | None
    load_s: float | None
    engine_s: float
    streamer_s: float | None = None  # weights with the Run:ai streamer, S3 sources only
    streamed: bool = False  # the render streams the weights (s3:// source, loading.weights auto/streamer)

    @property
    def copied_s(self) -> float | None:
        """Weights by download to the node's disk, then load to the GPUs."""
        return None if self.download_s is None or self.load_s is None else self.download_s + self.load_s

    @property
    def weights_s(self) -> float | None:
        return self.streamer_s if self.streamed else self.copied_s

    @property
    def streamer_faster(self) -> bool | None:
        """Whether streaming beats download + load here (None: shape or source unknown)."""
        if self.streamer_s is None or self.copied_s is None:
            return None
        return self.streamer_s < self.copied_s

    @property
    def warm_node_s(self) -> float | None:
        """A pod on a running node whose image is cached: weights and engine only."""
        return None if self.weights_s is None else self.weights_s + self.engine_s

    @property
    def new_node_s(self) -> float | None:
        return None if self.warm_node_s is None else self.node_s + self.image_s + self.warm_node_s


def source_kind(model_source: str, s3_gateway_endpoint: bool) -> str:
    if model_source.startswith("s3://"):
        return Source.S3_ENDPOINT if s3_gateway_endpoint else Source.S3_NAT
    return Source.HF_HUB  # a repo id: fetched from the Hub, over the internet, through NAT


def _limits(source: str, inst: catalog.InstanceType) -> dict[str, float]:
    limits = {
        "the source": HF_HUB_GIBPS if source == Source.HF_HUB else S3_GIBPS,
        f"{inst.name} line rate": inst.network_gbps * 1e9 / 8 / GIB,
    }
    if source in (Source.HF_HUB, Source.S3_NAT):
        limits["the NAT gateway"] = NAT_GBPS * 1e9 / 8 / GIB
    return limits


def download_rate(source: str, inst: catalog.InstanceType, raid0: bool) -> tuple[float, str]:
    """GiB/s of the checkpoint download to one node, and what bounds it."""
    limits = _limits(source, inst)
    if not raid0:
        limits["the gp3 root volume"] = GP3_BASELINE_GIBPS
    bound = min(limits, key=lambda k: limits[k])
    return limits[bound], bound


def time_to_serve(
    role: str,
    inst: catalog.InstanceType,
    *,
    raid0: bool,
    model_source: str,
    s3_gateway_endpoint: bool,
    checkpoint_gib: float | None,
    weights_gib_per_gpu: float | None,
    streamed: bool = False,
) -> TimeToServe:
    """raid0: the pool stripes its NVMe drives (localStorage raid0 on a type that has them).
    streamed: the engines stream the weights (Run:ai streamer); S3 sources only."""
    source = source_kind(model_source, s3_gateway_endpoint)
    rate, bound = download_rate(source, inst, raid0)
    download = None if checkpoint_gib is None else checkpoint_gib / rate
    load = None if weights_gib_per_gpu is None else weights_gib_per_gpu / LOAD_GIBPS_PER_GPU
    streamer = None
    if checkpoint_gib is not None and source != Source.HF_HUB:
        # The same path as a download (S3 endpoint or NAT, the line rate), but no disk.
        path = {k: v for k, v in _limits(source, inst).items() if k != "the source"}
        streamer = checkpoint_gib / min([STREAMER_GIBPS, *path.values()])
    return TimeToServe(
        role=role,
        node_s=NODE_PROVISION_S,
        image_s=IMAGE_GB / IMAGE_PULL_GBPS,
        source=source,
        disk="NVMe RAID0" if raid0 else "gp3 root volume",
        checkpoint_gib=checkpoint_gib,
        download_gibps=rate,
        bound_by=bound,
        download_s=download,
        load_s=load,
        engine_s=ENGINE_START_S,
        streamer_s=streamer,
        streamed=streamed and streamer is not None,
    )
