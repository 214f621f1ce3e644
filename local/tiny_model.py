"""A tiny Llama-architecture model with random weights, built locally and deterministically.

What flows through here: a fixed recipe (architecture, seed, tokenizer corpus) goes in; a
Hugging Face model directory comes out (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json) that vLLM loads like
any downloaded model. Nothing is downloaded. The directory is cached under a key derived
from the recipe, so a second `make serve` reuses it and a changed recipe rebuilds.

It stands in for the real model of a stack on machines without a GPU: the text it writes
is noise, but every token goes through the same tokenizer, chat template, engine, KV cache
and KV transfer as a real model's would.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.paths import CACHE_DIR

SEED = 1234
MODEL_NAME = "tiny-llama"

# Shape: ~2 M parameters, fast on two CPU cores; 2 KV heads so KV transfer has real
# grouped-query layout to move.
ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML-style template: what the OpenAI chat endpoint renders messages through.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

RECIPE_VERSION = 1

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across separate engines.",
    "The prefill engine computes the key value cache for the whole prompt.",
    "The decode engine reads that cache over the network and generates tokens.",
    "Ray Serve routes each request from the ingress to the decode deployment.",
    "A small model with random weights still exercises the whole serving path.",
    "Hello! How can I help you today? Tell me a story about a robot.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "What is the capital of France? Paris is the capital of France.",
    "Explain how a transformer attends to earlier tokens in the sequence.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000.",
    'Punctuation, quotes "like this", (brackets), [lists], {braces}; colons: and dashes - too.',
]


def recipe_key() -> str:
    """A short hash of everything that determines the built files."""
    recipe = {
        "version": RECIPE_VERSION,
        "seed": SEED,
        "architecture": ARCHITECTURE,
        "special": SPECIAL_TOKENS,
        "template": CHAT_TEMPLATE,
        "sentences": _SENTENCES,
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where built models live: $PD_CACHE_DIR, else .cache/ at the repository root."""
    env = os.environ.get("PD_CACHE_DIR")
    if env:
        return Path(env)
    return CACHE_DIR


def _corpus(seed: int) -> list[str]:
    """A fixed training corpus: the sentences above plus seeded pseudo-words."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = list(_SENTENCES) * 20
    for _ in range(2000):
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=ARCHITECTURE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(SEED), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = ARCHITECTURE["max_position_embeddings"]
    fast.save_pretrained(out)


def _build_model(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)

    def token_id(token: str) -> int:
        found = tok.convert_tokens_to_ids(token)
        assert isinstance(found, int), token
        return found

    config = LlamaConfig(
        **ARCHITECTURE,
        bos_token_id=token_id(BOS),
        # Chat turns end with <|im_end|>; raw completions with <|end|>.
        eos_token_id=[token_id(EOS), token_id(IM_END)],
        pad_token_id=token_id(PAD),
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)


def cached_build(target: Path, build: Callable[[Path], None], files: tuple[str, ...]) -> Path:
    """`target`, built by `build(folder)` unless it already holds `files`. The build runs in a
    temporary folder next to it that is then renamed, so a half-built folder is never used,
    and two processes building at once both end with one complete copy."""
    if all((target / f).is_file() for f in files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is not secret
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its copy is identical.
            if not (target / files[0]).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the model directory, building it first if the cache does not hold it."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(out: Path) -> None:
        _build_tokenizer(out)
        _build_model(out)

    return cached_build(root / f"{MODEL_NAME}-{recipe_key()}", build, ("model.safetensors", "tokenizer.json"))


if __name__ == "__main__":
    print(ensure_tiny_model())
