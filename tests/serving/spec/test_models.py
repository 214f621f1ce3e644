"""serving.models: several models behind one front door, each a complete spec; LoRA per model.

What flows through here: `serving:` values in the one-model and the many-model form ->
ServingSpec -> its rendered app args, checked against Ray Serve LLM 2.60's own validators
(LLMConfig, and the P/D builder's PDServingArgs) where the rule is Ray's.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.spec import APP_NAME, MODELS_MODE, Mode, ServingSpec, Target
from serving.spec.models import PER_MODEL_KEYS, ModelEntry

PD = {"model": {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct"}}
AGG = {
    "model": {"id": "qwen", "source": "Qwen/Qwen2.5-7B-Instruct"},
    "mode": "aggregated",
    "pools": {"decode": "general"},
    "lora": {"adaptersPath": "s3://acme-models/adapters/qwen/", "maxAdaptersPerReplica": 8},
}
GPU = Target(accelerator_type="L40S")


def _many(*entries, **shared):
    return ServingSpec.model_validate({"models": list(entries), **shared})


def _error(data) -> str:
    with pytest.raises(ValidationError) as e:
        ServingSpec.model_validate(data)
    return str(e.value.errors()[0]["msg"])


def test_one_model_form_serves_itself_and_renders_as_before():
    spec = ServingSpec.model_validate(PD)
    assert spec.served == (spec,) and not spec.many
    args = spec.app_args(GPU)
    assert args["mode"] == "disaggregated" and "models" not in args
    assert {"prefill_config", "decode_config"} <= set(args)


def test_each_entry_is_served_with_its_own_mode_and_pools():
    spec = _many(PD, AGG)
    llama, qwen = spec.served
    assert (llama.model.id, llama.mode, llama.pool_of("prefill"), llama.pool_of("decode")) == (
        "llama",
        Mode.DISAGGREGATED,
        "prefill",
        "decode",
    )
    assert (qwen.model.id, qwen.mode, qwen.pool_of("decode")) == ("qwen", Mode.AGGREGATED, "general")


def _apps(spec):
    return {a["name"]: a for a in spec.serve_config(GPU)["applications"]}


def test_many_models_render_a_front_door_and_one_application_per_model_on_its_pool():
    apps = _apps(_many(PD, AGG))
    front = apps.pop(APP_NAME)
    assert front["route_prefix"] == "/" and front["args"]["mode"] == MODELS_MODE
    table = front["deployments"][0]["user_config"]["models"]
    assert [(m["model_id"], m["mode"]) for m in table] == [("llama", "disaggregated"), ("qwen", "aggregated")]
    assert {m["app_name"] for m in table} == set(apps)
    llama, qwen = (apps[m["app_name"]] for m in table)
    assert llama["route_prefix"] is None and {"prefill_config", "decode_config"} <= set(llama["args"])
    assert len(qwen["args"]["llm_configs"]) == 1
    selector = qwen["args"]["llm_configs"][0]["deployment_config"]["placement_group_bundle_label_selector"]
    assert selector == [{"pd-inference/node-group": "general"}]


def test_the_rendered_serve_config_passes_serves_own_schema():
    from ray.serve.schema import ServeDeploySchema

    config = _many(PD, AGG).serve_config(GPU)
    parsed = ServeDeploySchema.model_validate(config)
    assert len(parsed.applications) == 3


def test_adding_a_model_keeps_every_other_applications_code_version():
    """Ray 2.60 replaces an application's replicas when its code version changes
    (ray/serve/_private/application_state.py apply_app_config; the version hashes import_path,
    runtime_env and args: deploy_utils.get_app_code_version). Adding a model must leave the
    front door's and the other models' versions as they were."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def versions(spec):
        return {
            a["name"]: get_app_code_version(ServeApplicationSchema.model_validate(a))
            for a in spec.serve_config(GPU)["applications"]
        }

    mistral = {"model": {"id": "mistral", "source": "mistralai/Mistral-7B-Instruct-v0.3"}, "mode": "aggregated"}
    before, after = versions(_many(PD, AGG)), versions(_many(PD, AGG, mistral))
    assert set(after) - set(before) == {"llm-model-mistral"}
    assert {k: after[k] for k in before} == before


def test_both_forms_at_once_is_one_error_naming_the_keys():
    msg = _error({**PD, "models": [AGG]})
    assert "exclusive" in msg and "model" in msg


def test_a_bad_entry_names_its_index_and_model():
    bad = {**PD, "model": {"id": "bad", "source": "o/b"}, "decode": {"pipelineParallelSize": 2}}
    msg = _error({"models": [AGG, bad]})
    assert msg.startswith("Value error, @serving.models[1] (bad)@") and "pipelineParallelSize" in msg


def test_a_model_id_listed_twice_is_refused():
    assert "listed twice" in _error({"models": [PD, PD]})


def test_fallback_maps_each_model_and_names_no_stranger():
    fb = {"baseUrl": "https://api.example.com/v1", "model": {"llama": "gpt-x"}}
    spec = _many(PD, AGG, fallback=fb)
    llama, qwen = spec.served
    assert llama.fallback is not None and qwen.fallback is None
    stray = {**fb, "model": {"nope": "gpt-x"}}
    assert "'nope' is not the id of a model" in _error({"models": [PD, AGG], "fallback": stray})


def test_model_entry_has_exactly_the_per_model_keys_of_the_one_model_form():
    aliases = {f.alias or n for n, f in ModelEntry.model_fields.items()}
    assert aliases == set(PER_MODEL_KEYS)
    top = {f.alias or n for n, f in ServingSpec.model_fields.items()}
    assert set(PER_MODEL_KEYS) <= top


def test_lora_renders_ray_lora_config_and_vllm_switches():
    (_, qwen) = _many(PD, AGG).served
    cfg = qwen.model_app_args(GPU)["llm_configs"][0]
    assert cfg["lora_config"] == {
        "dynamic_lora_loading_path": "s3://acme-models/adapters/qwen",
        "max_num_adapters_per_replica": 8,
    }
    kw = cfg["engine_kwargs"]
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16 and kw["max_loras"] <= 8


def test_lora_rank_vllm_does_not_accept_is_refused():
    bad = {**AGG, "lora": {"adaptersPath": "s3://acme-models/a", "maxLoraRank": 12}}
    assert "not a rank vLLM accepts" in _error({"models": [bad]})


def test_lora_switches_cannot_be_forked_through_engine_kwargs():
    msg = _error({**PD, "engineKwargs": {"enable_lora": True}})
    assert "enable_lora" in msg and "lora" in msg


def test_rendered_configs_pass_ray_serve_llm_validators():
    """Ray 2.60's own models: LLMConfig per aggregated model (lora_config included), and the P/D
    builder's PDServingArgs, which requires the same LoRA path on both legs
    (ray/llm/_internal/serve/serving_patterns/prefill_decode/builder.py _validate_lora_configs)."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
    from ray.serve.llm import LLMConfig

    pd_lora = {**PD, "lora": {"adaptersPath": "s3://acme-models/adapters/llama"}}
    llama, qwen = (m.model_app_args(GPU) for m in _many(pd_lora, AGG).served)
    assert llama["prefill_config"]["lora_config"] == llama["decode_config"]["lora_config"]
    PDServingArgs.model_validate({"prefill_config": llama["prefill_config"], "decode_config": llama["decode_config"]})
    parsed = LLMConfig.model_validate(qwen["llm_configs"][0])
    assert parsed.lora_config.max_num_adapters_per_replica == 8


def test_a_data_parallel_pd_model_is_refused_in_the_many_model_form_naming_it():
    """build_model_app composes the resilient P/D tiers, which do not cover Ray's DP P/D
    servers; the config says so before anything is rendered."""
    big = {**PD, "decode": {"dataParallelSize": 2}}
    msg = _error({"models": [AGG, big]})
    assert "serving.models[1] (llama).decode.dataParallelSize" in msg and "without data parallelism" in msg
    # the same model alone, in the one-model form, is not refused for it
    assert ServingSpec.model_validate({**PD, "decode": {"dataParallelSize": 2}}).decode.data_parallel_size == 2
