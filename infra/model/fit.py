"""Does the model fit its node pools, and how fast can it go there? (The planner's arithmetic.)

What flows through here: a stack's `serving:` block (a `ServingSpec`) and the catalog entry
of each engine role's node pool come in; out go, per role, the memory split of one GPU
(weights, headroom, KV cache), the KV cache a replica holds, the time to ship one prompt's KV
between nodes and a decode roofline (`model_figures()`). `fit_errors()` gives the
configurations that cannot start as (config key, message) pairs; `StackConfig._cross`
appends them to its errors, so a model that does not fit fails validation before `pulumi up`.
`infra.model.planning` adds the pools, replicas and prices of a whole stack on top.

Pure arithmetic on published figures: no Pulumi, Ray or vLLM import, nothing downloaded.
The model's shape comes from `serving.model.architecture` when the stack file gives one,
else from the built-in catalog below, matched on the last path component of
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

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from infra.model.catalog import InstanceType
from serving.spec import Dtype, ModelSpec, RoleSpec, ServingSpec

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


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its config.json figures and parameter count."""

    name: str
    parameters_billions: float
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int


def _shape(
    names: tuple[str, ...], params_b: float, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> list[tuple[str, ModelShape]]:
    return [(n, ModelShape(n, params_b, layers, hidden, heads, kv_heads, head_dim)) for n in names]


# Published config.json values (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, head dim) and the parameter counts of the model cards. Names are the
# lower-cased Hugging Face repo names without suffixes such as -Instruct.
BUILTIN_MODELS: dict[str, ModelShape] = dict(
    _shape(("llama-3-8b", "llama-3.1-8b"), 8.03, 32, 4096, 32, 8, 128)
    + _shape(("llama-3.2-1b",), 1.24, 16, 2048, 32, 8, 64)
    + _shape(("llama-3.2-3b",), 3.21, 28, 3072, 24, 8, 128)
    + _shape(("llama-3-70b", "llama-3.1-70b", "llama-3.3-70b"), 70.6, 80, 8192, 64, 8, 128)
    + _shape(("llama-3.1-405b",), 405.9, 126, 16384, 128, 8, 128)
    + _shape(("qwen2.5-0.5b",), 0.49, 24, 896, 14, 2, 64)
    + _shape(("qwen2.5-1.5b",), 1.54, 28, 1536, 12, 2, 128)
    + _shape(("qwen2.5-3b",), 3.09, 36, 2048, 16, 2, 128)
    + _shape(("qwen2.5-7b",), 7.61, 28, 3584, 28, 4, 128)
    + _shape(("qwen2.5-14b",), 14.7, 48, 5120, 40, 8, 128)
    + _shape(("qwen2.5-32b",), 32.5, 64, 5120, 40, 8, 128)
    + _shape(("qwen2.5-72b",), 72.7, 80, 8192, 64, 8, 128)
    + _shape(("mistral-7b",), 7.25, 32, 4096, 32, 8, 128)
)

# Names that say the checkpoint is quantized: its weights are not parameters x dtype bytes,
# so a catalog shape would mislead.
_QUANTIZED = re.compile(
    r"(?:^|[-_.])(awq|gptq|fp8|fp4|nvfp4|int4|int8|w4a16|w8a8|w8a16|bnb|gguf|4bit|8bit|nf4|exl2)(?:$|[-_.])"
)


def model_name(source: str) -> str:
    """The last path component of a model source, lower-cased: `Llama-3.3-70B-Instruct`."""
    return source.rstrip("/").rsplit("/", 1)[-1].lower()


def match_builtin(source: str) -> tuple[ModelShape | None, str | None]:
    """(shape, None) for a catalog model, else (None, why not).

    `Meta-Llama-3.1-8B-Instruct`, `Llama-3.3-70B-Instruct` and `Mistral-7B-Instruct-v0.3`
    match; a name must equal a catalog name or continue it after a '-', so `Qwen2.5-72B`
    is never taken for `qwen2.5-7b`.
    """
    name = model_name(source)
    bare = name[len("meta-") :] if name.startswith("meta-") else name
    if _QUANTIZED.search(bare):
        return None, (
            f"{name!r} looks like a quantized checkpoint, whose weights the planner cannot size "
            "from its parameter count"
        )
    for key in sorted(BUILTIN_MODELS, key=len, reverse=True):
        if bare == key or bare.startswith(key + "-"):
            return BUILTIN_MODELS[key], None
    return None, f"{name!r} is not in the planner's built-in catalog"


def resolve(model: ModelSpec) -> tuple[ModelShape | None, str]:
    """The model's shape and where it came from, or (None, why the shape is unknown)."""
    arch = model.architecture
    if arch is not None:
        head_dim = arch.head_dim or arch.hidden_size // arch.num_attention_heads
        return (
            ModelShape(
                model.id,
                arch.parameters_billions,
                arch.num_layers,
                arch.hidden_size,
                arch.num_attention_heads,
                arch.num_kv_heads,
                head_dim,
            ),
            "serving.model.architecture",
        )
    shape, why = match_builtin(model.source)
    if shape is None:
        return None, f"{why}; set serving.model.architecture to plan it"
    return shape, "built-in catalog"


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
    """The figures of `shape` served by one `role` replica (`spec`) on `inst` GPUs."""
    bpe = bytes_per_element(model.dtype)
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    gpus = tp * pp
    util = model.gpu_memory_utilization
    usable_gib = inst.gpu_memory_gib * util

    weights_bytes = shape.parameters_billions * 1e9 * bpe
    # Sharded evenly: TP splits every matrix, PP the layers (vLLM's uneven last stage, with
    # the LM head, is ignored).
    weights_gib = weights_bytes / gpus / GIB
    kv_gib = usable_gib - weights_gib - HEADROOM_GIB

    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * bpe
    layers_per_stage = math.ceil(shape.num_layers / pp)
    kv_heads_per_gpu = max(1, shape.num_kv_heads // tp)
    kv_per_token_gpu = 2 * layers_per_stage * kv_heads_per_gpu * shape.head_dim * bpe
    kv_tokens = max(0, int(kv_gib * GIB // kv_per_token_gpu))
    max_len = model.max_model_len

    # The prompt's KV crosses the network once, prefill node -> decode node. NIXL moves each
    # GPU's slice over the NICs next to it (on p4d/p5 the EFA interfaces are split evenly
    # across the GPUs), so a replica gets its GPUs' share of the node's line rate.
    # Non-EFA types (g5, g6e) use their ENA figure, shared the same way.
    prompt_bytes = kv_per_token * max_len
    link_bytes_per_s = inst.network_gbps * 1e9 / 8 * gpus / inst.gpus
    prompt_seconds = prompt_bytes / link_bytes_per_s

    # Decode roofline: each step reads every weight once and the KV of every sequence in the
    # batch, from the HBM of the replica's TP GPUs at once. Pipeline stages are taken to run
    # one after another, so PP adds memory, not bandwidth (a lower bound for PP > 1).
    ctx = context_len or max_len
    hbm_bytes_per_s = tp * inst.hbm_gbps * 1e9
    kv_read_per_seq = ctx * kv_per_token_gpu * gpus  # what the replica's GPUs hold for it

    def tokens_per_s(batch: int) -> float:
        return batch / ((weights_bytes + batch * kv_read_per_seq) / hbm_bytes_per_s)

    max_batch = kv_tokens // ctx
    if max_num_seqs:
        max_batch = min(max_batch, max_num_seqs)

    problems: list[tuple[str, str]] = []
    key = f"serving.{role}"
    dtype = _dtype_label(model.dtype)
    gpu = f"{_article(inst.gpu_model)} {inst.gpu_model}"
    if shape.num_attention_heads % tp:
        problems.append(
            (
                f"{key}.tensorParallelSize",
                f"{shape.name} has {shape.num_attention_heads} attention heads, which TP {tp} does not "
                "divide (vLLM refuses to start); pick a tensorParallelSize that divides them",
            )
        )
    if weights_gib > usable_gib:
        problems.append(
            (
                f"{key}.tensorParallelSize",
                f"{shape.name} in {dtype} needs {weights_gib:.1f} GiB of weights per GPU at TP {tp} x "
                f"PP {pp}; {gpu} offers {usable_gib:.1f} GiB at gpuMemoryUtilization {util:g} "
                "(raise tensorParallelSize or use a larger GPU)",
            )
        )
    elif kv_tokens < max_len:
        problems.append(
            (
                "serving.model.maxModelLen",
                f"{shape.name} in {dtype} at TP {tp} x PP {pp} on {inst.gpu_model} leaves "
                f"{max(kv_gib, 0):.1f} GiB per GPU for KV cache ({usable_gib:.1f} GiB usable at "
                f"gpuMemoryUtilization {util:g} - {weights_gib:.1f} GiB weights - {HEADROOM_GIB:g} GiB "
                f"headroom): {kv_tokens:,} tokens per {role} replica, less than one maxModelLen "
                f"({max_len:,}) sequence (lower maxModelLen, raise tensorParallelSize or use a larger GPU)",
            )
        )

    return ModelFigures(
        weights_gib_per_gpu=weights_gib,
        headroom_gib_per_gpu=HEADROOM_GIB,
        kv_gib_per_gpu=kv_gib,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_per_gpu=kv_per_token_gpu,
        kv_tokens_per_replica=kv_tokens,
        max_length_sequences=kv_tokens // max_len,
        prompt_kv_bytes=prompt_bytes,
        prompt_kv_seconds=prompt_seconds,
        context_len=ctx,
        decode_tokens_per_s_batch1=tokens_per_s(1),
        max_batch=max_batch,
        decode_tokens_per_s_max_batch=tokens_per_s(max_batch) if max_batch > 0 else None,
        problems=tuple(problems),
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
    return errors
