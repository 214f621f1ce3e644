"""`make serve PD_MODELS=2|3` (local/config.py): the many-model form rendered for this machine.

The expectations come from what many models mean locally (the tiny model P/D as before, a second
tiny model aggregated with the project's own LoRA adapter, one front door) and from the spec's
one-model render of the same model, not from the many-model renderer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from local import config as local_config
from serving.spec import APP_NAME, MODEL_APP_PREFIX, MODELS_MODE, Mode

MODEL_DIR = Path("/models/tiny")
LORA = "s3://pd-local-lora/tiny-llama"


def _apps(models: int, **kw) -> dict[str, dict]:
    rendered = local_config.render_local_config(
        "disaggregated", MODEL_DIR, port=8000, models=models, lora_path=LORA, **kw
    )
    return {a["name"]: a for a in rendered["applications"]}


def test_two_models_are_one_front_door_and_an_application_each():
    apps = _apps(2)
    assert list(apps) == [APP_NAME, MODEL_APP_PREFIX + "tiny-llama", MODEL_APP_PREFIX + "tiny-llama-b"]
    front = apps[APP_NAME]
    assert front["route_prefix"] == "/" and front["args"]["mode"] == MODELS_MODE
    rows = front["deployments"][0]["user_config"]["models"]
    assert [(r["model_id"], r["mode"], r["lora_path"]) for r in rows] == [
        ("tiny-llama", "disaggregated", None),
        ("tiny-llama-b", "aggregated", LORA),
    ]
    assert all(a["route_prefix"] is None for n, a in apps.items() if n != APP_NAME)


def test_the_first_model_keeps_the_engines_of_the_one_model_stack():
    """PD_MODELS=2 adds a model; the tiny model's own engines are those `make serve` runs."""
    apps = _apps(2)
    one = local_config.local_spec(Mode.DISAGGREGATED, MODEL_DIR).app_args(local_config.local_target())
    mine = apps[MODEL_APP_PREFIX + "tiny-llama"]["args"]
    assert mine["prefill_config"] == one["prefill_config"]
    assert mine["decode_config"] == one["decode_config"]


def test_the_second_model_is_aggregated_on_the_decode_node_with_the_lora_adapters():
    (engine,) = _apps(2)[MODEL_APP_PREFIX + "tiny-llama-b"]["args"]["llm_configs"]
    assert engine["model_loading_config"]["model_id"] == "tiny-llama-b"
    assert engine["lora_config"]["dynamic_lora_loading_path"] == LORA
    assert engine["engine_kwargs"]["enable_lora"] is True and engine["engine_kwargs"]["max_lora_rank"] == 8
    assert engine["deployment_config"]["placement_group_bundle_label_selector"] == [
        {"pd-inference/node-group": "decode"}
    ]


def test_a_third_model_changes_only_the_front_doors_user_config_and_starts_at_zero():
    two, three = _apps(2), _apps(3)
    for name, app in two.items():
        if name != APP_NAME:
            assert three[name] == app, name
    assert three[APP_NAME]["args"] == two[APP_NAME]["args"]
    (engine,) = three[MODEL_APP_PREFIX + "tiny-llama-c"]["args"]["llm_configs"]
    scaling = engine["deployment_config"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"]) == (0, 0)


def test_a_fallback_maps_every_model_to_the_providers():
    hybrid = {"fallback": {"baseUrl": "http://127.0.0.1:9/v1", "model": "their-tiny"}}
    user_config = _apps(2, hybrid=hybrid)[APP_NAME]["deployments"][0]["user_config"]
    assert user_config["fallback"]["models"] == {"tiny-llama": "their-tiny", "tiny-llama-b": "their-tiny"}


def test_many_models_serve_the_tiny_model_disaggregated_only():
    with pytest.raises(local_config.LocalConfigError, match="PD_MODELS=2 serves the tiny model disaggregated"):
        local_config.render_local_config("both", MODEL_DIR, port=8000, models=2, lora_path=LORA)


def test_the_config_passes_ray_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(
        local_config.render_local_config("disaggregated", MODEL_DIR, port=8000, models=3, lora_path=LORA)
    )
