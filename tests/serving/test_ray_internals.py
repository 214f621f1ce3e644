"""serving/ray_internals.py against the installed Ray (2.60): every internal it re-exports and
every private hook the serving code relies on is there, with the shape the code uses."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from serving import ray_internals as ri


def test_every_re_export_resolves():
    for name in ri.__all__:
        assert getattr(ri, name) is not None, name


def test_every_hook_exists_on_this_ray():
    ri.check_hooks()


def test_a_missing_hook_fails_loudly_naming_it(monkeypatch):
    monkeypatch.setattr(ri, "HOOKS", (*ri.HOOKS, ("ray.serve.llm.deployment:LLMServer", "_renamed_upstream")))
    with pytest.raises(RuntimeError, match=r"LLMServer\._renamed_upstream"):
        ri.check_hooks()


def test_the_hooks_take_what_the_serving_code_passes():
    from ray.serve.handle import DeploymentResponseGenerator
    from ray.serve.llm.deployment import LLMServer

    assert list(inspect.signature(LLMServer._batch_output_stream).parameters) == ["self", "generator"]
    assert list(inspect.signature(DeploymentResponseGenerator._fetch_future_result_async).parameters)[:1] == ["self"]


def test_the_ingress_routing_tables_the_front_door_fills_exist_with_their_shapes():
    """serving/ingress/catalog.py's models reach requests only through these attributes of Ray's
    OpenAiIngress: a Ray that renames one would route nothing in the many-model form."""
    from ray.serve.llm.ingress import OpenAiIngress

    ingress = OpenAiIngress({}, {}, lora_paths={"m": "s3://b/p"})
    for name in ("_default_serve_handles", "_configured_serve_handles", "_model_cards", "_lora_paths"):
        assert isinstance(getattr(ingress, name), dict), name
    assert ingress._lora_paths == {"m": "s3://b/p"}


@pytest.fixture
def telemetry_pushes(monkeypatch):
    """Ray's LLMServer._start_engine run for real on a stand-in server, with the function it
    calls after the engine starts recorded instead of creating Ray Serve LLM's actor."""
    from ray.llm._internal.serve.core.server import llm_server

    pushed: list[object] = []
    monkeypatch.setattr(
        llm_server, "push_telemetry_report_for_all_models", lambda all_models=None: pushed.append(all_models)
    )

    async def start_engine() -> None:
        async def started() -> None:
            return None

        server = type(
            "Server", (), {"engine": type("Engine", (), {"start": staticmethod(started)})(), "_llm_config": "cfg"}
        )()
        await llm_server.LLMServer._start_engine(server)

    return pushed, start_engine


def test_no_usage_telemetry_actor_while_usage_stats_are_off(telemetry_pushes, monkeypatch):
    """Every stack runs with RAY_USAGE_STATS_ENABLED=0 (serving.spec TELEMETRY_OFF_ENV): Ray's
    engine start then pushes no report, so no detached TelemetryAgent is created for it."""
    pushed, start_engine = telemetry_pushes
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ri.skip_usage_telemetry_when_off()
    ri.skip_usage_telemetry_when_off()  # a second engine in the process: still one wrapper
    asyncio.run(start_engine())
    assert pushed == []
    # With usage stats on, Ray's report goes out as before, once per engine start.
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    asyncio.run(start_engine())
    assert pushed == [["cfg"]]


def test_the_engine_finds_vllms_tokenization_server_under_either_name():
    """Ray 2.60's VLLMEngine.start reads vLLM's tokenization server as
    `openai_serving_tokenization`; vLLM 0.32's app state names it `serving_tokenization`
    (vllm/entrypoints/launchers/api_server/app_state.py), so Ray found none and /tokenize was a
    400 on the local stack. The engine adopts it under vLLM's name; Ray's own find is kept."""
    import inspect as _inspect

    from ray.llm._internal.serve.engines.vllm import vllm_engine
    from vllm.entrypoints.launchers.api_server import app_state

    assert '"openai_serving_tokenization"' in _inspect.getsource(vllm_engine.VLLMEngine.start)
    assert "state.serving_tokenization =" in _inspect.getsource(app_state)

    served = object()
    engine = type("E", (), {})()
    engine._oai_serving_tokenization = None
    engine._app_state = type("S", (), {"serving_tokenization": served})()
    ri.adopt_tokenization(engine)
    assert engine._oai_serving_tokenization is served
    rays = object()
    engine._oai_serving_tokenization = rays
    ri.adopt_tokenization(engine)
    assert engine._oai_serving_tokenization is rays


def test_serves_internal_request_id_is_carried_by_handle_calls_and_the_client_id_can_be_stood_in_for():
    """The KV scorer's booking id (serving/engines/kv_router.py booking_id): Serve's internal
    request id, which every handle call of a request carries as it is, next to Serve's request
    id, the client's x-request-id (python/ray/serve/_private/default_impl.py
    get_request_metadata, Ray 2.60); and the request id Ray Serve LLM's engines report under
    (utils/server_utils.py get_serve_request_id) can be set for a block, then restored."""
    from ray.llm._internal.serve.utils.server_utils import get_serve_request_id
    from ray.serve import context
    from ray.serve._private import default_impl

    token = context._serve_request_context.set(
        context._RequestContext(request_id="client-chosen", _internal_request_id="serve-made", app_name="llm")
    )
    try:
        assert ri.serve_internal_request_id() == "serve-made"
        meta = default_impl.get_request_metadata(
            default_impl.create_init_handle_options(), default_impl.create_dynamic_handle_options(method_name="chat")
        )
        assert (meta.request_id, meta.internal_request_id) == ("client-chosen", "serve-made")
        with ri.serve_request_id_as("serve-made"):
            assert get_serve_request_id() == ri.serve_request_id() == "serve-made"
            assert context._get_serve_request_context().app_name == "llm"  # the rest kept
        assert get_serve_request_id() == "client-chosen"
    finally:
        context._serve_request_context.reset(token)
