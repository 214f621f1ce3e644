"""Does the model fit its node pools, and how fast can it go there? (The planner's arithmetic.)

What flows through here: a stack's `serving:` block (a `ServingSpec`) and the catalog entry
of each engine role's node pool come in; out go, per role, the memory split of one GPU
(weights, headroom, KV cache), the KV cache a replica holds, the time to ship one prompt's KV
between nodes and a decode roofline (`model_figures()`). `fit_errors()` gives the
configurations that cannot start as (config key, message) pairs; `StackConfig._cross`
appends them to its errors, so a model that does not fit fails validation before `pulumi up`.
`infra.plan.planning` adds the pools, replicas and prices of a whole stack on top.

Pure arithmetic on published figures: no Pulumi, Ray or vLLM import, nothing downloaded.
The model's shape comes from `serving.model.architecture` when the stack file gives one,
else from the built-in catalog (`infra.sizing.shapes`), matched on the last path component of
`serving.model.source`. A model in neither is reported as unknown and not checked: the
planner never guesses a shape from a name.

The memory model, per GPU, mirrors how vLLM sizes its KV cache at start-up:

    usable        = GPU memory x gpuMemoryUtilization
    weights       = parameters x bytes per element / (TP x PP)
    KV cache      = usable - weights - HEADROOM_GIB
    KV per token  = 2 (K and V) x layers per stage x KV heads per GPU x head dim x bytes
                    (layers per stage = ceil(layers / PP); KV heads per GPU = KV heads / TP,
                    but at least 1: vLLM replicates KV heads when TP exceeds them)
    KV tokens per replica = KV cache / KV per token (every GPU of a replica holds the same
                    number of tokens, each its own slice of them)

vLLM refuses to start when a replica cannot hold one maxModelLen sequence; `fit_errors()`
reports that, and weights that alone exceed the usable memory, before the pods ever run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from infra.catalog import InstanceType
from infra.sizing import nodes as sizing
from infra.sizing.shapes import BUILTIN_MODELS as BUILTIN_MODELS
from infra.sizing.shapes import ModelShape as ModelShape
from infra.sizing.shapes import match_builtin as match_builtin
from infra.sizing.shapes import model_name as model_name
from infra.sizing.shapes import resolve as resolve
from serving.spec import Dtype, Mode, ModelSpec, MoeParallelism, RoleSpec, ServingSpec

GIB = 1024**3

# Memory per GPU that vLLM's KV cache cannot have, inside the gpuMemoryUtilization budget:
# the activation peak of its profiling forward pass, CUDA graphs, the CUDA context and the
# NCCL/NIXL buffers. vLLM measures the real figure at start-up ("Available KV cache memory"
# in its log); 2 GiB per GPU is a round figure for these models at the default batch limits,
# so a plan within a GiB or so of a limit is a warning, not a promise.
HEADROOM_GIB = 2.0

_BYTES_PER_ELEMENT = {
    Dtype.BFLOAT16: 2,
    Dtype.FLOAT16: 2,
    Dtype.FLOAT32: 4,
    # vLLM's "auto" takes the checkpoint's torch_dtype, which is bfloat16 for every model
    # in the catalog (and fp32 checkpoints are served in fp16).
    Dtype.AUTO: 2,
}


def bytes_per_element(dtype: Dtype) -> int:
    return _BYTES_PER_ELEMENT[dtype]


def _dtype_label(dtype: Dtype) -> str:
    return f"dtype auto ({bytes_per_element(dtype)} B/element)" if dtype is Dtype.AUTO else dtype.value


def _article(word: str) -> str:
    # Letters whose names start with a vowel sound: "an A100", "an H100", "an L40S".
    return "an" if word[:1].upper() in "AEFHILMNORSX" else "a"


@dataclass(frozen=True)
class ModelFigures:
    """What one role's replica does with the model: memory per GPU, KV cache, speed limits."""

    weights_gib_per_gpu: float
    headroom_gib_per_gpu: float
    kv_gib_per_gpu: float  # may be negative: the weights leave nothing
    kv_bytes_per_token: int  # the model's K and V for one token, all layers and KV heads
    kv_bytes_per_token_per_gpu: int  # one GPU's slice (KV heads replicated where TP > KV heads)
    kv_tokens_per_replica: int
    max_length_sequences: int  # maxModelLen sequences the replica's KV cache holds
    prompt_kv_bytes: int  # one maxModelLen prompt's KV, prefill -> decode
    prompt_kv_seconds: float  # at the replica's share of the network line rate
    context_len: int  # the context the decode figures assume
    decode_tokens_per_s_batch1: float
    max_batch: int  # sequences of context_len the KV cache holds (capped by max_num_seqs)
    decode_tokens_per_s_max_batch: float | None  # None when not even one sequence fits
    problems: tuple[tuple[str, str], ...]  # (config key, message): why it cannot start
    # Multi-node layouts (None where the layout has none of it):
    pp_bubble_fraction: float | None = None  # GPU time idle with one batch in the pipeline
    pp_hop_bytes: int | None = None  # activations one maxModelLen prompt sends across stages
    pp_hop_seconds: float | None = None  # ... at the replica's share of the line rate
    ep_nodes: int | None = None  # nodes one expert-parallel group spans
    ep_bytes_per_token: int | None = None  # all-to-all bytes per token that leave a node
    ep_tokens_per_s_per_node: float | None = None  # the line rate's ceiling on that traffic


def expert_fraction_read(tokens: float, experts: int, per_token: int) -> float:
    """Share of the routed experts a decode step touches, routing taken as uniform.

    Each token picks `per_token` of `experts`: an expert is missed by all `tokens` tokens
    with probability (1 - k/E)^tokens.
    """
    if experts == 0 or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - per_token / experts) ** tokens


@dataclass(frozen=True)
class _Split:
    """How one replica holds the model: its layout, weight bytes per GPU, memory left for KV."""

    bpe: int  # bytes per element of the KV cache and activations
    tp: int
    pp: int
    dp: int
    ep: bool  # the routed experts spread over the DP ranks
    rank_gpus: int  # one DP rank (one Serve replica)
    usable_gib: float  # per GPU, at gpuMemoryUtilization
    dense_bytes: float
    expert_bytes: float
    expert_split: int  # GPUs the routed experts are sharded over
    weights_gib: float  # per GPU
    kv_gib: float  # per GPU; may be negative


def _split(shape: ModelShape, model: ModelSpec, spec: RoleSpec, inst: InstanceType) -> _Split:
    bpe = bytes_per_element(model.dtype)
    wbpe = shape.weight_bytes_per_param or bpe
    tp, pp, dp = spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.data_parallel_size
    ep = spec.moe_parallelism is MoeParallelism.EXPERT and shape.moe
    rank_gpus = tp * pp  # one DP rank (one Serve replica)
    usable_gib = inst.gpu_memory_gib * model.gpu_memory_utilization

    dense_bytes = shape.dense_parameters_billions * 1e9 * wbpe
    expert_bytes = shape.expert_parameters_billions * 1e9 * wbpe
    expert_split = rank_gpus * (dp if ep else 1)
    # Sharded evenly: TP splits every matrix, PP the layers (vLLM's uneven last stage, with
    # the LM head, is ignored), EP the experts.
    weights_gib = (dense_bytes / rank_gpus + expert_bytes / expert_split) / GIB
    kv_gib = usable_gib - weights_gib - HEADROOM_GIB
    return _Split(
        bpe, tp, pp, dp, ep, rank_gpus, usable_gib, dense_bytes, expert_bytes, expert_split, weights_gib, kv_gib
    )


def _decode_rate(
    shape: ModelShape, s: _Split, inst: InstanceType, ctx: int, kv_per_token_gpu: int
) -> Callable[[int], float]:
    """Decode roofline, output tokens/s of a batch of `ctx`-token sequences.

    Each step reads the weights it needs once and the KV of every sequence in the batch. GPUs
    of a stage read in parallel; stages run one after another (a lower bound for PP > 1), so a
    step takes pp x (bytes per GPU) / HBM bandwidth. A batch of B spreads over the DP ranks;
    the experts touched follow B (EP: every rank's tokens reach every rank's experts) or a
    rank's own B / DP (no EP).
    """
    hbm = inst.hbm_gbps * 1e9

    def tokens_per_s(batch: int) -> float:
        per_rank = batch / s.dp
        touched = expert_fraction_read(batch if s.ep else per_rank, shape.routed_experts, shape.experts_per_token)
        per_gpu = (
            s.dense_bytes / s.rank_gpus + s.expert_bytes * touched / s.expert_split + per_rank * ctx * kv_per_token_gpu
        )
        return batch / (s.pp * per_gpu / hbm)

    return tokens_per_s


def _pipeline_hops(
    shape: ModelShape, s: _Split, max_len: int, link_bytes_per_s: float
) -> tuple[float | None, int | None, float | None]:
    """(bubble fraction, activation bytes, seconds) of one maxModelLen prompt across PP stages.

    vLLM keeps PP batches in flight to fill the pipeline (vllm/config/vllm.py
    max_concurrent_batches); with one batch, PP - 1 of PP stages idle. Each prompt crosses
    PP - 1 stage boundaries as hidden-size activations per token.
    """
    if s.pp <= 1:
        return None, None, None
    hop_bytes = (s.pp - 1) * max_len * shape.hidden_size * s.bpe
    return (s.pp - 1) / s.pp, hop_bytes, hop_bytes / link_bytes_per_s


def _expert_traffic(
    shape: ModelShape, s: _Split, inst: InstanceType, node_bytes_per_s: float
) -> tuple[int | None, int | None, float | None]:
    """(nodes of an EP group, bytes per token leaving a node, tokens/s the line rate allows).

    For vLLM's default all2all backend (allgather_reducescatter, vllm/config/parallel.py): per
    MoE layer each token's hidden state reaches every other node of the EP group (all-gather)
    and its partial sums come back (reduce-scatter). Within one node it stays on NVLink.
    """
    if not s.ep:
        return None, None, None
    ep_nodes = sizing.nodes_per_replica(s.tp * s.dp, inst.gpus)
    if ep_nodes <= 1:
        return ep_nodes, None, None
    ep_bytes = shape.moe_layers * 2 * (ep_nodes - 1) * shape.hidden_size * s.bpe
    return ep_nodes, ep_bytes, node_bytes_per_s / ep_bytes


def _start_problems(
    shape: ModelShape, model: ModelSpec, role: str, spec: RoleSpec, inst: InstanceType, s: _Split, kv_tokens_rank: int
) -> list[tuple[str, str]]:
    """Why the replica cannot start: heads TP does not divide, EP without experts, weights or
    one maxModelLen sequence of KV cache that do not fit the GPU."""
    problems: list[tuple[str, str]] = []
    tp, pp, dp, ep = s.tp, s.pp, s.dp, s.ep
    util, usable_gib, weights_gib, kv_gib = model.gpu_memory_utilization, s.usable_gib, s.weights_gib, s.kv_gib
    max_len = model.max_model_len
    key = f"serving.{role}"
    dtype = _dtype_label(model.dtype)
    gpu = f"{_article(inst.gpu_model)} {inst.gpu_model}"
    layout = f"TP {tp} x PP {pp}" + (f" x DP {dp}" if dp > 1 else "") + (" (EP)" if ep else "")
    if shape.num_attention_heads % tp:
        problems.append(
            (
                f"{key}.tensorParallelSize",
                f"{shape.name} has {shape.num_attention_heads} attention heads, which TP {tp} does not "
                "divide (vLLM refuses to start); pick a tensorParallelSize that divides them",
            )
        )
    if spec.moe_parallelism is MoeParallelism.EXPERT and not shape.moe:
        problems.append(
            (f"{key}.moeParallelism", f"{shape.name} is not a mixture-of-experts model; use moeParallelism: tensor")
        )
    if weights_gib > usable_gib:
        weights_what = f"{shape.name} in {dtype}" if shape.weight_bytes_per_param is None else shape.name
        problems.append(
            (
                f"{key}.tensorParallelSize",
                f"{weights_what} needs {weights_gib:.1f} GiB of weights per GPU at {layout}; "
                f"{gpu} offers {usable_gib:.1f} GiB at gpuMemoryUtilization {util:g} "
                + (
                    "(raise tensorParallelSize or pipelineParallelSize, spread the experts with "
                    "dataParallelSize and moeParallelism: expert, or use a larger GPU)"
                    if shape.moe
                    else "(raise tensorParallelSize or use a larger GPU)"
                ),
            )
        )
    elif kv_tokens_rank < max_len:
        problems.append(
            (
                "serving.model.maxModelLen",
                f"{shape.name} in {dtype} at {layout} on {inst.gpu_model} leaves "
                f"{max(kv_gib, 0):.1f} GiB per GPU for KV cache ({usable_gib:.1f} GiB usable at "
                f"gpuMemoryUtilization {util:g} - {weights_gib:.1f} GiB weights - {HEADROOM_GIB:g} GiB "
                f"headroom): {kv_tokens_rank:,} tokens per {role} {'replica' if dp == 1 else 'DP rank'}, "
                f"less than one maxModelLen "
                f"({max_len:,}) sequence (lower maxModelLen, raise tensorParallelSize or use a larger GPU)",
            )
        )
    return problems


def model_figures(
    shape: ModelShape,
    model: ModelSpec,
    role: str,
    spec: RoleSpec,
    inst: InstanceType,
    *,
    context_len: int | None = None,
    max_num_seqs: int | None = None,
) -> ModelFigures:
    """The figures of `shape` served by one `role` replica (`spec`) on `inst` GPUs.

    A replica is TP x PP GPUs per data-parallel rank, times DP ranks. Weights: the dense part
    is split by TP x PP on every rank; the routed experts likewise, and further over the DP
    ranks under expert parallelism (moeParallelism: expert).
    """
    s = _split(shape, model, spec, inst)
    kv_per_token = shape.kv_bytes_per_token(s.bpe)
    kv_per_token_gpu = shape.kv_bytes_per_token_per_gpu(s.bpe, s.tp, s.pp)
    # Every GPU of a rank holds the same number of tokens; each DP rank its own sequences.
    kv_tokens_rank = max(0, int(s.kv_gib * GIB // kv_per_token_gpu))
    kv_tokens = kv_tokens_rank * s.dp
    max_len = model.max_model_len

    # The prompt's KV crosses the network once, prefill node -> decode node. NIXL moves each
    # GPU's slice over the NICs next to it (on p4d/p5 the EFA interfaces are split evenly
    # across the GPUs), so a prompt gets its rank's GPUs' share of the node's line rate.
    # Non-EFA types (g5, g6e) use their ENA figure, shared the same way.
    prompt_bytes = kv_per_token * max_len
    node_bytes_per_s = inst.network_gbps * 1e9 / 8
    link_bytes_per_s = node_bytes_per_s * min(s.rank_gpus, inst.gpus) / inst.gpus

    ctx = context_len or max_len
    tokens_per_s = _decode_rate(shape, s, inst, ctx, kv_per_token_gpu)
    max_batch = kv_tokens // ctx
    if max_num_seqs:
        max_batch = min(max_batch, max_num_seqs * s.dp)
    bubble, hop_bytes, hop_seconds = _pipeline_hops(shape, s, max_len, link_bytes_per_s)
    ep_nodes, ep_bytes, ep_rate = _expert_traffic(shape, s, inst, node_bytes_per_s)

    return ModelFigures(
        weights_gib_per_gpu=s.weights_gib,
        headroom_gib_per_gpu=HEADROOM_GIB,
        kv_gib_per_gpu=s.kv_gib,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_per_gpu=kv_per_token_gpu,
        kv_tokens_per_replica=kv_tokens,
        max_length_sequences=kv_tokens // max_len,
        prompt_kv_bytes=prompt_bytes,
        prompt_kv_seconds=prompt_bytes / link_bytes_per_s,
        context_len=ctx,
        decode_tokens_per_s_batch1=tokens_per_s(1),
        max_batch=max_batch,
        decode_tokens_per_s_max_batch=tokens_per_s(max_batch) if max_batch > 0 else None,
        problems=tuple(_start_problems(shape, model, role, spec, inst, s, kv_tokens_rank)),
        pp_bubble_fraction=bubble,
        pp_hop_bytes=hop_bytes,
        pp_hop_seconds=hop_seconds,
        ep_nodes=ep_nodes,
        ep_bytes_per_token=ep_bytes,
        ep_tokens_per_s_per_node=ep_rate,
    )


def max_num_seqs(serving: ServingSpec) -> int | None:
    v = serving.engine_kwargs.get("max_num_seqs")
    return v if isinstance(v, int) and v > 0 else None


def fit_errors(serving: ServingSpec, instances: Mapping[str, InstanceType]) -> list[tuple[str, str]]:
    """(config key, message) for each engine role that cannot start on its pool's GPUs.

    `instances` maps each engine role to its node pool's instance type. An unknown model
    shape yields no errors: the plan says the check was skipped, and why.
    """
    shape, _ = resolve(serving.model)
    if shape is None:
        return []
    errors: list[tuple[str, str]] = []
    for role, spec in serving.engine_roles().items():
        figs = model_figures(shape, serving.model, role, spec, instances[role], max_num_seqs=max_num_seqs(serving))
        errors.extend(figs.problems)
    errors.extend(_transfer_errors(shape, serving))
    return errors


def _transfer_errors(shape: ModelShape, serving: ServingSpec) -> list[tuple[str, str]]:
    """P/D layouts that the KV transfer of this model refuses (needs the model's KV heads)."""
    if serving.mode is not Mode.DISAGGREGATED:
        return []
    p_tp, d_tp = serving.prefill.tensor_parallel_size, serving.decode.tensor_parallel_size
    if p_tp > d_tp and shape.mla_kv_dim is None and p_tp > shape.num_kv_heads:
        # nixl/base_worker.py _validate_remote_agent_handshake (0.29 and 0.32):
        # assert not (tp_ratio < 0 and is_kv_replicated) for non-MLA, non-Mamba models.
        return [
            (
                "serving.prefill.tensorParallelSize",
                f"prefill TP {p_tp} > decode TP {d_tp} with {shape.name}'s {shape.num_kv_heads} KV heads: prefill "
                "replicates KV heads (TP > KV heads) and vLLM cannot read replicated heads into a smaller decode TP "
                "(v1/nixl/base_worker.py asserts not (tp_ratio < 0 and is_kv_replicated), vLLM 0.29 and 0.32); "
                f"keep prefill TP <= {shape.num_kv_heads} or equal to decode's",
            )
        ]
    return []


# --- layouts for models larger than one node -------------------------------------------------
@dataclass(frozen=True)
class LayoutOption:
    """One way to lay an engine replica of `role` over a pool's nodes, with its figures."""

    role: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    expert_parallel: bool
    gpus: int
    nodes: int
    usd_per_hour: float  # on-demand list price of the replica's nodes
    figures: ModelFigures

    @property
    def label(self) -> str:
        text = f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size}"
        if self.data_parallel_size > 1:
            text += f" x DP {self.data_parallel_size}"
        return text + (" + EP" if self.expert_parallel else "")

    def stack_keys(self) -> dict[str, object]:
        """The serving.<role> keys that select this layout in a stack file."""
        keys: dict[str, object] = {"tensorParallelSize": self.tensor_parallel_size}
        if self.pipeline_parallel_size > 1:
            keys["pipelineParallelSize"] = self.pipeline_parallel_size
        if self.data_parallel_size > 1:
            keys["dataParallelSize"] = self.data_parallel_size
        if self.expert_parallel:
            keys["moeParallelism"] = MoeParallelism.EXPERT.value
        return keys


def weights_gib(shape: ModelShape, model: ModelSpec) -> float:
    """The whole model's weights, as served."""
    return shape.parameters_billions * 1e9 * (shape.weight_bytes_per_param or bytes_per_element(model.dtype)) / GIB


def exceeds_one_node(shape: ModelShape, model: ModelSpec, inst: InstanceType) -> bool:
    """True when the weights alone exceed the usable memory of all of one node's GPUs."""
    return weights_gib(shape, model) > inst.gpus * inst.gpu_memory_gib * model.gpu_memory_utilization


def candidate_layouts(shape: ModelShape, inst: InstanceType, role: str, max_nodes: int = 4) -> list[RoleSpec]:
    """Layouts of whole nodes: TP = a node's GPUs with PP across nodes (prefill only: decode PP
    stays 1), and for MoE models data-parallel attention with the experts spread (EP) over
    1..max_nodes nodes, one GPU or one node per DP rank (the wide-EP pattern of llm-d and Dynamo)."""
    g = inst.gpus
    seen: list[tuple[int, int, int, bool]] = []
    for n in range(1, max_nodes + 1):
        if role == "prefill" or n == 1:
            seen.append((g, n, 1, False))
        if shape.moe:
            seen.append((1, 1, n * g, True))
            if n > 1:
                seen.append((g, 1, n, True))
    return [
        RoleSpec(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            moe_parallelism=MoeParallelism.EXPERT if ep else MoeParallelism.TENSOR,
        )
        for tp, pp, dp, ep in dict.fromkeys(seen)
    ]


def propose_layouts(
    shape: ModelShape,
    model: ModelSpec,
    inst: InstanceType,
    role: str,
    *,
    context_len: int | None = None,
    max_num_seqs: int | None = None,
) -> list[LayoutOption]:
    """The candidate layouts on `inst` that hold the weights and one maxModelLen sequence."""
    out = []
    for spec in candidate_layouts(shape, inst, role):
        figs = model_figures(shape, model, role, spec, inst, context_len=context_len, max_num_seqs=max_num_seqs)
        if figs.problems:
            continue
        nodes = sizing.nodes_per_replica(spec.gpus_per_replica, inst.gpus)
        out.append(
            LayoutOption(
                role=role,
                tensor_parallel_size=spec.tensor_parallel_size,
                pipeline_parallel_size=spec.pipeline_parallel_size,
                data_parallel_size=spec.data_parallel_size,
                expert_parallel=spec.moe_parallelism is MoeParallelism.EXPERT,
                gpus=spec.gpus_per_replica,
                nodes=nodes,
                usd_per_hour=nodes * inst.usd_per_hour,
                figures=figs,
            )
        )
    return out
