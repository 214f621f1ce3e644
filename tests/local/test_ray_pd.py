"""local/ray_pd.py: `--mode ray-pd` deploys Ray Serve LLM's own P/D app on our P/D app's engines.

Contract (Ray 2.60, ray/llm/_internal/serve/serving_patterns/prefill_decode/builder.py):
`build_pd_openai_app` takes PDServingArgs (prefill_config, decode_config, ingress_cls_config,
ingress_deployment_config; unknown keys refused) and builds OpenAiIngress -> PDDecodeServer ->
PDPrefillServer. What it is given is checked here with Ray's own PDServingArgs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from local.background import plan_stack
from local.config import LocalConfigError, app_urls, stack_ray_env
from local.ray_pd import (
    RAY_EXPERIMENTAL_KEYS,
    RAY_PD_IMPORT_PATH,
    RAY_PD_MODE,
    names_ours,
    stock_config,
    stock_ray_env,
)
from serving.spec.base import ENGINE_CLS_ENV, FIRST_CHUNK_KEY
from tests.bench.dry_run import CLEAN_ENV

MODEL_DIR = Path("/models/plan")


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _plan(mode: str, *extra: str, api_key: str | None = None):
    return plan_stack(mode=mode, api_key=api_key, extra_args=["--fixed-replicas", *extra], environ=CLEAN_ENV)


def test_ray_pd_is_rays_builder_on_our_pd_engines_without_our_code():
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    ours = _plan("disaggregated").config["applications"][0]
    theirs = _plan(RAY_PD_MODE).config["applications"][0]
    assert theirs["import_path"] == RAY_PD_IMPORT_PATH and "deployments" not in theirs
    assert (theirs["name"], theirs["route_prefix"]) == (ours["name"], ours["route_prefix"])
    PDServingArgs.model_validate(theirs["args"])  # what Ray's builder takes, nothing more
    # The same engines: engine kwargs, environment, placement, accelerator, Serve options.
    for role in ("prefill_config", "decode_config"):
        mine, stock = ours["args"][role], theirs["args"][role]
        for key in ("model_loading_config", "engine_kwargs", "runtime_env", "accelerator_config"):
            assert stock[key] == mine[key], (role, key)
        dep = {k: v for k, v in mine["deployment_config"].items() if k != "autoscaling_config"}
        assert {k: v for k, v in stock["deployment_config"].items() if k != "autoscaling_config"} == dep
        mine_auto = dict(mine["deployment_config"]["autoscaling_config"])
        assert mine_auto.pop("policy")["policy_function"].startswith("serving.")  # ours: left out
        assert stock["deployment_config"]["autoscaling_config"] == mine_auto
        assert stock["experimental_configs"] == {
            k: v for k, v in mine["experimental_configs"].items() if k in RAY_EXPERIMENTAL_KEYS
        }
    assert theirs["args"]["ingress_deployment_config"] == ours["args"]["ingress_deployment_config"]
    # Nothing of ours: no import path into serving/, no key only our code reads.
    assert [s for s in _strings(theirs) if names_ours(s)] == []
    assert FIRST_CHUNK_KEY not in json.dumps(theirs)
    assert [s for s in _strings(ours) if names_ours(s)]  # the check sees ours where it is


def test_its_ray_nodes_build_rays_own_engine_class_and_keep_the_rest():
    env = stack_ray_env(None)
    assert names_ours(env[ENGINE_CLS_ENV])
    assert stock_ray_env(env) == {k: v for k, v in env.items() if k != ENGINE_CLS_ENV}
    assert _plan(RAY_PD_MODE).ray_env == {
        k: v for k, v in _plan("disaggregated").ray_env.items() if k != ENGINE_CLS_ENV
    }


def test_its_url_and_its_one_line_refusals():
    config = _plan(RAY_PD_MODE).config
    assert app_urls(config, 8000) == {RAY_PD_MODE: "http://127.0.0.1:8000/v1"}
    # Ray's ingress checks no keys: asked for one, the run stops with one line saying so.
    with pytest.raises(
        LocalConfigError,
        match=r"^--mode ray-pd serves Ray Serve LLM's own app, which checks no API keys: add --no-auth$",
    ):
        _plan(RAY_PD_MODE, api_key="sk-x")
    both = _plan("both").config
    with pytest.raises(ValueError, match="takes the one-model disaggregated app, not 2 applications"):
        stock_config(both)


def _ray_llm_source() -> str:
    import ray.llm

    root = Path(ray.llm.__file__).parent / "_internal" / "serve"
    return "\n".join(p.read_text() for p in root.rglob("*.py") if "tests" not in p.parts)


def test_the_experimental_keys_kept_are_rays_and_those_left_out_are_ours():
    """Ray Serve LLM 2.60's own source (ray/llm/_internal/serve/) names every key kept, and none
    of the keys our render sets that are left out (those only serving/engines reads)."""
    source = _ray_llm_source()
    assert [k for k in sorted(RAY_EXPERIMENTAL_KEYS) if f'"{k}"' not in source] == []
    configs = [
        c
        for mode in ("disaggregated", "aggregated")
        for app in _plan(mode, "--prefill-router", "kv-aware").config["applications"]
        for c in (
            app["args"].get("prefill_config"),
            app["args"].get("decode_config"),
            *(app["args"].get("llm_configs") or []),
        )
        if c
    ]
    ours = {k for c in configs for k in c.get("experimental_configs", {})} - RAY_EXPERIMENTAL_KEYS
    assert FIRST_CHUNK_KEY in ours  # our engine mixin's switch is among them
    assert [k for k in sorted(ours) if f'"{k}"' in source] == []
