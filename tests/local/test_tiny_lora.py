"""The tiny model's LoRA adapter: PEFT layout that vLLM 0.32 reads, deterministic, cached, not a no-op.

The quick tests read the files with vLLM's own parsers (vllm/lora/peft_helper.py `PEFTHelper`,
vllm/lora/utils.py `parse_fine_tuned_lora_name`, vllm 0.32) and check the tensors against the
tiny model's weights; one of them merges the adapter into the weights with transformers and
shows greedy output changes. The e2e test starts a vLLM CPU engine with the spec's LoRA engine
settings and generates with and without a LoRARequest (`-m e2e`, about a minute on two cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from local import tiny_lora, tiny_model
from serving.spec.models import LoraSpec

PROMPTS = ["The quick brown fox", "Hello! How can I help you today?", "Write a haiku about autumn"]


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tiny_lora.ensure_tiny_lora(tmp_path_factory.mktemp("lora-a"))


@pytest.fixture(scope="module")
def base_model():
    return tiny_model.ensure_tiny_model()  # the cached build `make serve` uses; built here if missing


@pytest.fixture(scope="module")
def tensors(built):
    from safetensors.torch import load_file

    return load_file(str(built / tiny_lora.WEIGHTS_FILE))


def test_the_config_is_a_peft_lora_config_that_vllm_accepts_under_the_specs_default_rank(built):
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    config = json.loads((built / tiny_lora.CONFIG_FILE).read_text())
    assert (config["peft_type"], config["task_type"], config["bias"]) == ("LORA", "CAUSAL_LM", "none")
    assert config["base_model_name_or_path"] == f"{tiny_model.MODEL_NAME}-{tiny_model.recipe_key()}"
    assert (config["r"], config["lora_alpha"]) == (tiny_lora.RANK, tiny_lora.ALPHA)

    spec = LoraSpec(adapters_path="s3://pd-local-lora/tiny-llama")
    helper = PEFTHelper.from_local_dir(str(built), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=spec.max_lora_rank, max_loras=spec.max_loras))
    assert sorted(helper.target_modules) == sorted(tiny_lora.TARGET_MODULES)
    assert helper.vllm_lora_scaling_factor == tiny_lora.ALPHA / tiny_lora.RANK


def test_the_targets_are_modules_vllms_llama_takes_lora_on():
    from vllm.model_executor.models.llama import LlamaForCausalLM

    # q/k/v are packed into qkv_proj; vLLM expects LoRA on the packed parts' names.
    assert set(tiny_lora.TARGET_MODULES) <= set(LlamaForCausalLM.packed_modules_mapping["qkv_proj"])


def test_every_layer_and_target_has_lora_a_and_b_shaped_for_the_tiny_models_weights(tensors, base_model):
    from safetensors import safe_open
    from vllm.lora.utils import parse_fine_tuned_lora_name

    with safe_open(str(base_model / "model.safetensors"), framework="pt") as f:
        base_shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    layers = tiny_model.ARCHITECTURE["num_hidden_layers"]
    expected_modules = {
        f"model.layers.{i}.self_attn.{proj}" for i in range(layers) for proj in tiny_lora.TARGET_MODULES
    }
    seen: dict[str, set[bool]] = {}
    for name, tensor in tensors.items():
        module, is_a = parse_fine_tuned_lora_name(name)  # vLLM's own reading of the name
        seen.setdefault(module, set()).add(is_a)
        out_features, in_features = base_shapes[f"{module}.weight"]
        want = (tiny_lora.RANK, in_features) if is_a else (out_features, tiny_lora.RANK)
        assert tuple(tensor.shape) == want, name
        assert str(tensor.dtype) == "torch.float32", name
    assert seen == {m: {True, False} for m in expected_modules}
    assert tiny_lora.module_shapes() == {m: base_shapes[f"{m}.weight"] for m in expected_modules}


def test_no_lora_b_is_zero(tensors):
    """PEFT's fresh adapters start with B = 0 (a no-op); every B here has no zero entry."""
    bs = {n: t for n, t in tensors.items() if n.endswith("lora_B.weight")}
    assert len(bs) == tiny_model.ARCHITECTURE["num_hidden_layers"] * len(tiny_lora.TARGET_MODULES)
    for name, b in bs.items():
        assert bool((b != 0).all()), name


def _greedy(model, tok, prompt: str, n: int) -> list[int]:
    import torch

    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def _merged(base_model, tensors):
    """The tiny model with the adapter merged into its weights: W + (alpha / r) B A."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    weights = model.state_dict()
    scale = tiny_lora.ALPHA / tiny_lora.RANK
    with torch.no_grad():
        for module in tiny_lora.module_shapes():
            a = tensors[f"base_model.model.{module}.lora_A.weight"]
            b = tensors[f"base_model.model.{module}.lora_B.weight"]
            weights[f"{module}.weight"] += scale * b @ a
    return model


def test_the_merged_adapter_changes_greedy_output_for_every_prompt(tensors, base_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model)
    plain = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged = _merged(base_model, tensors)
    for prompt in PROMPTS:
        assert _greedy(merged, tok, prompt, 8) != _greedy(plain, tok, prompt, 8), prompt


def test_build_is_deterministic(built, tmp_path):
    again = tiny_lora.ensure_tiny_lora(tmp_path)
    assert again.name == built.name
    assert _digest(again) == _digest(built)


def test_second_call_uses_the_cache(built, monkeypatch):
    stamp = (built / tiny_lora.WEIGHTS_FILE).stat().st_mtime_ns

    def no_rebuild(out):
        raise AssertionError(f"rebuilt into {out} although the cache holds the adapter")

    monkeypatch.setattr(tiny_lora, "_build", no_rebuild)
    assert tiny_lora.ensure_tiny_lora(built.parent) == built
    assert (built / tiny_lora.WEIGHTS_FILE).stat().st_mtime_ns == stamp
    # No half-built temporary directories left behind.
    assert [p.name for p in built.parent.iterdir()] == [built.name]


def test_a_changed_base_model_recipe_builds_another_adapter(built, monkeypatch):
    monkeypatch.setattr(tiny_model, "recipe_key", lambda: "0123456789ab")
    other = tiny_lora.ensure_tiny_lora(built.parent)
    assert other != built
    config = json.loads((other / tiny_lora.CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == f"{tiny_model.MODEL_NAME}-0123456789ab"


def test_the_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    assert tiny_lora.ensure_tiny_lora().parent == tmp_path


# --- e2e: a vLLM CPU engine with the spec's LoRA settings, with and without the adapter --------
ENGINE_PROBE = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
model, adapter, name, prompts, engine_kwargs = sys.argv[1], sys.argv[2], sys.argv[3], *map(json.loads, sys.argv[4:])
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4, **engine_kwargs)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
inputs = [{"prompt_token_ids": p} for p in prompts]
def run(lora=None):
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, lora_request=lora, use_tqdm=False)]
base = run()
lora = run(LoRARequest(name, 1, adapter))
print("RESULT " + json.dumps({"base": base, "lora": lora, "base_again": run()}))
"""


def _near_argmax(model, prompt: list[int], generated: list[int], tol: float = 1e-3) -> list[int]:
    """Positions where `generated` is not (within `tol` of) the model's greedy choice, teacher-forced."""
    import torch

    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :]
    return [i for i, t in enumerate(generated) if float(logits[i].max() - logits[i, t]) > tol]


@pytest.mark.e2e
def test_vllm_cpu_loads_the_adapter_and_it_changes_greedy_output(base_model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from local.config import cluster_env

    adapter = tiny_lora.ensure_tiny_lora()  # the cached build `make serve` uploads
    tok = AutoTokenizer.from_pretrained(base_model)
    prompts = [tok.encode(p) for p in PROMPTS]
    engine_kwargs = LoraSpec(adapters_path="s3://pd-local-lora/tiny-llama").engine_kwargs()
    env = {
        **os.environ,
        **cluster_env(),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, as the local stack runs it (local/config.py)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the probe's own process
    }
    args = [str(base_model), str(adapter), tiny_lora.ADAPTER_NAME, json.dumps(prompts), json.dumps(engine_kwargs)]
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_PROBE, *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in reversed(run.stdout.splitlines()) if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    print(f"greedy tokens from vLLM: {out}")

    assert out["base_again"] == out["base"]  # the adapter did not leak into plain requests
    for prompt, base, lora in zip(PROMPTS, out["base"], out["lora"], strict=True):
        assert lora != base, prompt
    # vLLM applied this adapter's math: each token it chose is the greedy choice of the weights
    # with the adapter merged (and without it for plain requests), read by transformers.
    plain = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged = _merged(base_model, load_file(str(adapter / tiny_lora.WEIGHTS_FILE)))
    for prompt, base, lora in zip(prompts, out["base"], out["lora"], strict=True):
        assert _near_argmax(plain, prompt, base) == []
        assert _near_argmax(merged, prompt, lora) == []
