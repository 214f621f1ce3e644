"""One cluster, many models: named node pools, every model placed on its pools, cost per model and pool.

What flows through here: the shipped platform stack (stacks/Pulumi.platform.yaml) and changed
copies of its values -> infra.config.load (one line naming the model, role and pool on
error) -> infra.plan.model_plans (cost per model and per pool, from the catalog's prices).
"""

from __future__ import annotations

import copy

import pytest

from infra import catalog
from infra.config import ConfigError, load
from infra.plan.model_plans import format_stack_plan, model_costs, pool_costs
from infra.sizing import nodes as sizing
from tools import stackfile

SOURCE = "stacks/Pulumi.platform.yaml"


@pytest.fixture(scope="module")
def parsed():
    return stackfile.read("platform")


def _load(parsed, mutate=None):
    values, secrets, others = copy.deepcopy(parsed)
    if mutate:
        mutate(values)
    return stackfile.load_offline(values, secrets, others, SOURCE).config


def _refusal(parsed, mutate) -> str:
    with pytest.raises(ConfigError) as e:
        _load(parsed, mutate)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_platform_stack_serves_a_pd_model_and_an_aggregated_model_with_adapters(parsed):
    cfg = _load(parsed)
    modes = {m.model.id: m.mode.value for m in cfg.serving.served}
    assert sorted(modes.values()) == ["aggregated", "disaggregated"]
    agg = next(m for m in cfg.serving.served if m.mode.value == "aggregated")
    assert agg.lora is not None and agg.lora.adapters_path.startswith("s3://")


def test_platform_stacks_example_key_may_use_the_qwen_and_its_adapters_only(parsed):
    """What the stack file's comment on serving.limits promises, read as the ingress reads it."""
    from serving.ingress.limits import KeyLimit, LimitsConfig

    limits = LimitsConfig.from_user_config(_load(parsed).serving.ingress_user_config()["limits"])
    example, other = "k-0123456789ab", "k-ffffffffffff"
    assert limits.may_use(example, "qwen2.5-7b-instruct:support-bot")
    assert not limits.may_use(example, "llama-3.1-8b-instruct")
    assert limits.for_key(example, "qwen2.5-7b-instruct") == KeyLimit(30, 0)
    assert limits.may_use(other, "llama-3.1-8b-instruct") and limits.may_use(other, "qwen2.5-7b-instruct")
    assert limits.for_key(other, "llama-3.1-8b-instruct") == KeyLimit(120, 200_000)
    assert limits.for_key(other, "qwen2.5-7b-instruct").unlimited


def test_unknown_pool_is_one_error_naming_model_role_and_pool(parsed):
    def point_at_missing(values):
        values["serving"]["models"][1]["pools"] = {"decode": "gpu-huge"}

    msg = _refusal(parsed, point_at_missing)
    assert msg.startswith(f"{SOURCE}: serving.models[1] (qwen2.5-7b-instruct).pools.decode: ")
    assert "'gpu-huge'" in msg and "decode role" in msg


def test_bad_entry_key_names_the_model(parsed):
    def bad_tp(values):
        values["serving"]["models"][0]["prefill"] = {"tensorParallelSize": 3}

    msg = _refusal(parsed, bad_tp)
    assert msg.startswith(f"{SOURCE}: serving.models[0] (llama-3.1-8b-instruct).prefill.tensorParallelSize: ")


def test_both_forms_is_refused_in_one_line(parsed):
    def both(values):
        values["serving"]["model"] = {"id": "x", "source": "o/x"}

    assert "exclusive" in _refusal(parsed, both)


def test_a_shared_pool_too_small_for_its_models_is_refused_naming_pool_and_models(parsed):
    def crowd(values):
        extra = {"model": {"id": "mistral", "source": "mistralai/Mistral-7B-Instruct-v0.3"}, "mode": "aggregated"}
        extra["pools"] = {"decode": "general"}
        extra["decode"] = {"maxReplicas": 3}
        values["serving"]["models"].append(extra)

    msg = _refusal(parsed, crowd)
    assert msg.startswith(f"{SOURCE}: nodePools.general.maxSize: ")
    assert "mistral" in msg and "qwen2.5-7b-instruct" in msg


def test_a_model_that_does_not_fit_its_pool_is_refused_naming_model_and_pool(parsed):
    def too_big(values):
        values["serving"]["models"][1]["model"] = {"id": "qwen72", "source": "Qwen/Qwen2.5-72B-Instruct"}
        values["serving"].pop("limits", None)  # they name the replaced model's id

    msg = _refusal(parsed, too_big)
    assert "serving.models[1] (qwen72)" in msg and "(pool general)" in msg


def test_lora_adapters_outside_the_model_bucket_are_refused(parsed):
    def elsewhere(values):
        values["serving"]["models"][1]["lora"]["adaptersPath"] = "s3://other-bucket/adapters"

    msg = _refusal(parsed, elsewhere)
    assert "modelBucket" in msg and "adaptersPath" in msg


def test_one_model_stacks_still_need_their_prefill_and_decode_pools():
    values, secrets, others = stackfile.read("dev")
    values = copy.deepcopy(values)
    del values["nodePools"]["decode"]
    with pytest.raises(ConfigError) as e:
        load(values, secret_keys=secrets | {"apiKeys"}, source="stacks/Pulumi.dev.yaml", region=others["aws:region"])
    assert "nodePools.decode: required key is missing" in str(e.value)


def test_cost_per_pool_is_its_nodes_at_the_catalog_price(parsed):
    cfg = _load(parsed)
    rows = {p.name: p for p in pool_costs(cfg)}
    assert set(rows) == set(cfg.node_pools.names())
    for name, pool in cfg.node_pools:
        price = catalog.lookup(pool.instance_type).usd_per_hour
        assert rows[name].usd_per_hour_max == pytest.approx(pool.max_size * price)
    assert any("qwen2.5-7b-instruct" in u for u in rows["general"].models)


def test_cost_per_model_counts_only_its_own_replicas(parsed):
    cfg = _load(parsed)
    costs = {c.model_id: c for c in model_costs(cfg)}
    for spec in cfg.serving.served:
        want = 0.0
        for role, rs in spec.engine_roles().items():
            inst = cfg.node_pools[spec.pool_of(role)].instance
            want += sizing.nodes_for(rs.max_replicas, rs.gpus_per_replica, inst.gpus) * inst.usd_per_hour
        assert costs[spec.model.id].usd_per_hour_max == pytest.approx(want)


def test_plan_text_has_every_model_and_every_pool(parsed):
    cfg = _load(parsed)
    text = format_stack_plan(cfg)
    for spec in cfg.serving.served:
        assert f"=== model {spec.model.id}" in text
    for name in cfg.node_pools.names():
        assert f"  {name} " in text


def test_pd_roles_sharing_one_efa_pool_are_refused_with_the_upstream_reason():
    values, secrets, others = copy.deepcopy(stackfile.read("staging"))
    values["serving"]["pools"] = {"prefill": "decode"}
    with pytest.raises(ConfigError) as e:
        stackfile.load_offline(values, secrets, others, "stacks/Pulumi.staging.yaml")
    assert "serving.pools: prefill and decode of 'llama-3.1-70b-instruct' share the EFA pool decode" in str(e.value)
    assert "dynamo#7764" in str(e.value)


def _pools_renamed(values):
    """The platform stack with no pool named prefill or decode: every role names its pool."""
    pools = values["nodePools"]
    pools["pd-a"], pools["pd-b"] = pools.pop("prefill"), pools.pop("decode")
    for entry in values["serving"]["models"]:
        if entry.get("mode", "disaggregated") == "disaggregated":
            entry["pools"] = {"prefill": "pd-a", "decode": "pd-b"}


def test_pools_of_any_name_plan_and_size_the_head_without_a_traceback(parsed):
    """A model's roles may run on pools with any names: the plan, the head sizing and the cold
    start read each role's own pool (they once looked pools up by the role's name)."""
    from infra.plan.planning import cold_start_seconds, stack_head

    cfg = _load(parsed, _pools_renamed)
    text = format_stack_plan(cfg)
    assert "pd-a" in text and "pd-b" in text
    assert stack_head(cfg) is not None
    assert isinstance(cold_start_seconds(cfg), dict)


def test_the_head_is_sized_for_every_model_behind_the_front_door(parsed):
    """The planned rate of the one front door is the sum of each model's own planned rate, each
    model planned as a one-model stack of its own (its entry's keys at the top of serving)."""
    from infra.plan.planning import plan, stack_head

    def alone(index: int):
        def mutate(values):
            serving = values["serving"]
            entry = serving.pop("models")[index]
            limits = serving.pop("limits", None)  # they name both models
            serving.update(entry)
            if limits:
                serving["limits"] = {k: v for k, v in limits.items() if k not in ("keys", "models")}
            serving.pop("fallback", None)

        return _load(parsed, mutate)

    both = stack_head(_load(parsed))
    singles = [plan(alone(i)).head for i in range(2)]
    assert both is not None and all(h is not None for h in singles)
    assert both.planned_rps == pytest.approx(sum(h.planned_rps for h in singles))
    # (the weighted CPU-ms per request is rounded to 0.01 ms for the message)
    assert both.busy_vcpus == pytest.approx(sum(h.busy_vcpus for h in singles), rel=1e-3)
    assert both.head_vcpus >= max(h.head_vcpus for h in singles)
