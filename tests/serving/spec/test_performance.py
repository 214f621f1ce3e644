"""The spec's performance and privacy settings, as Ray Serve LLM and vLLM read them.

Each rendered value is fed to the upstream object that consumes it (LLMConfig, Serve's
RequestRouterConfig, vLLM's engine args), so a setting the spec renders but Ray would
ignore or reject fails here. Nothing starts Ray.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from serving.spec import (
    EAGER_SERVER_CLS,
    PREFIX_ROUTER_CLS,
    SERVING_ENV,
    FirstChunk,
    Router,
    ServingSpec,
    Target,
)

GPU = Target(accelerator_type="H100", engine_env={"FI_PROVIDER": "efa"})


def spec(**overrides) -> ServingSpec:
    data = {"model": {"id": "m", "source": "org/model"}}
    data.update(overrides)
    return ServingSpec.model_validate(data)


def engines(args: dict) -> dict[str, dict]:
    if args["mode"] == "aggregated":
        return {"decode": args["llm_configs"][0]}
    return {"prefill": args["prefill_config"], "decode": args["decode_config"]}


def test_defaults_keep_rays_interval_and_send_the_first_chunk_eagerly():
    s = spec()
    assert s.streaming.batch_interval_ms == 50
    assert s.streaming.first_chunk is FirstChunk.EAGER
    assert s.prefill.router is Router.POWER_OF_TWO and s.decode.router is Router.POWER_OF_TWO


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_batch_interval_reaches_rays_llm_server(mode):
    """Ray 2.60 `core/server/llm_server.py` `_get_batch_interval_ms`: the interval comes from
    `experimental_configs["stream_batching_interval_ms"]`, else RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS."""
    from ray.serve.llm import LLMConfig

    args = spec(mode=mode, streaming={"batchIntervalMs": 15}).app_args(GPU)
    for cfg in engines(args).values():
        llm = LLMConfig.model_validate(copy.deepcopy(cfg))
        assert llm.experimental_configs["stream_batching_interval_ms"] == 15


def test_eager_first_chunk_is_the_aggregated_engines_server_class():
    """LLMConfig.server_cls is what Ray's `build_llm_deployment` deploys when no class is
    forced (ray/llm/_internal/serve/core/server/builder.py); the P/D builder forces
    PDDecodeServer, so the spec does not render it there."""
    from ray.serve.llm import LLMConfig

    from serving.engines.streaming import EagerLLMServer

    agg = spec(mode="aggregated").app_args(GPU)["llm_configs"][0]
    assert agg["server_cls"] == EAGER_SERVER_CLS
    assert LLMConfig.model_validate(copy.deepcopy(agg)).server_cls is EagerLLMServer
    batched = spec(mode="aggregated", streaming={"firstChunk": "batched"}).app_args(GPU)["llm_configs"][0]
    assert "server_cls" not in batched
    for cfg in engines(spec().app_args(GPU)).values():
        assert "server_cls" not in cfg


def test_prefix_router_is_rendered_per_role_and_loads_rays_public_class():
    """Serve's RequestRouterConfig (ray/serve/config.py) takes the router as an import path
    string; Ray Serve LLM's public PrefixCacheAffinityRouter lives in ray.serve.llm.request_router."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    args = spec(decode={"router": "prefix-cache-affinity", "maxReplicas": 2}).app_args(GPU)
    decode, prefill = args["decode_config"], args["prefill_config"]
    assert "request_router_config" not in prefill["deployment_config"]
    rendered = decode["deployment_config"]["request_router_config"]
    assert rendered == {"request_router_class": PREFIX_ROUTER_CLS}
    router = RequestRouterConfig(**rendered)
    assert router.get_request_router_class() is PrefixCacheAffinityRouter
    LLMConfig.model_validate(copy.deepcopy(decode))


def test_kv_aware_prefill_renders_a_kv_aware_router_for_rays_builder_and_its_ports():
    """Ray 2.60 routing_policies/kv_aware: the router is KV-aware to Ray (`is_kv_aware`: a
    KVAwareRouter subclass), Serve asks for routing stats every KV_ROUTING_STATS_PERIOD_S, and
    the port bases are Ray's experimental_configs keys (constants.py KV_EVENTS_PORT_BASE_KEY,
    KV_TOKEN_PORT_BASE_KEY). Decode and the other stacks render as before."""
    from ray.llm._internal.serve.routing_policies.kv_aware import constants
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    from serving import ray_internals as ri
    from serving.engines.kv_router import KvPrefillRouter

    args = spec(prefill={"router": "kv-aware", "maxReplicas": 2}).app_args(GPU)
    prefill, decode = args["prefill_config"], args["decode_config"]
    rendered = prefill["deployment_config"]["request_router_config"]
    assert RequestRouterConfig(**rendered).get_request_router_class() is KvPrefillRouter
    assert rendered["request_routing_stats_period_s"] < 10  # Ray's default: new replicas scored sooner
    llm = LLMConfig.model_validate(copy.deepcopy(prefill))
    assert ri.is_kv_aware(llm)
    assert llm.experimental_configs[constants.KV_EVENTS_PORT_BASE_KEY] == constants.DEFAULT_KV_EVENTS_PORT_BASE
    assert llm.experimental_configs[constants.KV_TOKEN_PORT_BASE_KEY] == constants.DEFAULT_KV_TOKEN_PORT_BASE
    assert "request_router_config" not in decode["deployment_config"]
    assert not ri.is_kv_aware(LLMConfig.model_validate(copy.deepcopy(decode)))
    assert "KV_EVENTS_PORT_BASE" not in str(spec().app_args(GPU))


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"decode": {"router": "kv-aware"}}, "decode.router"),
        ({"mode": "aggregated", "decode": {"router": "kv-aware"}}, "decode.router"),
        ({"prefill": {"router": "kv-aware", "dataParallelSize": 2}}, "data-parallel"),
        ({"prefill": {"router": "kv-aware"}, "engineKwargs": {"enable_prefix_caching": False}}, "prefix cache"),
    ],
)
def test_kv_aware_routing_where_it_cannot_work_is_refused_naming_the_key(data, where):
    with pytest.raises(ValidationError, match=where):
        spec(**data)


def test_two_kv_routed_models_get_ports_apart():
    """Two models' prefill replicas may share a node: each model's engines bind their own
    slice of ports (Ray binds base + the replica's node-local rank)."""
    from serving.spec.base import KV_PORT_STRIDE

    entry = {"mode": "disaggregated", "prefill": {"router": "kv-aware", "maxReplicas": 8}}
    s = ServingSpec.model_validate(
        {
            "models": [
                {"model": {"id": "a", "source": "org/a"}, **entry},
                {"model": {"id": "b", "source": "org/b"}, **entry},
            ]
        }
    )
    apps = s.serve_config(GPU)["applications"][1:]
    bases = [a["args"]["prefill_config"]["experimental_configs"] for a in apps]
    events = [b["KV_EVENTS_PORT_BASE"] for b in bases]
    tokens = [b["KV_TOKEN_PORT_BASE"] for b in bases]
    assert events[1] - events[0] >= 8 and tokens[1] - tokens[0] >= 8 and KV_PORT_STRIDE >= 8
    # Each model's PUB range stays below every model's replay range (PUB + 1000) and token range.
    assert max(events) + KV_PORT_STRIDE <= min(events) + 1000 <= min(tokens)


def test_unknown_router_is_refused_with_the_choices():
    with pytest.raises(ValidationError, match="power-of-two"):
        spec(decode={"router": "round-robin"})


def test_prompts_stay_out_of_the_logs():
    """Ray 2.60 engines/vllm/vllm_models.py defaults vLLM's enable_log_requests to False; the
    spec states it and refuses turning it on. vLLM's engine args accept the key."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = spec().app_args(GPU)
    for cfg in engines(args).values():
        assert cfg["engine_kwargs"]["enable_log_requests"] is False
        kwargs = {k: v for k, v in cfg["engine_kwargs"].items() if k == "enable_log_requests"}
        assert AsyncEngineArgs(model="/m", **kwargs).enable_log_requests is False
        assert cfg["runtime_env"]["env_vars"]["RAYLLM_ENABLE_REQUEST_PROMPT_LOGS"] == "0"
        assert cfg["runtime_env"]["env_vars"]["FI_PROVIDER"] == "efa"
    assert args["ingress_deployment_config"]["ray_actor_options"]["runtime_env"]["env_vars"] == SERVING_ENV
    with pytest.raises(ValidationError, match="privacy"):
        spec(engineKwargs={"enable_log_requests": True})


def test_prompt_log_switch_is_defined_but_read_nowhere_in_ray_2_60():
    """ray/llm/_internal/serve/constants.py defines RAYLLM_ENABLE_REQUEST_PROMPT_LOGS (default
    "1"); no other module of ray.llm reads it. If a Ray release starts reading it, this test
    fails and the docs' statement must change (the spec sets it to "0" either way)."""
    import ray.llm

    root = Path(inspect.getfile(ray.llm)).parent
    readers = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "RAYLLM_ENABLE_REQUEST_PROMPT_LOGS" in p.read_text(errors="replace")
    ]
    assert readers == ["_internal/serve/constants.py"]


def test_rays_default_batch_interval_is_50_ms():
    """The figure the docs quote (constants.py MODEL_RESPONSE_BATCH_TIMEOUT_MS, env unset)."""
    constants = importlib.import_module("ray.llm._internal.serve.constants")
    assert constants.MODEL_RESPONSE_BATCH_TIMEOUT_MS == 50


@pytest.mark.parametrize("plane", ["haproxy", "grpc", "ray-proxy"])
def test_every_ray_process_gets_serves_control_loop_interval(plane):
    from serving.spec import CONTROL_LOOP_ENV, CONTROL_LOOP_INTERVAL_S

    env = spec(ingress={"dataPlane": plane}).ray_env()
    assert float(env[CONTROL_LOOP_ENV]) == CONTROL_LOOP_INTERVAL_S


def _read_in_fresh_process(code: str, **env: str) -> list[str]:
    """What `code` prints in a new Python process with `env` over this one's, as a Ray or vLLM
    process started with ray_env reads it (every name ray_env sets removed first, and vLLM's
    other do-not-track name, so a default is Ray's or vLLM's own)."""
    ours = {*spec().ray_env(), "VLLM_DO_NOT_TRACK"}
    base = {k: v for k, v in os.environ.items() if k not in ours}
    run = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return run.stdout.split()


def test_ray_reads_the_control_loop_interval_by_that_name():
    """In a fresh process, as a Ray process started with ray_env reads it; Ray's default would
    loop five times as often."""
    from serving.spec import CONTROL_LOOP_ENV, CONTROL_LOOP_INTERVAL_S

    read = "from ray.serve._private import constants; print(constants.CONTROL_LOOP_INTERVAL_S)"
    default = _read_in_fresh_process(read)
    ours = _read_in_fresh_process(read, **{CONTROL_LOOP_ENV: str(CONTROL_LOOP_INTERVAL_S)})
    assert (float(default[0]), float(ours[0])) == (0.1, CONTROL_LOOP_INTERVAL_S)


def test_ray_reads_the_cached_metrics_interval_by_that_name():
    """Serve's replicas and routers hand their cached counters to Ray's metrics every
    RAY_SERVE_METRICS_EXPORT_INTERVAL_MS (not in Serve's docs: this holds the name)."""
    from serving.spec import METRICS_EXPORT_ENV, METRICS_EXPORT_INTERVAL_MS

    read = "from ray.serve._private import constants; print(constants.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)"
    env = spec().ray_env()
    default, ours = _read_in_fresh_process(read), _read_in_fresh_process(read, **env)
    assert (int(default[0]), int(ours[0])) == (100, METRICS_EXPORT_INTERVAL_MS)
    assert env[METRICS_EXPORT_ENV] == str(METRICS_EXPORT_INTERVAL_MS)


def test_no_usage_report_leaves_a_stacks_ray_processes():
    """Ray's and vLLM's own checks, in a process with the environment every Ray pod and the
    local cluster get: both report by default (so the check can fail), neither with it."""
    read = (
        "from ray._common.usage import usage_lib; print(usage_lib.usage_stats_enabled()); "
        "from vllm.usage.usage_lib import is_usage_stats_enabled; print(is_usage_stats_enabled())"
    )
    assert _read_in_fresh_process(read, HOME="/nonexistent") == ["True", "True"]
    assert _read_in_fresh_process(read, HOME="/nonexistent", **spec().ray_env()) == ["False", "False"]


def test_decode_reuses_prefills_prompt_token_ids_unless_turned_off():
    """Ray 2.60 PDDecodeServer.__init__ reads experimental_configs["pd_tokenize_once"] (decode
    only); the aggregated engine and prefill have nothing to reuse."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode import pd_server

    from serving.spec import TOKENIZE_ONCE_KEY

    assert f'experimental_configs.get("{TOKENIZE_ONCE_KEY}")' in inspect.getsource(pd_server)
    on = engines(spec().app_args(GPU))
    assert on["decode"]["experimental_configs"][TOKENIZE_ONCE_KEY] is True
    assert TOKENIZE_ONCE_KEY not in on["prefill"]["experimental_configs"]
    off = engines(spec(kvTransfer={"reusePromptTokenIds": False}).app_args(GPU))
    assert TOKENIZE_ONCE_KEY not in off["decode"]["experimental_configs"]
    agg = engines(spec(mode="aggregated").app_args(GPU))
    assert TOKENIZE_ONCE_KEY not in agg["decode"]["experimental_configs"]
