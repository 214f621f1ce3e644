"""A LoRA adapter for the tiny model, built locally and deterministically.

What flows through here: a fixed recipe (rank, alpha, target modules, seed) and the tiny
model's own recipe (local/tiny_model.py) go in; a PEFT-format adapter directory comes
out (adapter_config.json, adapter_model.safetensors) that vLLM loads through a LoRARequest and
Ray Serve LLM loads from `<lora.adaptersPath>/<ADAPTER_NAME>/` when a request names the model
`<model id>:<ADAPTER_NAME>`. Nothing is downloaded and peft is not needed. The directory is
cached under a key derived from both recipes, so a changed base model rebuilds its adapter.

The layout is what vLLM 0.32 reads (vllm/lora/peft_helper.py `PEFTHelper`,
vllm/lora/lora_model.py `LoRAModel.from_local_checkpoint`, vllm/lora/utils.py
`parse_fine_tuned_lora_name`): tensors named
`base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`, lora_A of shape
(r, in_features) and lora_B of shape (out_features, r); the output is W x + (alpha / r) B A x.
vLLM's Llama (model_executor/models/llama.py) packs q/k/v into qkv_proj and accepts LoRA on
any of them alone. PEFT starts B at zero, which leaves a fresh adapter a no-op; ours draws
both A and B at random so that the adapter visibly changes greedy output.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from local import tiny_model

# The folder name under the adapters path: requests name `<model id>:tiny-lora`.
ADAPTER_NAME = "tiny-lora"
SEED = 4321
RANK = 8  # one of vLLM's max_lora_rank values; serving.spec.models.LoraSpec's default (16) covers it
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")  # PEFT's default for Llama
# Standard deviation of B's entries; A's are 1/sqrt(in_features) (PEFT's Kaiming scale). The
# update (alpha / r) B A then has entries about a third the size of the base weights'
# (initializer_range 0.02): with it, greedy output departs from the base model's by the
# second generated token (tests/local/test_tiny_lora.py).
B_STD = 0.02
RECIPE_VERSION = 1

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def recipe_key() -> str:
    """A short hash of everything that determines the built files, the base model's recipe included."""
    recipe = {
        "version": RECIPE_VERSION,
        "seed": SEED,
        "rank": RANK,
        "alpha": ALPHA,
        "targets": TARGET_MODULES,
        "b_std": B_STD,
        "base": tiny_model.recipe_key(),
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def base_model_name() -> str:
    """The base model as the adapter names it: the tiny model's cache folder name."""
    return f"{tiny_model.MODEL_NAME}-{tiny_model.recipe_key()}"


def module_shapes() -> dict[str, tuple[int, int]]:
    """Each adapted module's Hugging Face name -> its weight's (out_features, in_features)."""
    arch = tiny_model.ARCHITECTURE
    hidden = arch["hidden_size"]
    head_dim = hidden // arch["num_attention_heads"]
    out = {
        "q_proj": arch["num_attention_heads"] * head_dim,
        "k_proj": arch["num_key_value_heads"] * head_dim,
        "v_proj": arch["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    return {
        f"model.layers.{layer}.self_attn.{proj}": (out[proj], hidden)
        for layer in range(arch["num_hidden_layers"])
        for proj in TARGET_MODULES
    }


def adapter_config() -> dict[str, Any]:
    """adapter_config.json: the fields PEFT writes for a LoRA adapter (vLLM reads r, lora_alpha,
    target_modules, bias and the unsupported-feature flags)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name(),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def adapter_tensors() -> dict[str, Any]:
    """The lora_A and lora_B tensors (float32), drawn from one seeded generator in name order."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    tensors: dict[str, Any] = {}
    for module, (out_features, in_features) in sorted(module_shapes().items()):
        prefix = f"base_model.model.{module}"
        a = torch.randn(RANK, in_features, generator=gen, dtype=torch.float32) / in_features**0.5
        b = torch.randn(out_features, RANK, generator=gen, dtype=torch.float32) * B_STD
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def _build(out: Path) -> None:
    from safetensors.torch import save_file

    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(), indent=2, sort_keys=True) + "\n")
    save_file(adapter_tensors(), str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def ensure_tiny_lora(cache_dir: Path | None = None) -> Path:
    """Return the adapter directory (adapter_config.json + adapter_model.safetensors), building it
    first if the cache does not hold it. cache_dir: as tiny_model.ensure_tiny_model's (default
    $PD_CACHE_DIR, else .cache/); the adapter does not need the base model to be built."""
    root = Path(cache_dir) if cache_dir is not None else tiny_model.default_cache_dir()
    target = root / f"{tiny_model.MODEL_NAME}-lora-{recipe_key()}"
    return tiny_model.cached_build(target, _build, (WEIGHTS_FILE, CONFIG_FILE))


if __name__ == "__main__":
    print(ensure_tiny_lora())
