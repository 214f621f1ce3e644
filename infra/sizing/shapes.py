"""The shapes of the models the planner knows: config.json figures and parameter counts.

What flows through here: a stack's `serving.model` -> its `ModelShape`, from
`serving.model.architecture` when the stack file gives one, else from the built-in catalog
below, matched on the last path component of `serving.model.source`; or why the shape is
unknown (`resolve()`). Published figures only; `infra.sizing.fit` does the arithmetic on them
(and re-exports these names).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from serving.spec import ModelSpec


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
    # Bytes per parameter of the checkpoint as published, when it is not the serving dtype's
    # (a natively FP8 checkpoint keeps its FP8 weights under dtype bfloat16). None: dtype's.
    weight_bytes_per_param: float | None = None
    # Multi-head latent attention (MLA): the elements cached per token and layer
    # (kv_lora_rank + qk_rope_head_dim); one latent vector, replicated on every TP rank.
    mla_kv_dim: int | None = None
    # Mixture of experts: routed experts, experts each token goes to, the layers that have
    # experts, and the routed experts' parameters (the rest is dense: attention, shared
    # experts, dense layers, embeddings).
    routed_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    expert_parameters_billions: float = 0.0
    active_parameters_billions: float | None = None

    @property
    def moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def dense_parameters_billions(self) -> float:
        return self.parameters_billions - self.expert_parameters_billions

    def kv_bytes_per_token(self, bpe: int) -> int:
        """K and V (or MLA's latent) of one token across all layers."""
        if self.mla_kv_dim is not None:
            return self.num_layers * self.mla_kv_dim * bpe
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bpe

    def kv_bytes_per_token_per_gpu(self, bpe: int, tp: int, pp: int) -> int:
        """One GPU's share: its stage's layers; its KV heads (GQA), or the whole latent (MLA)."""
        layers = math.ceil(self.num_layers / pp)
        if self.mla_kv_dim is not None:
            return layers * self.mla_kv_dim * bpe
        # vLLM replicates KV heads when TP exceeds them: at least one per GPU.
        return 2 * layers * max(1, self.num_kv_heads // tp) * self.head_dim * bpe


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


def _deepseek_v3(name: str) -> ModelShape:
    """DeepSeek-V3 (and R1, the same architecture), from its published config.json.

    huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: num_hidden_layers 61,
    hidden_size 7168, num_attention_heads 128 (num_key_value_heads 128, unused by MLA),
    kv_lora_rank 512, qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 256,
    num_experts_per_tok 8, n_shared_experts 1, first_k_dense_replace 3, moe_intermediate_size
    2048, quantization_config fp8 e4m3 with 128x128 blocks. The same figures are the defaults of
    transformers' DeepseekV3Config (models/deepseek_v3/configuration_deepseek_v3.py, 5.19), and
    deepseek-ai/DeepSeek-V3 README_WEIGHTS.md gives 671B parameters, 36.7B activated, for the
    main model (the MTP module's 11.5B are loaded only for speculative decoding).
    """
    layers, hidden, dense_layers = 61, 7168, 3
    moe_layers = layers - dense_layers
    routed, moe_intermediate = 256, 2048
    # gate, up and down projections of every routed expert of every MoE layer
    expert_params = moe_layers * routed * 3 * hidden * moe_intermediate / 1e9
    return ModelShape(
        name,
        parameters_billions=671.0,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=128,
        num_kv_heads=128,
        head_dim=128,
        weight_bytes_per_param=1.0,  # FP8 weights; block scales and BF16 norms/embeddings ignored (<1%)
        mla_kv_dim=512 + 64,
        routed_experts=routed,
        experts_per_token=8,
        moe_layers=moe_layers,
        expert_parameters_billions=expert_params,
        active_parameters_billions=36.7,
    )


BUILTIN_MODELS.update({n: _deepseek_v3(n) for n in ("deepseek-v3", "deepseek-r1")})

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
