"""The tiny local model: built offline, deterministic, cached, and loadable by vLLM's tooling."""

from __future__ import annotations

import hashlib
import json

import pytest

from local import tiny_model


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tiny_model.ensure_tiny_model(tmp_path_factory.mktemp("tiny-a"))


def test_build_writes_a_hugging_face_model_directory(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == tiny_model.ARCHITECTURE[key]
    assert built.name == f"{tiny_model.MODEL_NAME}-{tiny_model.recipe_key()}"


def test_build_is_deterministic(built, tmp_path):
    again = tiny_model.ensure_tiny_model(tmp_path)
    assert _digest(again) == _digest(built)


def test_second_call_uses_the_cache(built, monkeypatch):
    stamp = (built / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(out):
        raise AssertionError(f"rebuilt into {out} although the cache holds the model")

    monkeypatch.setattr(tiny_model, "_build_tokenizer", no_rebuild)
    monkeypatch.setattr(tiny_model, "_build_model", no_rebuild)
    assert tiny_model.ensure_tiny_model(built.parent) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    # No half-built temporary directories left behind.
    assert [p.name for p in built.parent.iterdir()] == [built.name]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    assert tiny_model.default_cache_dir() == tmp_path


def test_tokenizer_round_trips_and_has_a_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == tiny_model.ARCHITECTURE["vocab_size"]
    text = "Disaggregated serving: prefill, then decode! 123"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids


def test_model_loads_and_generates_greedily_the_same_twice(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 5_000_000
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=8, do_sample=False)
        b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and a.shape[1] > ids.shape[1]


def test_vllm_resolves_an_engine_config_for_it_offline(built, monkeypatch):
    """vLLM itself accepts the directory with the local run's engine settings."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = AsyncEngineArgs(
        model=str(built), dtype="float32", max_model_len=512, enforce_eager=True
    ).create_engine_config()
    assert config.model_config.max_model_len == 512
    assert str(config.model_config.dtype) == "torch.float32"
    assert config.model_config.hf_config.num_key_value_heads == 2
