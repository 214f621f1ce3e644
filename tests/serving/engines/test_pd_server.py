"""serving/engines/pd_server.py builds Ray's P/D graph, with only the decode class swapped.

Contract: Ray 2.60 `build_pd_openai_app` (ray-project/ray, python/ray/llm/_internal/serve/
serving_patterns/prefill_decode/builder.py) is the reference; for the same args our
`serving.app.build_app` must produce the same deployments (names, Serve options, placement, init
arguments) except that decode runs `ResilientPDDecodeServer` (a subclass of the public
PDDecodeServer) and receives the resilience values. Also: every Ray internal that the
resilience layer relies on (serving/ray_internals.py, and private members of public classes)
still exists with the shape we use -- these tests fail loudly on a Ray upgrade that moves them.

No Ray instance is started: building the graph only reads `ray.get_runtime_context()` (for
the default runtime env), which is stubbed; auto-connect is off so a hidden `ray.init()`
would fail the test instead of starting Ray.
"""

from __future__ import annotations

import asyncio
import inspect
import types
from pathlib import Path

import pytest

from serving.spec import Mode, ResilienceSpec, Target

GPU = Target(accelerator_type="H100", working_dir="s3://example-bucket/serving.zip")


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ENABLE_AUTO_CONNECT", "0")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={}))
    yield
    assert not ray.is_initialized()


def _graph(app) -> dict[str, dict]:
    """{deployment name: {cls, config, actor options, init kwargs (handles by name)}}."""
    out: dict[str, dict] = {}

    def walk(a):
        d = a._bound_deployment
        kwargs = {}
        for k, v in d.init_kwargs.items():
            if hasattr(v, "_bound_deployment"):
                walk(v)
                kwargs[k] = ("deployment", v._bound_deployment.name)
            elif isinstance(v, dict) and any(hasattr(x, "_bound_deployment") for x in v.values()):
                kwargs[k] = {}
                for kk, vv in v.items():
                    walk(vv)
                    kwargs[k][kk] = ("deployment", vv._bound_deployment.name)
            else:
                kwargs[k] = v
        cfg = d._deployment_config
        out[d.name] = {
            "cls": d.func_or_class,
            "config": {
                k: getattr(cfg, k)
                for k in (
                    "max_ongoing_requests",
                    "max_queued_requests",
                    "health_check_period_s",
                    "health_check_timeout_s",
                    "autoscaling_config",
                )
            },
            "actor": d._replica_config.ray_actor_options,
            "placement": (
                d._replica_config.placement_group_bundles,
                d._replica_config.placement_group_strategy,
                getattr(d._replica_config, "placement_group_bundle_label_selector", None),
            ),
            "kwargs": kwargs,
        }

    walk(app)
    return out


def _args(mode_target):
    from local.config import local_spec
    from tests.serving.spec.test_serving import make_spec

    if mode_target.startswith("cpu"):
        # "cpu-kv-aware": the local stack as the e2e session runs it (PD_PREFILL_ROUTER=kv-aware).
        router = "kv-aware" if mode_target == "cpu-kv-aware" else None
        return local_spec(Mode.DISAGGREGATED, Path("/models/tiny"), prefill_router=router).app_args(Target())
    return make_spec().app_args(GPU)


@pytest.mark.parametrize("which", ["cpu", "cpu-kv-aware", "gpu"])
def test_same_graph_as_rays_builder_but_the_decode_class(no_ray, which):
    from ray.serve.llm import build_pd_openai_app
    from ray.serve.llm.deployment import PDDecodeServer

    from serving.app import AppArgs, build_app
    from serving.engines.pd_server import ResilientPDDecodeServer

    args = _args(which)
    ours = _graph(build_app(args))
    ray_args = {k: v for k, v in args.items() if k not in ("mode", "auth", "resilience", "max_body_bytes")}
    ray_args["ingress_cls_config"] = AppArgs.model_validate(args).ingress_cls_config()
    theirs = _graph(build_pd_openai_app(ray_args))

    decode = next(n for n in ours if n.startswith("Decode:"))
    prefill = next(n for n in ours if n.startswith("Prefill:"))
    kv_aware = args["prefill_config"]["deployment_config"].get("request_router_config") is not None
    assert kv_aware == (which == "cpu-kv-aware")
    if kv_aware:
        # The one addition: the prefill tier's KV scorer, under the name Ray's engines report to.
        assert ours.keys() == theirs.keys() | {"LLMRouter"}
        scorer = ours.pop("LLMRouter")
        assert scorer["cls"].__name__ == "KvScorer" and scorer["kwargs"]["prefill_server"] == ("deployment", prefill)
        label = args["prefill_config"]["deployment_config"]["placement_group_bundle_label_selector"][0]
        assert scorer["actor"]["num_cpus"] == 0 and scorer["actor"]["label_selector"] == label
        assert ours[decode]["kwargs"].pop("kv_scorer") == ("deployment", "LLMRouter")
        assert ours[prefill]["cls"].__name__ == "KvPrefillServer"
        assert issubclass(ours[prefill]["cls"], theirs[prefill]["cls"])
    assert ours.keys() == theirs.keys()
    assert ours[decode]["cls"] is ResilientPDDecodeServer
    assert issubclass(ResilientPDDecodeServer, PDDecodeServer)
    assert ours[decode]["kwargs"].pop("resilience") == args["resilience"]
    for name in ours:
        o, t = ours[name], theirs[name]
        if name != decode and (name != prefill or not kv_aware):
            assert o["cls"].__name__ == t["cls"].__name__, name
        assert o["config"] == t["config"], name
        assert o["actor"] == t["actor"], name
        assert o["placement"] == t["placement"], name
        assert o["kwargs"].keys() == t["kwargs"].keys(), name
        for k in o["kwargs"]:
            if k != "llm_config":
                assert o["kwargs"][k] == t["kwargs"][k], (name, k)
            else:
                assert o["kwargs"][k].model_dump() == t["kwargs"][k].model_dump(), name


def test_build_app_refuses_bad_resilience_before_building():
    from serving.app import build_app

    with pytest.raises(ValueError, match="missing keys"):
        build_app({"mode": "disaggregated", "resilience": {"prefill_timeout_s": 1}})


def test_the_resilient_graph_refuses_data_parallel_engines(no_ray):
    from serving.engines.pd_server import build_pd_engines, pd_args

    args = _args("cpu")
    args["decode_config"]["engine_kwargs"]["data_parallel_size"] = 2
    pd = pd_args({k: args[k] for k in ("prefill_config", "decode_config")})
    with pytest.raises(ValueError, match="decode: data_parallel_size > 1"):
        build_pd_engines(pd, ResilienceSpec().runtime_args())


# --- the Ray internals we rely on (Ray 2.60) ------------------------------------------------
def test_ray_internals_module_imports_every_symbol():
    from serving import ray_internals

    for name in ray_internals.__all__:
        assert getattr(ray_internals, name) is not None, name


def test_pd_decode_server_members_used_by_the_resilient_subclass():
    """ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py (Ray 2.60)."""
    from ray.serve.llm.deployment import PDDecodeServer

    params = inspect.signature(PDDecodeServer.__init__).parameters
    assert {"llm_config", "prefill_server", "engine_cls", "model_downloader"} <= set(params)
    src = inspect.getsource(PDDecodeServer.__init__)
    assert "self._prefill_handle = prefill_server.options(stream=True)" in src
    assert callable(PDDecodeServer._get_connector_backend)
    assert PDDecodeServer._pd_tokenize_once is False
    for method in ("chat", "completions"):
        assert list(inspect.signature(getattr(PDDecodeServer, method)).parameters) == [
            "self",
            "request",
            "raw_request_info",
        ]


def test_llm_server_methods_run_on_the_local_engine():
    """Local prefill calls the public LLMServer's chat/completions on the decode replica;
    they must be the engine methods that PDDecodeServer overrides."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer as Internal
    from ray.serve.llm.deployment import LLMServer, PDDecodeServer

    for method in ("chat", "completions"):
        assert getattr(LLMServer, method) is getattr(Internal, method)
        assert issubclass(PDDecodeServer, Internal)
        assert list(inspect.signature(getattr(LLMServer, method)).parameters)[:3] == [
            "self",
            "request",
            "raw_request_info",
        ]


def test_connector_backend_protocol():
    """ray/llm/_internal/serve/engines/vllm/kv_transfer/base.py (Ray 2.60)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend

    assert list(inspect.signature(BaseConnectorBackend.prepare_prefill_request).parameters) == [
        "self",
        "request",
        "peer",
    ]
    assert list(inspect.signature(BaseConnectorBackend.prepare_decode_request).parameters) == [
        "self",
        "request",
        "peer",
        "prefill_response",
    ]
    for flag in ("requires_peer_binding", "concurrent_handoff"):
        assert hasattr(BaseConnectorBackend, flag), flag


def test_openai_ingress_members_used_by_the_resilient_mixin():
    """ray/llm/_internal/serve/core/ingress/ingress.py (Ray 2.60)."""
    from ray.serve.llm.ingress import OpenAiIngress

    assert inspect.iscoroutinefunction(OpenAiIngress._get_model_id)
    assert callable(OpenAiIngress._get_configured_serve_handle)
    for method in ("chat", "completions"):
        assert list(inspect.signature(getattr(OpenAiIngress, method)).parameters) == ["self", "body", "request"]


def test_rays_pd_builder_still_hard_codes_the_decode_class():
    """If Ray's builder ever takes a decode class (or honours LLMConfig.server_cls),
    serving/engines/pd_server.py should go and the option be used instead."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder

    src = inspect.getsource(builder.build_pd_openai_app)
    assert "decode_cls = DPPDDecodeServer if decode_dp_size > 1 else PDDecodeServer" in src
    assert "server_cls" not in src


def test_serve_response_generator_members_used_by_the_ingress():
    """python/ray/serve/handle.py (Ray 2.60): the ingress waits for replica assignment
    (fail-fast while decode is degraded) and cancels calls it abandons."""
    from ray.serve.handle import DeploymentResponseGenerator

    assert inspect.iscoroutinefunction(DeploymentResponseGenerator._fetch_future_result_async)
    assert callable(DeploymentResponseGenerator.cancel)


# --- tokenize once: decode renders with prefill's prompt token ids ----------------------------
def test_rays_tokenize_once_patch_applies_to_this_vllm():
    """Ray 2.60 common/patches/vllm/tokenize_once.py wraps vLLM's renderer; on a vLLM whose
    renderer it cannot find, install() says False and Ray's decode server keeps it off. vLLM's
    chat request takes `return_token_ids` and its response carries `prompt_token_ids`
    (vllm/entrypoints/openai/chat_completion/protocol.py), the two ends the reuse needs."""
    from ray.llm._internal.common.patches.vllm import tokenize_once
    from ray.serve.llm.deployment import PDDecodeServer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse

    assert tokenize_once.install() is True
    assert "return_token_ids" in ChatCompletionRequest.model_fields
    assert "prompt_token_ids" in ChatCompletionResponse.model_fields
    # Decode reads them off prefill's first chunk (chat: top level).
    assert "prompt_token_ids" in inspect.getsource(PDDecodeServer._decode_reuse_ids)
    assert "return_token_ids = True" in inspect.getsource(PDDecodeServer._request_prefill_token_ids)


def _engine_stream(seen: list, hang: bool = False):
    """A stand-in for the decode engine's stream: like vLLM it renders (reads the published
    ids) when it is first read, then streams."""
    from ray.llm._internal.common.patches.vllm.tokenize_once import _reused_token_ids

    async def gen():
        try:
            seen.append(("rendered with", _reused_token_ids.get()))
            if hang:
                await asyncio.sleep(3600)
            yield "token-1"
            yield "token-2"
        finally:
            seen.append("engine stream closed")

    return gen()


def _orchestrate(seen, ids, *, hang=False, kv_ready_timeout_s=5.0):
    from serving.engines.pd_server import reusing_prompt_ids
    from serving.engines.prefill_hop import PrefillOutcome, orchestrate

    async def prefill():
        return PrefillOutcome(chunk="prefill chunk")

    async def decode_with(chunk):
        async def start():
            return _engine_stream(seen, hang=hang)

        return reusing_prompt_ids(ids, start)

    async def decode_local():
        return _engine_stream(seen)

    async def run():
        out = [
            x
            async for x in orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=lambda _: False,
                kv_ready_timeout_s=lambda: kv_ready_timeout_s,
                on_path=lambda path, reason: seen.append(("path", path.value, reason.value if reason else None)),
            )
        ]
        from ray.llm._internal.common.patches.vllm.tokenize_once import _reused_token_ids

        return out, _reused_token_ids.get()

    return asyncio.run(run())


def test_decode_renders_with_prefills_ids_under_the_kv_ready_deadline():
    """The first read runs under the KV-ready deadline (asyncio.wait_for: another task), and
    the ids still reach the render; nothing is left published once the stream is done."""
    seen: list = []
    out, left = _orchestrate(seen, [101, 102, 103])
    assert out == ["token-1", "token-2"]
    assert seen[0] == ("rendered with", [101, 102, 103])
    assert left is None and "engine stream closed" in seen


def test_a_kv_ready_timeout_closes_the_engine_stream_and_prefills_locally_without_the_ids():
    seen: list = []
    out, _ = _orchestrate(seen, [7, 8], hang=True, kv_ready_timeout_s=0.05)
    assert out == ["token-1", "token-2"]
    renders = [s for s in seen if isinstance(s, tuple) and s[0] == "rendered with"]
    # The remote path's stream rendered with the ids and was closed (the engine's abort);
    # the local prefill tokenizes the prompt itself.
    assert renders == [("rendered with", [7, 8]), ("rendered with", None)]
    assert seen.index("engine stream closed") < seen.index(("rendered with", None))
    assert ("path", "local", "kv_timeout") in seen


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_prefill_call_of_a_request_with_min_tokens_is_one_vllm_takes(endpoint):
    """A client's min_tokens under P/D: Ray's own prefill shaping (NixlConnectorBackend's
    DefaultPDProtocolMixin, Ray 2.60 kv_transfer/base.py) clamps max_tokens to 1 and keeps
    min_tokens, which vLLM's SamplingParams refuses (vllm/sampling_params.py: min_tokens must
    be <= max_tokens). The prefill call keeps its one token and the decode request the
    client's bounds."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.nixl import NixlConnectorBackend
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    from serving.engines.pd_server import prefill_request_for

    if endpoint == "chat":
        request = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20, min_tokens=5
        )
    else:
        request = CompletionRequest(model="m", prompt="hi", max_tokens=20, min_tokens=5)
    backend = NixlConnectorBackend.__new__(NixlConnectorBackend)  # the protocol needs no config
    # Ray's own shaping alone is refused by vLLM: the defect this guards against.
    raw = backend.prepare_prefill_request(request=request, peer=None)
    # (the server passes the request's own cap: vllm/entrypoints/utils.py get_max_tokens)
    with pytest.raises(VLLMValidationError, match="min_tokens"):
        raw.to_sampling_params(raw.max_tokens, {})
    shaped = prefill_request_for(backend, request)
    params = shaped.to_sampling_params(shaped.max_tokens, {})
    assert params.max_tokens == 1 and params.min_tokens <= 1
    assert shaped.kv_transfer_params == raw.kv_transfer_params
    decode = backend.prepare_decode_request(request=request, peer=None, prefill_response=None)
    assert decode.min_tokens == 5 and decode.max_tokens == 20
