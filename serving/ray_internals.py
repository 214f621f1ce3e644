"""The one place where the serving code reaches into Ray Serve LLM's internal modules.

What flows through here: nothing at run time; this module only re-exports the few Ray
2.60 internals that the resilience layer (serving/core/failures.py, prefill_hop.py,
ingress_resilience.py) needs and that
`ray.serve.llm` does not export. Each is named with the upstream file it comes from, so
that an upgrade has one file to check; tests/serving/test_ray_internals.py fails loudly
when any of them moves or changes shape.

Upstream: ray-project/ray, Ray 2.60.0,
  python/ray/llm/_internal/serve/core/ingress/utils.py      (_apply_openai_json_format,
                                                            _sanitize_chat_completion_request,
                                                            NON_STREAMING_RESPONSE_TYPES)
  python/ray/llm/_internal/serve/core/protocol.py           (RawRequestInfo)
  python/ray/llm/_internal/serve/core/configs/openai_api_models.py (ErrorResponse,
                                                            ModelCard, ModelList, to_model_metadata)
  python/ray/llm/_internal/common/dict_utils.py             (maybe_apply_llm_deployment_config_defaults)
  python/ray/llm/_internal/serve/serving_patterns/prefill_decode/builder.py (PDServingArgs)
  python/ray/serve/_private/http_util.py                    (session_id_from_headers)
  python/ray/serve/context.py, _private/client.py          (serve_details: the controller's
                                                            details dict that serve.status() validates)
  python/ray/serve/_private/long_poll.py, common.py, constants.py (serve_controller,
                                                            deployment_targets: Serve's long poll of
                                                            a deployment's routable replicas)
  python/ray/llm/_internal/serve/utils/batcher.py           (Batcher)
  python/ray/llm/_internal/common/patches/vllm/tokenize_once.py (reuse_prompt_token_ids: decode
                                                            renders with prefill's prompt token ids)
  python/ray/llm/_internal/serve/routing_policies/kv_aware/kv_token_tracker.py
                                                           (build_kv_token_tracker, get_worker_id as
                                                            kv_worker_id, LLM_ROUTER_DEPLOYMENT_NAME:
                                                            serving/engines/kv_router.py)
  python/ray/llm/_internal/serve/routing_policies/kv_aware/kv_aware_router.py (is_kv_aware)
  python/ray/llm/_internal/serve/routing_policies/kv_aware/vllm/tokenizer.py (kv_tokenizer)
  python/ray/serve/context.py                               (serve_request_id: the request id a
                                                            handle call carries to its replica;
                                                            serve_internal_request_id, Serve's own;
                                                            serve_request_id_as)
  python/ray/llm/_internal/serve/engines/vllm/vllm_engine.py (VLLMEngine: the engine class
                                                            serving/engines/engine_metrics.py extends)
  python/ray/llm/_internal/serve/core/server/llm_server.py  (push_telemetry_report_for_all_models,
                                                            the name _start_engine calls:
                                                            skip_usage_telemetry_when_off)
Methods and attributes of public classes that the resilience layer relies on, also checked
by the test: OpenAiIngress._get_model_id / _get_configured_serve_handle and the routing
tables it reads (_default_serve_handles, _configured_serve_handles, _model_cards,
_lora_paths: the many-model front door fills them, serving/ingress/catalog.py),
VLLMEngine._start_async_llm_engine (the engine start, around which
serving/engines/engine_metrics.py binds vLLM's Ray stat logger name),
PDDecodeServer._prefill_handle / _get_connector_backend / _pd_tokenize_once /
_request_prefill_token_ids / _decode_reuse_ids, the
connector backend's prepare_prefill_request / prepare_decode_request /
requires_peer_binding / concurrent_handoff, and Serve's
DeploymentResponseGenerator._fetch_future_result_async (python/ray/serve/handle.py: resolves
once the router has given the call to a replica).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ray.llm._internal.common.dict_utils import (
    maybe_apply_llm_deployment_config_defaults,
)
from ray.llm._internal.common.patches.vllm.tokenize_once import reuse_prompt_token_ids
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ErrorResponse,
    ModelCard,
    ModelList,
    to_model_metadata,
)
from ray.llm._internal.serve.core.ingress.utils import (
    NON_STREAMING_RESPONSE_TYPES,
)
from ray.llm._internal.serve.core.ingress.utils import (
    _apply_openai_json_format as openai_sse_packet,
)
from ray.llm._internal.serve.core.ingress.utils import (
    _sanitize_chat_completion_request as sanitize_chat_request,
)
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router import is_kv_aware
from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import (
    LLM_ROUTER_DEPLOYMENT_NAME,
    build_kv_token_tracker,
)
from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import (
    get_worker_id as kv_worker_id,
)
from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import (
    PDServingArgs,
)
from ray.llm._internal.serve.utils.batcher import Batcher
from ray.serve._private.http_util import session_id_from_headers

# Private methods of public classes that the serving code overrides or calls: (class path,
# method). `check_hooks` fails at application build time when one is gone, instead of the
# override silently never running (a renamed `_batch_output_stream` would just stop the eager
# first chunk; a missing `_fetch_future_result_async` would make every call count as taken).
HOOKS = (
    ("ray.serve.llm.deployment:LLMServer", "_batch_output_stream"),
    ("ray.serve.llm.deployment:LLMServer", "_get_batch_interval_ms"),
    ("ray.serve.handle:DeploymentResponseGenerator", "_fetch_future_result_async"),
    ("ray.serve.llm.deployment:PDDecodeServer", "_get_connector_backend"),
    ("ray.serve.llm.deployment:PDDecodeServer", "_request_prefill_token_ids"),
    ("ray.serve.llm.deployment:PDDecodeServer", "_decode_reuse_ids"),
    ("ray.serve.llm.ingress:OpenAiIngress", "_get_model_id"),
    ("ray.serve.llm.ingress:OpenAiIngress", "_get_configured_serve_handle"),
    ("ray.llm._internal.serve.engines.vllm.vllm_engine:VLLMEngine", "_start_async_llm_engine"),
)


def serve_details() -> dict[str, Any]:
    """The Serve controller's details of every application (ServeInstanceDetails as a dict),
    without the validation `serve.status()` runs on them; {} before Serve has started."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.get_serve_details() if client is not None else {}


def serve_controller() -> Any:
    """The handle of Serve's controller actor (blocking: call it off the loop)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def deployment_targets(
    controller: Any, snapshots: Mapping[tuple[str, str], int]
) -> dict[tuple[str, str], tuple[int, int]]:
    """One round of Serve's long poll for the routable replicas of deployments, keyed
    (application, deployment) with the last snapshot id seen (-1: none): the controller answers
    at once for the keys whose snapshot moved on, else when one changes, else with nothing at
    its listen timeout (30-60 s). Returns (new snapshot id, running replicas) per changed key;
    a deleted deployment has none. The keys and answers every Serve router's long poll uses
    (python/ray/serve/_private/long_poll.py LongPollHost.listen_for_change, namespace
    DEPLOYMENT_TARGETS keyed by DeploymentID; _private/common.py DeploymentTargetInfo;
    KVTokenTracker subscribes the same way, routing_policies/kv_aware/kv_token_tracker.py)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.long_poll import LongPollNamespace

    keys = {
        (LongPollNamespace.DEPLOYMENT_TARGETS, DeploymentID(name=name, app_name=app)): snapshot
        for (app, name), snapshot in snapshots.items()
    }
    updates = await controller.listen_for_change.remote(keys)
    if not isinstance(updates, dict):  # LongPollState.TIME_OUT: nothing changed
        return {}
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for (_, deployment), update in updates.items():
        info = update.object_snapshot
        running = len(info.running_replicas) if info.is_available else 0
        out[(deployment.app_name, deployment.name)] = (update.snapshot_id, running)
    return out


def kv_tokenizer(llm_config: Any) -> Any:
    """Ray 2.60's pre-routing tokenizer for `llm_config`'s engines (routing_policies/kv_aware/
    vllm/tokenizer.py `Tokenizer`: vLLM's own renderer and chat template, so its token ids are
    the engine's). It imports `load_chat_template` from `vllm.entrypoints.chat_utils`, vLLM
    0.29's module (the worker image's); vLLM 0.32 (the local stack's) moved that module to
    `vllm.renderers.chat_utils` and left the tokenizer's other imports where they were, so the
    old name is bound to the moved module where it is missing. Blocking: call it off the loop."""
    import importlib
    import sys

    try:
        importlib.import_module("vllm.entrypoints.chat_utils")
    except ModuleNotFoundError:
        sys.modules["vllm.entrypoints.chat_utils"] = importlib.import_module("vllm.renderers.chat_utils")
    from ray.llm._internal.serve.routing_policies.kv_aware.vllm.tokenizer import Tokenizer

    return Tokenizer(llm_config)


def serve_request_id() -> str:
    """The Serve request id of the request this task serves: the id every handle call it
    makes carries, and the one Ray's KV-routed engines report lifecycle events under."""
    from ray.serve.context import _get_serve_request_context

    return _get_serve_request_context().request_id


def serve_internal_request_id() -> str:
    """Serve's own id of the request this task serves: made by Serve's proxy per HTTP request
    (python/ray/serve/_private/proxy.py) and carried unchanged by every handle call the request
    makes (_private/default_impl.py get_request_metadata). Unlike `serve_request_id`, which is
    the client's `x-request-id` when it sent one, no client chooses it."""
    from ray.serve.context import _get_serve_request_context

    return _get_serve_request_context()._internal_request_id


@contextlib.contextmanager
def serve_request_id_as(request_id: str) -> Iterator[None]:
    """Within the block, this task's Serve request id (`serve_request_id`, and Ray Serve LLM's
    get_serve_request_id, the id its KV-routed engines report lifecycle events under:
    routing_policies/kv_aware/vllm/token_tracking.py) is `request_id`; the rest of the request
    context (python/ray/serve/context.py _RequestContext, a frozen dataclass) is kept."""
    import dataclasses

    from ray.serve import context

    token = context._serve_request_context.set(
        dataclasses.replace(context._get_serve_request_context(), request_id=request_id)
    )
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


def skip_usage_telemetry_when_off() -> None:
    """Ray Serve LLM's usage report, only when Ray's usage stats are on.

    After every engine start Ray 2.60's LLMServer `_start_engine` (core/server/llm_server.py)
    calls `push_telemetry_report_for_all_models`, which gets or creates a detached
    `TelemetryAgent` actor on the head node (observability/usage_telemetry/usage.py) and records
    the model's tags as Ray usage tags; those leave the cluster only with usage stats on. Every
    stack turns them off (serving.spec.base TELEMETRY_OFF_ENV), so the actor records into
    nothing, yet it stays for the cluster's life: one more Ray worker process on the head, about
    1% of a core idle on the local stack (make bench's idle probe, 2026-12-06), as much as a
    Serve replica. This binds the name llm_server calls to a wrapper that calls Ray's function
    only when usage stats are on (read per call, as Ray reads them); idempotent, per process."""
    from ray._common.usage.usage_lib import usage_stats_enabled
    from ray.llm._internal.serve.core.server import llm_server

    push = llm_server.push_telemetry_report_for_all_models
    if getattr(push, "_skips_when_usage_stats_off", False):
        return

    def push_when_usage_stats_on(*args: Any, **kwargs: Any) -> None:
        if usage_stats_enabled():
            push(*args, **kwargs)

    push_when_usage_stats_on._skips_when_usage_stats_off = True  # type: ignore[attr-defined]
    llm_server.push_telemetry_report_for_all_models = push_when_usage_stats_on


def adopt_tokenization(engine: Any) -> None:
    """vLLM's tokenization server on a started Ray engine, under either of vLLM's names.

    Ray 2.60's VLLMEngine.start (engines/vllm/vllm_engine.py) reads it from vLLM's app state as
    `openai_serving_tokenization`; vLLM 0.32 names it `serving_tokenization`
    (entrypoints/launchers/api_server/app_state.py), so on the local stack /tokenize and
    /detokenize answered 400 "This model does not support the 'tokenization' task" where plain
    vLLM serving the same model answers. Nothing changes where Ray found it."""
    if getattr(engine, "_oai_serving_tokenization", None) is None:
        state = getattr(engine, "_app_state", None)
        engine._oai_serving_tokenization = getattr(state, "serving_tokenization", None)


def check_hooks() -> None:
    """Raise RuntimeError naming every private hook of HOOKS that this Ray lacks."""
    import importlib

    missing = []
    for path, name in HOOKS:
        module, _, cls = path.partition(":")
        if not callable(getattr(getattr(importlib.import_module(module), cls), name, None)):
            missing.append(f"{path}.{name}")
    if missing:
        raise RuntimeError(
            "this Ray lacks private methods the serving code relies on (serving/ray_internals.py HOOKS): "
            + ", ".join(missing)
        )


__all__ = [
    "HOOKS",
    "LLM_ROUTER_DEPLOYMENT_NAME",
    "NON_STREAMING_RESPONSE_TYPES",
    "Batcher",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PDServingArgs",
    "RawRequestInfo",
    "VLLMEngine",
    "adopt_tokenization",
    "build_kv_token_tracker",
    "check_hooks",
    "deployment_targets",
    "is_kv_aware",
    "kv_tokenizer",
    "kv_worker_id",
    "maybe_apply_llm_deployment_config_defaults",
    "openai_sse_packet",
    "reuse_prompt_token_ids",
    "sanitize_chat_request",
    "serve_controller",
    "serve_details",
    "serve_internal_request_id",
    "serve_request_id",
    "serve_request_id_as",
    "session_id_from_headers",
    "skip_usage_telemetry_when_off",
    "to_model_metadata",
]
