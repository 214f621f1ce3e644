"""The P/D application graph with a decode server that survives prefill failures.

What flows through here: the P/D builder args (prefill_config, decode_config, ingress
options and class) plus the resilience values come in; a Serve `Application` goes out:
ingress -> ResilientPDDecodeServer -> PDPrefillServer, the same three tiers that Ray's
`build_pd_openai_app` builds (Ray 2.60, ray/llm/_internal/serve/serving_patterns/
prefill_decode/builder.py), composed from the public `ray.serve.llm.build_llm_deployment`
so that the decode tier can be our subclass. Ray's builder hard-codes PDDecodeServer
(LLMConfig.server_cls is ignored there), which is why this module exists. Without the
ingress (`build_pd_engines`), the same two tiers are one model's own application in the
many-model form (serving.app.build_model_app).

Not covered here: data-parallel engines (DPPD*Server; serving.app.build_app hands those
to Ray's own builder) and RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ray import serve
from ray.serve.llm import build_llm_deployment
from ray.serve.llm.deployment import LLMServer, PDDecodeServer, PDPrefillServer

from serving import ray_internals as ri
from serving.core import metrics
from serving.core.calls import aclose_quietly, is_client_error, is_server_error
from serving.core.cluster_watch import ClusterWatch
from serving.core.failures import Reason
from serving.core.prompts import prompt_count
from serving.engines.circuit import Circuit
from serving.engines.kv_router import KV_ROUTE_KWARG, KvPrefillServer, KvRoutes, scorer_deployment
from serving.engines.prefill_hop import Path, PrefillOutcome, orchestrate, prompt_tokens_bound, remote_prefill
from serving.engines.streaming import EagerFirstChunkMixin
from serving.spec import ResilienceSpec
from serving.spec.base import KV_SCORER_TIMEOUT_S

logger = logging.getLogger("ray.serve")

# vLLM's EngineArgs.max_num_seqs when the engine kwargs leave it unset (vllm/engine/arg_utils.py,
# 0.29 and 0.32: 256 on GPUs; the CPU backend's default is lower, which only makes the KV-ready
# deadline apply more often).
DEFAULT_MAX_NUM_SEQS = 256


class ResilientPDDecodeServer(EagerFirstChunkMixin, PDDecodeServer):
    """Ray's decode-side orchestrator, with the prefill hop made fault tolerant.

    chat/completions: remote prefill under a deadline, retried, circuit-broken; local
    prefill on this decode engine when the remote path fails (see serving.engines.prefill_hop).
    Connectors that bind a peer or hand off concurrently (MoRIIO, WRITE mode) keep Ray's own
    path. With `pd_tokenize_once` (Ray's experimental config, which the spec sets from
    kvTransfer.reusePromptTokenIds) prefill returns the prompt's token ids and decode renders
    with them instead of tokenizing the prompt a second time, as Ray's own path does. The first
    streamed chunk leaves at once (serving.engines.streaming; the mixin comes first so its
    `_batch_output_stream` wins).
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits async constructors, as Ray's own
        self,
        llm_config: Any,
        *,
        prefill_server: Any,
        resilience: Mapping[str, Any] | None = None,
        engine_cls: Any = None,
        model_downloader: Any = None,
        kv_scorer: Any = None,
    ) -> None:
        if resilience is None:
            raise ValueError("ResilientPDDecodeServer needs the resilience values")
        self._res_cfg = ResilienceSpec.from_args(resilience)
        self._prefill_circuit = Circuit(self._res_cfg.circuit_open_s, self._res_cfg.circuit_failures)
        # Requests this replica has open, against the engine's sequence slots: the KV-ready
        # deadline only runs while a new request can be scheduled at once (else a slow first
        # token is queueing on a saturated decode, and rerunning it here would add load).
        self._open_requests = 0
        self._seq_slots = int(llm_config.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
        self._path_counter = metrics.counter(metrics.PREFILL_PATH)
        self._prefill_retry_counter = metrics.counter(metrics.PREFILL_RETRIES)
        self._local_prefill_counter = metrics.counter(metrics.LOCAL_PREFILLS)
        # The prefill tier's KV scorer (serving/engines/kv_router.py) when it routes by KV state.
        self._kv_routes = None if kv_scorer is None else KvRoutes(kv_scorer, llm_config.model_id, KV_SCORER_TIMEOUT_S)
        await super().__init__(
            llm_config,
            prefill_server=prefill_server,
            engine_cls=engine_cls,
            model_downloader=model_downloader,
        )
        # Serve's own word on the prefill deployment: with no running replica (a restart
        # takes minutes in the cloud), requests prefill here at once instead of queueing.
        self._watch = _prefill_watch()
        if self._pd_tokenize_once:
            logger.info("decode renders prompts with the token ids prefill returns (pd_tokenize_once)")

    def _upstream_path(self) -> bool:
        backend = self._get_connector_backend()
        return bool(backend.requires_peer_binding or backend.concurrent_handoff)

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        if self._upstream_path():
            return await super().chat(request, raw_request_info)
        return self._resilient(request, raw_request_info, "chat")

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        if self._upstream_path():
            return await super().completions(request, raw_request_info)
        return self._resilient(request, raw_request_info, "completions")

    def _prefill_method(self, method: str, raw_request_info: Any) -> Any:
        handle = self._prefill_handle
        model = serve.get_multiplexed_model_id()
        if model:
            handle = handle.options(multiplexed_model_id=model)
        if raw_request_info is not None:
            session_id = ri.session_id_from_headers(raw_request_info.headers)
            if session_id:
                handle = handle.options(session_id=session_id)
        return getattr(handle, method)

    def _resilient(self, request: Any, raw_request_info: Any, method: str) -> AsyncIterator[Any]:
        backend = self._get_connector_backend()
        prefill_method = self._prefill_method(method, raw_request_info)
        cfg = self._res_cfg
        # Ray's LLMServer runs a request on this replica's own engine (no remote prefill).
        local = getattr(LLMServer, method)

        route: list[int] = []  # the KV-chosen prefill worker, for the first call only

        def call_prefill() -> Any:
            prefill_request = prefill_request_for(backend, request)
            self._request_prefill_token_ids(prefill_request)  # tokenize-once: prefill returns them
            if route:
                return prefill_method.remote(prefill_request, raw_request_info, **{KV_ROUTE_KWARG: route.pop()})
            return prefill_method.remote(prefill_request, raw_request_info)

        async def prefill() -> PrefillOutcome:
            if self._kv_routes is not None and not self._prefill_circuit.is_open:
                worker = await self._kv_routes.choose(request)
                if worker is not None:
                    route.append(worker)
            outcome = await remote_prefill(
                call_prefill,
                prompt_tokens=prompt_tokens_bound(request),  # a long prompt's deadline grows with it
                is_error=lambda c: isinstance(c, ri.ErrorResponse),
                is_refusal=is_client_error,
                cfg=cfg,
                circuit=self._prefill_circuit,
                on_retry=lambda r: self._prefill_retry_counter.inc(tags={"reason": r.value}),
                no_replica=self._prefill_down,
            )
            if self._kv_routes is not None and outcome.chunk is None:
                self._kv_routes.release()  # no engine may report this request finished
            return outcome

        async def decode_with(prefill_chunk: Any) -> AsyncIterator[Any]:
            decode_request = backend.prepare_decode_request(request=request, peer=None, prefill_response=prefill_chunk)
            ids = self._decode_reuse_ids(prefill_chunk)
            if not ids:
                return await local(self, decode_request, raw_request_info)
            return reusing_prompt_ids(ids, lambda: local(self, decode_request, raw_request_info))

        async def decode_local() -> AsyncIterator[Any]:
            # The untouched request: no kv_transfer_params, so the decode engine prefills.
            return await local(self, request, raw_request_info)

        model = self._llm_config.model_id
        streamed = bool(getattr(request, "stream", False))

        def on_path(path: Path, reason: Reason | None) -> None:
            self._path_counter.inc(tags={"model": model, "path": path.value, "reason": reason.value if reason else ""})
            if reason is not None:
                self._local_prefill_counter.inc(tags={"reason": reason.value})

        def kv_ready_timeout_s() -> float | None:
            # A non-streamed answer comes whole (the first item is the last): its time is not
            # the KV transfer's; vLLM's kv_load_failure_policy and the ingress's total
            # deadline bound it instead.
            if not streamed or self._open_requests > self._seq_slots:
                return None
            return cfg.kv_ready_timeout_s

        n = getattr(request, "n", None) or 1
        batch = method == "completions" and prompt_count(getattr(request, "prompt", None)) > 1
        return self._counted(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_server_error,
                kv_ready_timeout_s=kv_ready_timeout_s,
                on_path=on_path,
                local_reason=Reason.PARALLEL_SAMPLING if n > 1 else Reason.PROMPT_BATCH if batch else None,
            )
        )

    def _prefill_down(self) -> bool:
        if self._watch is None:
            return False
        return self._watch.replicas(getattr(self._prefill_handle, "deployment_name", "")) == 0

    async def _counted(self, gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
        self._open_requests += 1
        try:
            async for item in gen:
                yield item
        finally:
            self._open_requests -= 1


def prefill_request_for(backend: Any, request: Any) -> Any:
    """The request the prefill tier runs: Ray's (its connector's `prepare_prefill_request`:
    the KV-transfer parameters, `max_tokens` 1, not streamed), with every other field that
    bounds the output's length made to fit that one token. Ray 2.60 leaves them as the client
    sent them (kv_transfer/base.py clamp_request_to_single_token), and vLLM refuses
    `min_tokens` > `max_tokens` (vllm/sampling_params.py, 0.29 and 0.32): a client's
    `min_tokens: 5` was a 400 under P/D. Prefill's token is never sent; decode generates
    every token the client gets under the client's own bounds."""
    out = backend.prepare_prefill_request(request=request, peer=None)
    if (getattr(out, "min_tokens", 0) or 0) > 1:
        out.min_tokens = 0
    return out


async def reusing_prompt_ids(ids: list[int], start: Callable[[], Awaitable[AsyncIterator[Any]]]) -> AsyncIterator[Any]:
    """The decode engine's stream, started and read with prefill's prompt token ids published
    (Ray's `reuse_prompt_token_ids`): vLLM renders the prompt when the stream is first read,
    in this task or one it starts, and takes the ids instead of tokenizing. The engine's
    stream is closed with this one, so an abort (a KV-ready timeout) reaches the engine."""
    with ri.reuse_prompt_token_ids(ids):
        gen = await start()
        try:
            async for item in gen:
                yield item
        finally:
            await aclose_quietly(gen)


def _prefill_watch() -> ClusterWatch | None:
    """A ClusterWatch of this replica's application (None outside a Serve replica)."""
    try:
        ctx = serve.get_replica_context()
    except Exception:
        return None
    watch = ClusterWatch(ctx.app_name, ctx.deployment)
    watch.start()
    return watch


def build_pd_engines(pd: Any, resilience: Mapping[str, Any]) -> Any:
    """The decode tier bound to its prefill tier (ResilientPDDecodeServer -> PDPrefillServer),
    from Ray's validated PDServingArgs `pd`: the engines of one P/D model, without an ingress."""
    ResilienceSpec.from_args(resilience)  # refuse bad values before anything is built
    # Ray's builder types deployment classes as its LLMServer; ours are subclasses of it.
    kv_aware = ri.is_kv_aware(pd.prefill_config)
    prefill_cls: Any = KvPrefillServer if kv_aware else PDPrefillServer
    decode_cls: Any = ResilientPDDecodeServer
    for role, config in (("prefill", pd.prefill_config), ("decode", pd.decode_config)):
        if config.engine_kwargs.get("data_parallel_size", 1) > 1:
            raise ValueError(f"{role}: data_parallel_size > 1 is not supported by the resilient P/D graph")
    if ri.is_kv_aware(pd.decode_config):
        raise ValueError("decode: KV-aware routing is for the prefill tier only (serving/engines/kv_router.py)")
    prefill = build_llm_deployment(pd.prefill_config, name_prefix="Prefill:", deployment_cls=prefill_cls)
    bind: dict[str, Any] = {"prefill_server": prefill, "resilience": dict(resilience)}
    if kv_aware:
        bind["kv_scorer"] = scorer_deployment(prefill, pd.prefill_config)
    return build_llm_deployment(pd.decode_config, name_prefix="Decode:", bind_kwargs=bind, deployment_cls=decode_cls)


def pd_args(builder_args: Mapping[str, Any]) -> Any:
    """`builder_args` validated by Ray's own PDServingArgs (the same inputs accepted and refused
    as by build_pd_openai_app); the config fields are LLMConfig objects from here on."""
    return ri.PDServingArgs.model_validate(dict(builder_args))
