"""The capacity planner's figures against hand-computed ones, and its fit check in config.load."""

from __future__ import annotations

import copy
import math

import pytest

from infra.catalog import lookup
from infra.config import ConfigError, load
from infra.plan import planning
from infra.sizing import fit
from serving.spec import Dtype, ModelArchitecture, ModelSpec, RoleSpec
from tools.stackfile import read_as_deployed as read

GIB = 2**30

# Llama 3 70B (and 3.1 / 3.3; its Hugging Face config.json): 80 layers, 8 KV heads of dim 128,
# 70.6B parameters. KV per token = K and V x layers x KV heads x head dim x 2 B (bf16)
# = 2 x 80 x 8 x 128 x 2 = 327,680 B; weights per GPU at TP 8 = 70.6e9 x 2 B / 8 = 17.65e9 B.


def _values(stack: str) -> tuple[dict, set[str]]:
    values, secrets, _ = read(stack)
    return copy.deepcopy(values), secrets


def _load(values: dict, secrets: set[str]):
    return load(values, secret_keys=secrets, source="stacks/Pulumi.x.yaml")


def _model(source: str, **kw) -> ModelSpec:
    return ModelSpec(id="m", source=source, **kw)


# --- hand-computed figures --------------------------------------------------------------
def test_kv_bytes_per_token_by_hand():
    shape = fit.BUILTIN_MODELS["llama-3-70b"]
    figs = fit.model_figures(
        shape,
        _model("meta-llama/Meta-Llama-3-70B-Instruct"),
        "decode",
        RoleSpec(tensor_parallel_size=8),
        lookup("p5.48xlarge"),
    )
    assert figs.kv_bytes_per_token == 327_680
    assert figs.kv_bytes_per_token_per_gpu == 40_960  # 327,680 B / 8 GPUs


def test_llama3_70b_on_p5_at_tp8():
    model = _model("meta-llama/Meta-Llama-3-70B-Instruct", max_model_len=32768, gpu_memory_utilization=0.9)
    figs = fit.model_figures(
        fit.BUILTIN_MODELS["llama-3-70b"],
        model,
        "decode",
        RoleSpec(tensor_parallel_size=8),
        lookup("p5.48xlarge"),
    )
    # Weights: 70.6e9 params x 2 B / 8 GPUs = 17.65e9 B = 16.438 GiB per GPU.
    assert figs.weights_gib_per_gpu == pytest.approx(17.65e9 / GIB)
    assert figs.weights_gib_per_gpu == pytest.approx(16.438, abs=1e-3)
    # H100 on p5: 81,559 MiB; at 0.9 that is 71.683 GiB, minus weights and 2 GiB headroom.
    usable_gib = 81559 / 1024 * 0.9
    kv_gib = usable_gib - 17.65e9 / GIB - 2.0
    assert figs.kv_gib_per_gpu == pytest.approx(kv_gib)
    assert figs.kv_gib_per_gpu == pytest.approx(53.245, abs=1e-3)
    # Tokens per replica: each GPU holds 40,960 B of every token.
    assert figs.kv_tokens_per_replica == math.floor(kv_gib * GIB / 40_960) == 1_395_782
    assert figs.max_length_sequences == 1_395_782 // 32768 == 42
    # One 32k prompt's KV: 327,680 B x 32,768 = 10,737,418,240 B over 3,200 Gbps of EFA.
    assert figs.prompt_kv_bytes == 327_680 * 32_768 == 10_737_418_240
    assert figs.prompt_kv_seconds == pytest.approx(10_737_418_240 / (3200e9 / 8))
    assert figs.prompt_kv_seconds == pytest.approx(0.02684, abs=1e-5)
    # Decode roofline at a 32k context: a step reads all weights (141.2e9 B) plus the batch's
    # KV from 8 GPUs x 3,350 GB/s.
    hbm = 8 * 3350e9
    assert figs.decode_tokens_per_s_batch1 == pytest.approx(1 / ((141.2e9 + 32_768 * 327_680) / hbm))
    assert figs.decode_tokens_per_s_batch1 == pytest.approx(176.4, abs=0.1)
    assert figs.max_batch == 42
    assert figs.decode_tokens_per_s_max_batch == pytest.approx(42 / ((141.2e9 + 42 * 32_768 * 327_680) / hbm))
    assert figs.problems == ()


def test_llama3_70b_on_p4de_at_tp8():
    model = _model("meta-llama/Llama-3.1-70B-Instruct", max_model_len=16384, gpu_memory_utilization=0.9)
    figs = fit.model_figures(
        fit.BUILTIN_MODELS["llama-3.1-70b"],
        model,
        "prefill",
        RoleSpec(tensor_parallel_size=8),
        lookup("p4de.24xlarge"),
    )
    assert figs.weights_gib_per_gpu == pytest.approx(70.6e9 * 2 / 8 / GIB)
    # A100 80GB: 81,920 MiB = 80 GiB; 72 GiB at 0.9.
    kv_gib = 80 * 0.9 - 17.65e9 / GIB - 2.0
    assert figs.kv_gib_per_gpu == pytest.approx(kv_gib)
    assert figs.kv_tokens_per_replica == math.floor(kv_gib * GIB / 40_960) == 1_404_099
    # 327,680 B x 16,384 tokens over 400 Gbps of EFA = 5,368,709,120 B / 50e9 B/s.
    assert figs.prompt_kv_seconds == pytest.approx(327_680 * 16_384 / (400e9 / 8))
    assert figs.prompt_kv_seconds == pytest.approx(0.10737, abs=1e-5)
    hbm = 8 * 2039e9
    assert figs.decode_tokens_per_s_batch1 == pytest.approx(1 / ((141.2e9 + 16_384 * 327_680) / hbm))
    assert figs.max_batch == 1_404_099 // 16_384 == 85


def test_stack_plans_carry_the_hand_computed_figures():
    values, secrets = _values("prod")
    p = planning.plan(_load(values, secrets))
    assert [r.role for r in p.roles] == ["prefill", "decode"]
    decode = p.roles[1]
    assert decode.instance_type == "p5.48xlarge"
    assert decode.figures.kv_tokens_per_replica == 1_395_782
    assert decode.network == "EFA" and decode.network_gbps == 3200
    # GPU count and price from the pools: prefill 1-3 nodes, decode 2-6 nodes of 8 GPUs (maxSize leaves
    # room for the second cluster of a NewCluster upgrade).
    assert (p.gpus_desired, p.gpus_max) == (8 + 16, 24 + 48)
    assert p.usd_per_hour_desired == pytest.approx(3 * 55.04)
    assert p.usd_per_hour_max == pytest.approx(9 * 55.04)

    values, secrets = _values("staging")
    p = planning.plan(_load(values, secrets))
    assert {r.figures.kv_tokens_per_replica for r in p.roles} == {1_404_099}
    assert (p.gpus_desired, p.gpus_max) == (16, 32)
    assert p.usd_per_hour_max == pytest.approx(4 * 27.45)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # Qwen2.5-1.5B has 2 KV heads: at TP 4 each GPU still holds one whole head.
    figs = fit.model_figures(
        fit.BUILTIN_MODELS["qwen2.5-1.5b"],
        _model("Qwen/Qwen2.5-1.5B-Instruct"),
        "decode",
        RoleSpec(tensor_parallel_size=4),
        lookup("g5.12xlarge"),
    )
    assert figs.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    assert figs.kv_bytes_per_token_per_gpu == 2 * 28 * 1 * 128 * 2


def test_non_efa_types_use_their_ena_figure():
    figs = fit.model_figures(
        fit.BUILTIN_MODELS["qwen2.5-1.5b"],
        _model("Qwen/Qwen2.5-1.5B-Instruct", max_model_len=8192),
        "decode",
        RoleSpec(),
        lookup("g5.xlarge"),
    )
    assert figs.prompt_kv_seconds == pytest.approx(28_672 * 8192 / (10e9 / 8))


def test_dtype_bytes():
    assert fit.bytes_per_element(Dtype.BFLOAT16) == 2
    assert fit.bytes_per_element(Dtype.FLOAT16) == 2
    assert fit.bytes_per_element(Dtype.FLOAT32) == 4
    assert fit.bytes_per_element(Dtype.AUTO) == 2


# --- matching the model ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
        ("s3://pd-inference-prod-models/meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
        ("s3://bucket/models/llama-3.1-70b-instruct/", "llama-3.1-70b"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b"),
        ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-405B-Instruct", "llama-3.1-405b"),
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
    ],
)
def test_builtin_match(source, name):
    shape, why = fit.match_builtin(source)
    assert why is None and shape is not None and shape.name == name


@pytest.mark.parametrize(
    "source",
    [
        "org/Qwen2.5-Coder-7B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct-FP8",
        "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
        "org/llama-3.1-70bx",
        "org/some-model",
    ],
)
def test_no_guessing(source):
    shape, why = fit.match_builtin(source)
    assert shape is None and why


def test_architecture_in_the_stack_file_wins():
    arch = ModelArchitecture(
        parameters_billions=10, num_layers=40, hidden_size=5120, num_attention_heads=40, num_kv_heads=8
    )
    shape, origin = fit.resolve(_model("meta-llama/Llama-3.3-70B-Instruct", architecture=arch))
    assert origin == "serving.model.architecture"
    assert (shape.num_layers, shape.head_dim, shape.parameters_billions) == (40, 128, 10)


# --- the fit check through config.load ---------------------------------------------------
def test_70b_bf16_tp2_on_a100_40gb_fails_validation():
    values, secrets = _values("staging")  # Llama 3.1 70B, bf16, maxModelLen 16384
    values["nodePools"]["decode"]["instanceType"] = "p4d.24xlarge"
    values["serving"]["prefill"]["tensorParallelSize"] = 2
    values["serving"]["decode"]["tensorParallelSize"] = 2
    with pytest.raises(ConfigError) as e:
        _load(values, secrets)
    # 70.6e9 x 2 B / 2 = 65.8 GiB; 40 GiB x 0.9 = 36.0 GiB.
    assert str(e.value) == (
        "stacks/Pulumi.x.yaml: serving.decode.tensorParallelSize: llama-3.1-70b in bfloat16 needs "
        "65.8 GiB of weights per GPU at TP 2 x PP 1; an A100 40GB offers 36.0 GiB at "
        "gpuMemoryUtilization 0.9 (raise tensorParallelSize or use a larger GPU)"
    )


def test_kv_cache_below_one_sequence_fails_validation():
    values, secrets = _values("staging")
    for role in ("prefill", "decode"):
        values["nodePools"][role]["instanceType"] = "p4d.24xlarge"
        values["serving"][role]["tensorParallelSize"] = 4
    # 36.0 - 32.9 - 2 = 1.1 GiB per GPU; 81,920 B per token per GPU: 14,736 tokens < 16,384.
    with pytest.raises(
        ConfigError,
        match=r"serving\.model\.maxModelLen: .*14,736 tokens per prefill "
        r"replica, less than one maxModelLen \(16,384\) sequence",
    ):
        _load(values, secrets)
    values["serving"]["model"]["maxModelLen"] = 8192
    _load(values, secrets)


def test_tp_must_divide_the_attention_heads():
    values, secrets = _values("dev")
    values["serving"]["model"]["source"] = "Qwen/Qwen2.5-0.5B-Instruct"  # 14 heads
    for role in ("prefill", "decode"):
        values["nodePools"][role]["instanceType"] = "g5.12xlarge"
        values["serving"][role]["tensorParallelSize"] = 4
    with pytest.raises(ConfigError, match="14 attention heads, which TP 4 does not divide"):
        _load(values, secrets)


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
def test_shipped_stacks_fit(stack):
    values, secrets = _values(stack)
    p = planning.plan(_load(values, secrets))
    assert p.fit_checked and p.problems == ()


# --- unknown models ----------------------------------------------------------------------
def test_unknown_model_skips_the_fit_check_and_says_so():
    values, secrets = _values("staging")
    values["serving"]["model"]["source"] = "acme/giant-model-1T"
    for role in ("prefill", "decode"):
        values["nodePools"][role]["instanceType"] = "p4d.24xlarge"
        values["serving"][role]["tensorParallelSize"] = 1
    config = _load(values, secrets)  # nothing to check it against: no error
    assert fit.fit_errors(config.serving, {"prefill": lookup("g5.xlarge"), "decode": lookup("g5.xlarge")}) == []
    p = planning.plan(config)
    assert p.shape is None and not p.fit_checked
    assert all(r.figures is None for r in p.roles)
    text = planning.format_plan(p)
    assert "'giant-model-1t' is not in the planner's built-in catalog" in text
    assert "set serving.model.architecture" in text
    assert "Fit check skipped" in text
    assert "Fit      not checked (model shape unknown)" in text


def test_unknown_model_with_an_architecture_is_checked():
    values, secrets = _values("staging")
    values["serving"]["model"]["source"] = "acme/giant-model-1T"
    values["serving"]["model"]["architecture"] = {
        "parametersBillions": 1000,
        "numLayers": 120,
        "hiddenSize": 16384,
        "numAttentionHeads": 128,
        "numKvHeads": 8,
    }
    with pytest.raises(
        ConfigError,
        match=r"serving\.prefill\.tensorParallelSize: llama-3.1-70b-instruct "
        r"in bfloat16 needs 232\.8 GiB of weights per GPU at TP 8 x PP 1",
    ):
        _load(values, secrets)
