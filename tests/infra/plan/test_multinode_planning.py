"""Multi-node layouts in the planner: DeepSeek-V3 (MoE, MLA, FP8) and PP / DP + EP, by hand.

Every expected figure below is written out from the published numbers (the model's config.json,
AWS's instance specifications), not from the planner's own helpers.
"""

from __future__ import annotations

import pytest

from infra.catalog import lookup
from infra.config import ConfigError, load
from infra.plan import planning
from infra.sizing import fit
from serving.spec import ModelSpec, MoeParallelism, RoleSpec, ServingSpec
from tools.stackfile import read_as_deployed

GIB = 2**30
DS = fit.BUILTIN_MODELS["deepseek-v3"]
# config.json: 61 layers, 3 dense (first_k_dense_replace), 256 routed experts of
# 3 x 7168 x 2048 (gate, up, down; moe_intermediate_size 2048)
EXPERT_PARAMS = 58 * 256 * 3 * 7168 * 2048  # = 653,908,770,816
DENSE_PARAMS = 671e9 - EXPERT_PARAMS
MLA_BYTES_PER_TOKEN_LAYER = (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, bf16
H100_USABLE_GIB = 81559 / 1024 * 0.9  # nvidia-smi MiB of p5's H100, gpuMemoryUtilization 0.9
H200_USABLE_GIB = 143771 / 1024 * 0.9


def _ds(max_model_len: int = 32768) -> ModelSpec:
    return ModelSpec(id="deepseek-v3", source="deepseek-ai/DeepSeek-V3", max_model_len=max_model_len)


def _role(tp: int = 1, pp: int = 1, dp: int = 1, ep: bool = False) -> RoleSpec:
    return RoleSpec(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        moe_parallelism=MoeParallelism.EXPERT if ep else MoeParallelism.TENSOR,
    )


def test_catalog_entry_is_the_published_config():
    assert DS.parameters_billions == 671.0 and DS.active_parameters_billions == 36.7
    assert (DS.num_layers, DS.hidden_size, DS.num_attention_heads) == (61, 7168, 128)
    assert (DS.routed_experts, DS.experts_per_token, DS.moe_layers) == (256, 8, 58)
    assert DS.expert_parameters_billions * 1e9 == pytest.approx(EXPERT_PARAMS) == 653_908_770_816
    assert DS.mla_kv_dim == 576 and DS.weight_bytes_per_param == 1.0
    # MLA: one 576-element latent per token and layer, the same on every TP rank
    assert DS.kv_bytes_per_token(2) == 61 * 1152 == 70_272
    assert DS.kv_bytes_per_token_per_gpu(2, tp=8, pp=1) == 70_272
    assert DS.kv_bytes_per_token_per_gpu(2, tp=8, pp=2) == 31 * 1152 == 35_712
    assert fit.match_builtin("deepseek-ai/DeepSeek-R1-0528")[0] is not None
    assert fit.match_builtin("deepseek-ai/DeepSeek-V3.2-Exp")[0] is None  # a different attention


def test_prefill_tp8_pp2_on_p5_by_hand():
    figs = fit.model_figures(DS, _ds(), "prefill", _role(tp=8, pp=2), lookup("p5.48xlarge"))
    weights = 671e9 * 1 / 16 / GIB  # FP8, 16 GPUs
    assert figs.weights_gib_per_gpu == pytest.approx(weights) == pytest.approx(39.0573, abs=1e-4)
    kv = H100_USABLE_GIB - weights - 2.0
    assert figs.kv_gib_per_gpu == pytest.approx(kv) == pytest.approx(30.625, abs=1e-3)
    assert figs.kv_bytes_per_token_per_gpu == 35_712
    assert figs.kv_tokens_per_replica == int(kv * GIB // 35_712) == 920_803
    # pipeline: 1 of 2 stages busy with one batch; one stage boundary of 7168 bf16 per token
    assert figs.pp_bubble_fraction == 0.5
    assert figs.pp_hop_bytes == 32768 * 7168 * 2 == 469_762_048
    # at the replica's share of its nodes' EFA: 8 of 8 GPUs of one node, 3200 Gbps
    assert figs.pp_hop_seconds == pytest.approx(469_762_048 / 400e9)
    assert figs.ep_bytes_per_token is None and not figs.problems


def test_one_p5_node_cannot_hold_deepseek_v3():
    figs = fit.model_figures(DS, _ds(), "decode", _role(tp=8), lookup("p5.48xlarge"))
    # 671e9 B / 8 = 78.1 GiB per GPU > 71.7 usable
    assert figs.weights_gib_per_gpu == pytest.approx(671e9 / 8 / GIB) == pytest.approx(78.115, abs=1e-3)
    assert [k for k, _ in figs.problems] == ["serving.decode.tensorParallelSize"]
    assert "dataParallelSize and moeParallelism: expert" in figs.problems[0][1]
    assert fit.exceeds_one_node(DS, _ds(), lookup("p5.48xlarge"))  # 624.9 GiB > 8 x 71.7
    assert not fit.exceeds_one_node(DS, _ds(), lookup("p5en.48xlarge"))  # < 8 x 126.4


def test_decode_dp16_ep_over_two_p5_nodes_by_hand():
    figs = fit.model_figures(DS, _ds(), "decode", _role(dp=16, ep=True), lookup("p5.48xlarge"), context_len=4096)
    # every rank holds the dense part whole (TP 1) and 1/16 of the routed experts
    weights = (DENSE_PARAMS + EXPERT_PARAMS / 16) / GIB
    assert figs.weights_gib_per_gpu == pytest.approx(weights) == pytest.approx(53.979, abs=1e-3)
    kv = H100_USABLE_GIB - weights - 2.0
    per_rank = int(kv * GIB // 70_272)
    assert figs.kv_tokens_per_replica == 16 * per_rank
    # all-gather + reduce-scatter of a 7168 bf16 hidden state, to the one other node, per MoE layer
    assert figs.ep_nodes == 2
    assert figs.ep_bytes_per_token == 58 * 2 * 1 * 7168 * 2 == 1_662_976
    assert figs.ep_tokens_per_s_per_node == pytest.approx(400e9 / 1_662_976)  # ~240,533
    # decode roofline, batch 1: a rank reads the dense weights, the experts the token touches
    # (8 of 256) of its 1/16 share, and 1/16 of one sequence's KV; one stage
    per_gpu = DENSE_PARAMS + EXPERT_PARAMS * (8 / 256) / 16 + (1 / 16) * 4096 * 70_272
    assert figs.decode_tokens_per_s_batch1 == pytest.approx(1 / (per_gpu / 3350e9))


def test_decode_tp8_on_one_p5en_node_by_hand():
    figs = fit.model_figures(DS, _ds(), "decode", _role(tp=8), lookup("p5en.48xlarge"), context_len=4096)
    weights = 671e9 / 8 / GIB
    kv = H200_USABLE_GIB - weights - 2.0
    assert figs.kv_tokens_per_replica == int(kv * GIB // 70_272)
    assert figs.ep_nodes is None and figs.pp_bubble_fraction is None
    # batch 64: experts touched = 1 - (1 - 8/256)^64 of them, read by 8 GPUs in parallel
    touched = 1 - (1 - 8 / 256) ** 64
    per_gpu = DENSE_PARAMS / 8 + EXPERT_PARAMS * touched / 8 + 64 * 4096 * 70_272
    rate = 64 / (per_gpu / 4800e9)
    assert fit.expert_fraction_read(64, 256, 8) == pytest.approx(touched)
    figs64 = fit.model_figures(
        DS, _ds(), "decode", _role(tp=8), lookup("p5en.48xlarge"), context_len=4096, max_num_seqs=64
    )
    assert figs64.max_batch == 64
    assert figs64.decode_tokens_per_s_max_batch == pytest.approx(rate)


def test_dense_roofline_is_unchanged_by_the_moe_terms():
    """A dense model's figures follow the original formula: (W + B x ctx x KV) / (TP x HBM)."""
    shape = fit.BUILTIN_MODELS["llama-3-70b"]
    figs = fit.model_figures(
        shape,
        ModelSpec(id="m", source="meta-llama/Llama-3.3-70B-Instruct"),
        "decode",
        _role(tp=8),
        lookup("p5.48xlarge"),
        context_len=8192,
    )
    w = 70.6e9 * 2
    kv_gpu = 2 * 80 * 1 * 128 * 2
    assert figs.decode_tokens_per_s_batch1 == pytest.approx(1 / ((w + 8192 * kv_gpu * 8) / (8 * 3350e9)))


def test_layouts_for_deepseek_on_p5():
    opts = fit.propose_layouts(DS, _ds(), lookup("p5.48xlarge"), "decode")
    labels = [o.label for o in opts]
    assert "TP 1 x PP 1 x DP 16 + EP" in labels and "TP 8 x PP 1 x DP 2 + EP" in labels
    assert all(o.pipeline_parallel_size == 1 for o in opts), "decode PP must stay 1"
    assert "TP 8 x PP 1" not in labels  # one node does not hold it
    dp16 = opts[labels.index("TP 1 x PP 1 x DP 16 + EP")]
    assert (dp16.gpus, dp16.nodes, dp16.usd_per_hour) == (16, 2, pytest.approx(2 * 55.04))
    assert dp16.stack_keys() == {"tensorParallelSize": 1, "dataParallelSize": 16, "moeParallelism": "expert"}
    prefill = [o.label for o in fit.propose_layouts(DS, _ds(), lookup("p5.48xlarge"), "prefill")]
    assert "TP 8 x PP 2" in prefill


def test_a_dense_405b_on_p5_gets_prefill_pp_and_no_decode_layout():
    shape = fit.BUILTIN_MODELS["llama-3.1-405b"]
    model = ModelSpec(id="m", source="meta-llama/Llama-3.1-405B-Instruct", max_model_len=8192)
    p5 = lookup("p5.48xlarge")
    assert fit.exceeds_one_node(shape, model, p5)  # 405.9e9 x 2 B = 756 GiB > 573
    assert fit.propose_layouts(shape, model, p5, "prefill")[0].label == "TP 8 x PP 2"
    assert fit.propose_layouts(shape, model, p5, "decode") == []  # PP 1, no experts to spread


def test_expert_parallel_on_a_dense_model_is_refused():
    figs = fit.model_figures(
        fit.BUILTIN_MODELS["llama-3-8b"],
        ModelSpec(id="m", source="x/Llama-3-8B"),
        "decode",
        _role(dp=2, ep=True),
        lookup("p5.48xlarge"),
    )
    assert "serving.decode.moeParallelism" in dict(figs.problems)


def test_hetero_tp_beyond_the_kv_heads_is_refused_for_gqa_and_allowed_for_mla():
    qwen = ServingSpec.model_validate(
        {
            "model": {"id": "q", "source": "Qwen/Qwen2.5-1.5B-Instruct"},  # 12 heads, 2 KV heads
            "prefill": {"tensorParallelSize": 4},
            "decode": {"tensorParallelSize": 2},
        }
    )
    p5 = lookup("p5.48xlarge")
    errors = dict(fit.fit_errors(qwen, {"prefill": p5, "decode": p5}))
    assert "is_kv_replicated" in errors["serving.prefill.tensorParallelSize"]
    ok = qwen.model_copy(update={"decode": RoleSpec(tensor_parallel_size=4)})
    assert fit.fit_errors(ok, {"prefill": p5, "decode": p5}) == []
    ds = ServingSpec.model_validate(
        {
            "model": {"id": "d", "source": "deepseek-ai/DeepSeek-V3"},
            "prefill": {"tensorParallelSize": 8},
            "decode": {"tensorParallelSize": 1, "dataParallelSize": 8, "moeParallelism": "expert"},
        }
    )
    p5en = lookup("p5en.48xlarge")
    assert fit.fit_errors(ds, {"prefill": p5en, "decode": p5en}) == []


# --- every shipped stack with a multi-node layout ------------------------------------------
def _stacks_with_multinode_replicas() -> list[str]:
    from tools.stackfile import stacks

    found = []
    for name in stacks():
        values, secrets, others = read_as_deployed(name)
        cfg = load(values, secret_keys=secrets, source=name, region=others.get("aws:region"))
        p = planning.plan(cfg)
        if any(r.nodes_per_replica > 1 for r in p.roles):
            found.append(name)
    return found


def test_a_400b_plus_model_with_prefill_pp2_tp8_on_p5_ships_and_plans():
    from tools.stackfile import stacks

    hits = []
    for name in stacks():
        values, secrets, others = read_as_deployed(name)
        cfg = load(values, secret_keys=secrets, source=name, region=others.get("aws:region"))
        p = cfg.serving.prefill
        if (
            cfg.node_pools.prefill.instance_type == "p5.48xlarge"
            and (p.tensor_parallel_size, p.pipeline_parallel_size) == (8, 2)
            and (fit.resolve(cfg.serving.model)[0] or DS).parameters_billions >= 400
        ):
            plan = planning.plan(cfg)
            assert not plan.problems
            prefill = next(r for r in plan.roles if r.role == "prefill")
            assert prefill.nodes_per_replica == 2
            text = planning.format_plan(plan)
            assert "Layouts that fit" in text and "PP bubble" in text
            hits.append(name)
    assert hits, "no shipped stack serves a 400B+ model with prefill TP 8 x PP 2 on p5"


def test_a_decode_pp_stack_is_refused_with_vllms_reason():
    values, secrets, others = read_as_deployed(_stacks_with_multinode_replicas()[0])
    values["serving"]["decode"]["pipelineParallelSize"] = 2
    with pytest.raises(ConfigError, match=r"decode\.pipelineParallelSize = 2 is refused: .*NixlPushConnector consumer"):
        load(values, secret_keys=secrets, source="stacks/Pulumi.x.yaml", region=others.get("aws:region"))
