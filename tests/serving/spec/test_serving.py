"""What serving/spec/serving.py renders, checked by Ray Serve's and vLLM's own validators.

None of these start Ray. The serving packages are required: if Ray or vLLM is missing the
imports below fail the tests rather than skip them.
"""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from serving.spec import (
    API_KEYS_ENV,
    APP_IMPORT_PATH,
    DEFAULT_LABEL_KEY,
    SERVE_PORT,
    SERVING_ENV,
    Mode,
    ServingSpec,
    Target,
)
from tests.upstream import async_engine_kwargs

GPU = Target(
    accelerator_type="H100",
    working_dir="s3://example-bucket/serving.zip",
    engine_env={"FI_PROVIDER": "efa"},
    ingress_env={"LOG_LEVEL": "info"},
)
CPU = Target(engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def make_spec(**overrides) -> ServingSpec:
    data = {
        "model": {"id": "llama-3-8b", "source": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "prefill": {"tensorParallelSize": 2},
        "decode": {"tensorParallelSize": 2, "minReplicas": 1, "maxReplicas": 3},
        "kvTransfer": {"extraConfig": {"backends": ["UCX"]}},
    }
    data.update(overrides)
    return ServingSpec.model_validate(data)


def cpu_spec(mode: str = "disaggregated") -> ServingSpec:
    return ServingSpec.model_validate(
        {
            "model": {"id": "tiny", "source": "/models/tiny", "dtype": "float32", "maxModelLen": 512},
            "mode": mode,
            "engineKwargs": {"enforce_eager": True},
        }
    )


CASES = {
    "gpu-disaggregated": (make_spec(), GPU),
    "gpu-aggregated": (make_spec(mode="aggregated", decode={"tensorParallelSize": 4, "pipelineParallelSize": 2}), GPU),
    "gpu-s3-disaggregated": (make_spec(model={"id": "llama-3-8b", "source": "s3://models-bucket/llama-3-8b"}), GPU),
    "cpu-disaggregated": (cpu_spec(), CPU),
    "cpu-aggregated": (cpu_spec("aggregated"), CPU),
    # Multi-node layouts: prefill TP 8 x PP 2 pushing KV into a TP 8 decode, and a
    # DP 16 + EP decode behind it (prefill TP 8 > decode TP 1).
    "gpu-prefill-pp": (
        make_spec(
            prefill={"tensorParallelSize": 8, "pipelineParallelSize": 2},
            decode={"tensorParallelSize": 8},
            kvTransfer={"connector": "NixlPushConnector"},
        ),
        GPU,
    ),
    "gpu-dp-ep": (
        make_spec(
            prefill={"tensorParallelSize": 8, "pipelineParallelSize": 2},
            decode={"tensorParallelSize": 1, "dataParallelSize": 16, "moeParallelism": "expert"},
            kvTransfer={"connector": "NixlPushConnector"},
        ),
        GPU,
    ),
}
MULTINODE = ["gpu-prefill-pp", "gpu-dp-ep"]


def engine_configs(args: dict) -> dict[str, dict]:
    if args["mode"] == "aggregated":
        return {"decode": args["llm_configs"][0]}
    return {"prefill": args["prefill_config"], "decode": args["decode_config"]}


# --- Ray Serve's validators ----------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_serve_config_passes_ray_serve_schema(case):
    from ray.serve.schema import ServeDeploySchema

    spec, target = CASES[case]
    config = spec.serve_config(target)
    parsed = ServeDeploySchema.model_validate(config)
    app = parsed.applications[0]
    assert app.import_path == APP_IMPORT_PATH
    assert app.route_prefix == "/"
    assert parsed.http_options.port == SERVE_PORT
    assert parsed.proxy_location.value == target.proxy_location
    if target.working_dir:
        assert app.runtime_env == {"working_dir": target.working_dir}


@pytest.mark.parametrize("case", CASES)
def test_each_engine_config_is_a_valid_ray_llm_config(case):
    from ray.serve.llm import LLMConfig

    spec, target = CASES[case]
    for raw in engine_configs(spec.app_args(target)).values():
        cfg = LLMConfig.model_validate(copy.deepcopy(raw))
        assert cfg.model_id == spec.model.id
        if spec.model.source.startswith("s3://"):
            # Ray Serve LLM reads a bucket through its mirror config.
            assert cfg.model_loading_config.model_source.bucket_uri == spec.model.source
        if target.cpu:
            assert cfg.accelerator_config.kind == "cpu"
            assert cfg.accelerator_type is None
        else:
            assert cfg.accelerator_type == target.accelerator_type
        assert cfg.runtime_env["env_vars"] == {**dict(target.engine_env), **SERVING_ENV}


@pytest.mark.parametrize("case", ["gpu-disaggregated", "gpu-s3-disaggregated", "cpu-disaggregated", *MULTINODE])
def test_pd_args_pass_ray_pd_validator_with_the_custom_ingress(case):
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    from serving.app import AppArgs
    from serving.ingress.server import AuthenticatedIngress

    spec, target = CASES[case]
    args = spec.app_args(target)
    pd = PDServingArgs.model_validate(
        {
            "prefill_config": args["prefill_config"],
            "decode_config": args["decode_config"],
            "ingress_deployment_config": args["ingress_deployment_config"],
            "ingress_cls_config": AppArgs.model_validate(args).ingress_cls_config(),
        }
    )
    assert pd.prefill_config.model_id == pd.decode_config.model_id == spec.model.id
    assert pd.ingress_cls_config.ingress_cls is AuthenticatedIngress
    assert pd.ingress_cls_config.ingress_extra_kwargs == {
        "auth_mode": "api-key",
        "api_keys_env": API_KEYS_ENV,
        "resilience": spec.resilience.runtime_args(),
        "max_body_bytes": spec.ingress.max_body_mib << 20,
    }


@pytest.mark.parametrize("case", ["gpu-aggregated", "cpu-aggregated"])
def test_aggregated_args_pass_ray_serving_args_validator(case):
    from ray.serve.llm import LLMServingArgs

    from serving.app import AppArgs

    spec, target = CASES[case]
    args = spec.app_args(target)
    parsed = LLMServingArgs.model_validate(
        {
            "llm_configs": args["llm_configs"],
            "ingress_deployment_config": args["ingress_deployment_config"],
            "ingress_cls_config": AppArgs.model_validate(args).ingress_cls_config(),
        }
    )
    assert [c.model_id for c in parsed.llm_configs] == [spec.model.id]


def test_ray_pd_validator_rejects_a_missing_kv_transfer_config():
    """The validator used above is not a rubber stamp."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    args = cpu_spec().app_args(CPU)
    del args["decode_config"]["engine_kwargs"]["kv_transfer_config"]
    with pytest.raises(ValidationError, match="kv_transfer_config is required"):
        PDServingArgs.model_validate({"prefill_config": args["prefill_config"], "decode_config": args["decode_config"]})


# --- vLLM's validators ---------------------------------------------------------------------
@pytest.mark.parametrize("case", ["gpu-disaggregated", "cpu-disaggregated"])
def test_kv_transfer_config_is_valid_for_vllm(case):
    from vllm.config import KVTransferConfig

    spec, target = CASES[case]
    for role, raw in engine_configs(spec.app_args(target)).items():
        kv = KVTransferConfig(**raw["engine_kwargs"]["kv_transfer_config"])
        assert kv.kv_connector == "NixlConnector"
        # vLLM's own reading of the role (prefill produces, decode consumes).
        assert (kv.is_kv_producer, kv.is_kv_consumer) == ((True, False) if "prefill" in role else (False, True))
        assert kv.is_kv_transfer_instance
        assert kv.kv_buffer_device == ("cpu" if target.cpu else "cuda")
        assert kv.kv_load_failure_policy == "recompute"
        if not target.cpu:
            assert kv.kv_connector_extra_config == {"backends": ["UCX"]}


@pytest.mark.parametrize("case", CASES)
def test_engine_kwargs_are_valid_vllm_engine_args(case):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec, target = CASES[case]
    for role, raw in engine_configs(spec.app_args(target)).items():
        kwargs = async_engine_kwargs(dict(raw["engine_kwargs"]))
        if "kv_transfer_config" in kwargs:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        args = AsyncEngineArgs(model=spec.model.source, **kwargs)
        assert args.dtype == spec.model.dtype.value
        assert args.max_model_len == spec.model.max_model_len
        role_spec = spec.engine_roles()[role]
        assert args.tensor_parallel_size == role_spec.tensor_parallel_size
        assert args.pipeline_parallel_size == role_spec.pipeline_parallel_size
        assert args.data_parallel_size == role_spec.data_parallel_size
        assert args.enable_expert_parallel is (role_spec.moe_parallelism.value == "expert")
        if target.cpu:
            assert args.enforce_eager is True


@pytest.mark.parametrize("case", MULTINODE)
def test_push_kv_transfer_config_is_valid_for_vllm(case):
    from vllm.config import KVTransferConfig

    spec, target = CASES[case]
    roles = engine_configs(spec.app_args(target))
    for role, raw in roles.items():
        kv = KVTransferConfig(**raw["engine_kwargs"]["kv_transfer_config"])
        assert kv.kv_connector == "NixlPushConnector"
        assert kv.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert kv.is_kv_transfer_instance


def test_the_connectors_are_vllms_registered_names():
    """The names the spec renders are the ones vLLM's connector factory knows (0.32 here)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from serving.spec import KvConnector

    for c in KvConnector:
        assert c.value in KVConnectorFactory._registry, c


def test_refusals_quote_the_installed_vllm():
    """The decode-PP refusal quotes vLLM's own error, guarded by kv_consumer, and the push-mode
    PP path exists (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    source = Path(spec.origin).read_text()
    with pytest.raises(ValidationError) as e:
        make_spec(decode={"pipelineParallelSize": 2})
    quoted = str(e.value).split("'")[1]
    assert quoted.replace(" ", "") in source.replace('"\n', "").replace(" ", "").replace('"', "")
    assert 'kv_role == "kv_consumer"' in source
    assert "PP>1 (push mode)" in source


def test_vllm_rejects_an_unknown_engine_kwarg_that_the_spec_lets_through():
    """The spec leaves engineKwargs to vLLM; vLLM's own validator is what catches typos."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec = cpu_spec().model_copy(update={"engine_kwargs": {"enforce_eagre": True}})
    kwargs = async_engine_kwargs(dict(spec.app_args(CPU)["decode_config"]["engine_kwargs"]))
    kwargs.pop("kv_transfer_config")
    with pytest.raises(TypeError, match="enforce_eagre"):
        AsyncEngineArgs(model="/models/tiny", **kwargs)


# --- placement and auth in what is rendered ---------------------------------------------------
def test_engines_pinned_to_their_node_group_one_selector_per_bundle():
    spec, target = CASES["gpu-disaggregated"]
    args = spec.app_args(target)
    for role in ("prefill", "decode"):
        selectors = args[f"{role}_config"]["deployment_config"]["placement_group_bundle_label_selector"]
        assert selectors == [{DEFAULT_LABEL_KEY: role}] * 2  # TP 2 -> two bundles
    assert args["ingress_deployment_config"]["ray_actor_options"]["label_selector"] == {DEFAULT_LABEL_KEY: "head"}
    assert args["ingress_deployment_config"]["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"LOG_LEVEL": "info", **SERVING_ENV}
    }


def test_aggregated_engine_runs_on_the_decode_group():
    spec, target = CASES["gpu-aggregated"]
    (cfg,) = spec.app_args(target)["llm_configs"]
    assert (
        cfg["deployment_config"]["placement_group_bundle_label_selector"] == [{DEFAULT_LABEL_KEY: "decode"}] * 8
    )  # TP 4 x PP 2
    assert "kv_transfer_config" not in cfg["engine_kwargs"]


def test_cpu_target_renders_no_gpu_settings():
    args = cpu_spec().app_args(CPU)
    for cfg in (args["prefill_config"], args["decode_config"]):
        assert cfg["accelerator_config"] == {"kind": "cpu"}
        assert "accelerator_type" not in cfg
        assert "gpu_memory_utilization" not in cfg["engine_kwargs"]
        assert cfg["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] == "cpu"


@pytest.mark.parametrize("auth", ["api-key", "disabled"])
def test_auth_mode_and_key_variable_reach_the_app_args(auth):
    args = make_spec(auth=auth).app_args(GPU)
    assert args["auth"] == {"mode": auth, "api_keys_env": API_KEYS_ENV}


def test_cloud_and_local_differ_only_in_target():
    """Same spec, two targets: the model, parallelism, KV transfer and placement agree."""
    spec = make_spec()
    cloud = spec.app_args(GPU)
    local = spec.app_args(CPU)
    for role in ("prefill_config", "decode_config"):
        c, loc = cloud[role], local[role]
        assert c["model_loading_config"] == loc["model_loading_config"]
        assert c["deployment_config"] == loc["deployment_config"]
        ck = {k: v for k, v in c["engine_kwargs"].items() if k not in ("gpu_memory_utilization", "kv_transfer_config")}
        lk = {k: v for k, v in loc["engine_kwargs"].items() if k != "kv_transfer_config"}
        assert ck == lk
    assert (
        cloud["ingress_deployment_config"]["autoscaling_config"]
        == local["ingress_deployment_config"]["autoscaling_config"]
    )


# --- cross-field validation ------------------------------------------------------------------
def test_prefill_tp_larger_than_decode_tp_is_accepted():
    """vLLM reads KV across TP sizes that divide one another (nixl/base_worker.py, heterogeneous TP)."""
    spec = make_spec(prefill={"tensorParallelSize": 8}, decode={"tensorParallelSize": 2})
    args = spec.app_args(GPU)
    assert args["prefill_config"]["engine_kwargs"]["tensor_parallel_size"] == 8
    assert args["decode_config"]["engine_kwargs"]["tensor_parallel_size"] == 2


def test_tensor_parallel_mismatch_is_fine_in_aggregated_mode():
    spec = make_spec(mode="aggregated", decode={"tensorParallelSize": 4})
    assert spec.engine_roles() == {"decode": spec.decode}


@pytest.mark.parametrize("connector", ["NixlConnector", "NixlPushConnector"])
def test_decode_pipeline_parallel_is_refused_with_vllms_reason(connector):
    with pytest.raises(ValidationError) as e:
        make_spec(decode={"pipelineParallelSize": 2}, kvTransfer={"connector": connector})
    msg = str(e.value)
    assert "decode.pipelineParallelSize = 2 is refused" in msg
    # vLLM's own words (nixl/base_worker.py, 0.29 and 0.32)
    assert "NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1" in msg


def test_prefill_pipeline_parallel_needs_the_push_connector():
    with pytest.raises(
        ValidationError, match=r"prefill.pipelineParallelSize = 2 needs kvTransfer.connector: NixlPushConnector"
    ):
        make_spec(prefill={"tensorParallelSize": 2, "pipelineParallelSize": 2})


def test_prefill_pipeline_parallel_with_push_renders_the_layout():
    spec = make_spec(
        prefill={"tensorParallelSize": 8, "pipelineParallelSize": 2},
        decode={"tensorParallelSize": 8},
        kvTransfer={"connector": "NixlPushConnector"},
    )
    args = spec.app_args(GPU)
    p, d = args["prefill_config"], args["decode_config"]
    assert p["engine_kwargs"]["pipeline_parallel_size"] == 2 and p["engine_kwargs"]["tensor_parallel_size"] == 8
    assert d["engine_kwargs"]["pipeline_parallel_size"] == 1
    # producer/consumer roles: vLLM keys its decode-side PP refusal on kv_consumer
    assert p["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert d["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert {c["engine_kwargs"]["kv_transfer_config"]["kv_connector"] for c in (p, d)} == {"NixlPushConnector"}
    # one bundle per GPU worker: vLLM's Ray executor starts one worker per GPU bundle
    assert len(p["deployment_config"]["placement_group_bundle_label_selector"]) == 16


def test_pull_connector_roles_are_producer_and_consumer_not_the_deprecated_kv_both():
    """vLLM 0.29/0.32 NixlBaseConnector.__init__ warns that kv_both is deprecated for NIXL."""
    args = make_spec().app_args(GPU)
    assert args["prefill_config"]["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert args["decode_config"]["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_consumer"


def test_data_and_expert_parallel_render_per_rank_bundles():
    spec = make_spec(decode={"dataParallelSize": 16, "moeParallelism": "expert"})
    d = spec.app_args(GPU)["decode_config"]
    assert d["engine_kwargs"]["data_parallel_size"] == 16
    assert d["engine_kwargs"]["enable_expert_parallel"] is True
    # a Serve replica is one DP rank of TP x PP GPUs; Ray multiplies the replica bounds by DP
    assert len(d["deployment_config"]["placement_group_bundle_label_selector"]) == 1
    assert spec.decode.gpus_per_replica == 16 and spec.decode.gpus_per_rank == 1
    p = spec.app_args(GPU)["prefill_config"]
    assert "data_parallel_size" not in p["engine_kwargs"] and "enable_expert_parallel" not in p["engine_kwargs"]


@pytest.mark.parametrize(
    "key",
    ["tensor_parallel_size", "kv_transfer_config", "model", "dtype", "data_parallel_size", "enable_expert_parallel"],
)
def test_reserved_engine_kwargs_are_rejected(key):
    with pytest.raises(ValidationError, match=rf"{key} set by the spec itself .* remove from engineKwargs"):
        make_spec(engineKwargs={key: 1})


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "-lead", "x" * 129])
def test_bad_model_id_is_rejected(bad):
    with pytest.raises(ValidationError, match="is not a valid model id"):
        make_spec(model={"id": bad, "source": "org/name"})


@pytest.mark.parametrize(
    "bad", ["../weights", "/models/../etc", "https://example.com/model", "just-a-name", "s3://B/x", "org/name/extra"]
)
def test_bad_model_source_is_rejected(bad):
    with pytest.raises(ValidationError, match="is not a valid model source"):
        make_spec(model={"id": "m", "source": bad})


@pytest.mark.parametrize("good", ["org/name", "s3://bucket-1/prefix/model", "/abs/path/model"])
def test_model_source_forms_accepted(good):
    assert make_spec(model={"id": "m", "source": good}).model.source == good


def test_placement_labels_must_differ():
    with pytest.raises(ValidationError, match="must differ"):
        make_spec(placement={"prefill": "gpu", "decode": "gpu"})


def test_mode_enum_round_trips():
    assert make_spec(mode="aggregated").mode is Mode.AGGREGATED
