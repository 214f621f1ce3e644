"""What `make serve` deploys: the cloud's Serve config rendered for this machine's CPUs.

What flows through here: a mode and the tiny model's folder -> a CPU `ServingSpec` (float32,
eager mode) -> `ServingSpec.serve_config(Target(...))`, the SAME function that renders the
RayService's serveConfigV2 -> the config dict, with only the local overrides: the HTTP host
(127.0.0.1 instead of 0.0.0.0), and with `both` a second application (the aggregated one)
under its own name and route prefix. Everything under `args` is exactly what the spec renders.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from infra.paths import ROOT
from local.ray_pd import RAY_PD_MODE, app_mode
from serving.spec import APP_NAME, TELEMETRY_OFF_ENV, DataPlane, Mode, ServingSpec, Target
from serving.spec.models import PER_MODEL_KEYS

MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 1024
AGGREGATED_APP = f"{APP_NAME}-aggregated"
AGGREGATED_PREFIX = "/aggregated"
HOST = "127.0.0.1"
MODES = ("disaggregated", "aggregated", "both", RAY_PD_MODE)  # ray-pd: local/ray_pd.py
# `make serve PD_MODELS=2`: the many-model form. The tiny model P/D as before, and a
# second model, aggregated on the decode node, with a LoRA adapter the project builds itself
# (local/tiny_lora.py) loaded on demand from a local S3 (local/s3.py); both
# behind the one front door. The second model has the same weights under its own id: what
# the front door routes on is the id, and two engines of one recipe cost no second build.
MODELS_ENV = "PD_MODELS"
# make serve PD_DATA_PLANE=haproxy|grpc|ray-proxy (serving.spec DataPlane; default the spec's).
DATA_PLANE_ENV = "PD_DATA_PLANE"
MAX_LOCAL_MODELS = 3
MODEL_B_ID = "tiny-llama-b"
# PD_MODELS=3 adds a third, aggregated, at zero replicas (Serve starts it on its first
# request): how the e2e test adds a model to a running stack without a third engine's CPU.
MODEL_C_ID = "tiny-llama-c"
# The adapter's rank and how many stay loaded: one adapter, rank 8 (local/tiny_lora.py).
LOCAL_LORA = {"maxAdaptersPerReplica": 2, "maxLoraRank": 8, "maxLoras": 1}

# The tiny model's tool calling (serving.model.tools / chatTemplate, serving/spec/tools.py).
LOCAL_TOOL_PARSER = "hermes"
LOCAL_TOOLS: dict[str, object] = {"parser": LOCAL_TOOL_PARSER, "autoChoice": True}
LOCAL_CHAT_TEMPLATE = "local/chat_templates/tiny-tools.jinja"
LOCAL_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
# vLLM 0.32 forces a named or `required` tool choice through xgrammar's structural tag for
# parsers that declare one (hermes does: tool_parsers/hermes_tool_parser.py
# structural_tag_model), and that grammar ignores disable_any_whitespace: the tiny model then
# writes newlines inside the arguments until max_tokens (seen on make serve). With this off
# (envs.py, read when the parser class is defined) the choice is forced by the tools' JSON
# schema instead (abstract_tool_parser.py adjust_request), which honours the setting above.
LOCAL_TOOL_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}

# Logical CPUs per node. Ray only counts them (the OS shares the real cores); each engine
# replica takes 2 (its actor plus the vLLM worker bundle). The head offers none, as in the
# cloud: the ingress, proxy and controller ask for no CPU.
HEAD_CPUS = 0
PREFILL_CPUS = 2
DECODE_CPUS = 6  # room for a second disaggregated decode replica (autoscaling) next to the aggregated engine

# Local Serve autoscaling of the decode role (short delays so a test can watch 1 -> 2 -> 1).
LOCAL_DECODE_TARGET = 8
LOCAL_UPSCALE_S = 2.0
LOCAL_DOWNSCALE_S = 10.0
LOCAL_DECODE_AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "targetOngoingRequests": LOCAL_DECODE_TARGET,
    "upscaleDelayS": LOCAL_UPSCALE_S,
    "downscaleDelayS": LOCAL_DOWNSCALE_S,
}
# `make serve SIGNALS=1`: each role scales on its own engine signals, read from a
# local Prometheus (local/prometheus.py) as in the cloud; prefill may then add a second
# replica too. The thresholds come from the SLO by the cloud's own rule
# (serving.spec.scaling.slo_thresholds: prefill adds a replica when prompts queue for half the
# TTFT objective, decode when it runs more sequences than its target); the local objective is
# the tiny model's on two shared cores: 0.5 s to a first token (about four times what one P/D
# request takes here alone, docs/performance.md), 0.1 s between tokens. At 0.25 s prefill
# scaled out under output-heavy load: three engines on two cores stretch the prefill
# engine's queue time to 0.15 s when it has little to do, a coupling GPU nodes do not have.
LOCAL_SLO = {"ttftSeconds": 0.5, "itlSeconds": 0.1}
LOCAL_PREFILL_AUTOSCALING = {**LOCAL_DECODE_AUTOSCALING}
LOCAL_SIGNAL_ROLES = ("prefill", "decode")
SIGNALS_ENV = "PD_SIGNALS"
# `make serve SCALE_TO_ZERO=1`: decode may scale to zero replicas when idle (it starts with
# one); the spec then wants a fallback for `unavailable` (PD_FALLBACK_BASE_URL) to answer
# while it starts again.
SCALE_TO_ZERO_ENV = "PD_SCALE_TO_ZERO"
# `make serve PD_PREFILL_ROUTER=kv-aware`: the P/D prefill tier routed by where a prompt's KV
# cache already is (serving/engines/kv_router.py), as a stack opts in with prefill.router.
# Unset, the stacks' default (power-of-two): `make bench` measures what a stack runs unless it
# opts in. The e2e session's shared stack sets it, so the P/D e2e tests run through the scorer.
PREFILL_ROUTER_ENV = "PD_PREFILL_ROUTER"
# Serve's replicas and handles push their load every 10 s by default; locally every second,
# so decisions follow the load within seconds (ray/serve/_private/constants.py).
LOCAL_SERVE_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}

LOCAL_ENTRY_POINTS = Path(__file__).resolve().parent / "entry_points"


def cluster_env() -> dict[str, str]:
    """Environment of the local Ray cluster (its raylets and workers inherit it)."""
    return {
        "RAY_AUTH_MODE": "disabled",  # local-only cluster on 127.0.0.1
        # The repository, and the local-only vLLM plugin's entry point (local/vllm_plugin.py).
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), str(LOCAL_ENTRY_POINTS), os.environ.get("PYTHONPATH", "")) if p
        ),
        # Nothing may be downloaded: the model is on disk.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **TELEMETRY_OFF_ENV,  # as every stack's Ray processes (ServingSpec.ray_env)
        **LOCAL_SERVE_ENV,
    }


# make serve's environment for hybrid routing (docs/hybrid-routing.md). The provider's key,
# PD_FALLBACK_API_KEY, is read by the ingress replicas themselves and never rendered.
FALLBACK_ENV = {
    "PD_FALLBACK_BASE_URL": "baseUrl",
    "PD_FALLBACK_MODEL": "model",
    "PD_FALLBACK_OVERFLOW_AT": "overflowAt",
}
LIMITS_ENV = {"PD_LIMIT_RPM": "requestsPerMinute", "PD_LIMIT_TPM": "tokensPerMinute"}
_WHOLE_NUMBER_FIELDS = {"overflowAt", "requestsPerMinute", "tokensPerMinute"}


class LocalConfigError(ValueError):
    """A bad make-serve setting; the message is one line naming the variable."""


def hybrid_from_env(environ: dict[str, str]) -> dict[str, Any]:
    """The spec's `fallback` and `limits` sections from PD_FALLBACK_* and PD_LIMIT_* (unset or
    empty variables are left out; without PD_FALLBACK_BASE_URL there is no fallback)."""

    def section(names: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for var, field in names.items():
            raw = environ.get(var, "").strip()
            if not raw:
                continue
            if field in _WHOLE_NUMBER_FIELDS:
                try:
                    out[field] = int(raw)
                except ValueError:
                    raise LocalConfigError(f"{var}={raw!r} is not a whole number") from None
            else:
                out[field] = raw
        return out

    hybrid: dict[str, Any] = {}
    fallback = section(FALLBACK_ENV)
    if fallback:
        if "baseUrl" not in fallback:
            raise LocalConfigError("PD_FALLBACK_MODEL/PD_FALLBACK_OVERFLOW_AT are set but PD_FALLBACK_BASE_URL is not")
        fallback.setdefault("model", MODEL_ID)
        hybrid["fallback"] = fallback
    limits = section(LIMITS_ENV)
    if limits:
        hybrid["limits"] = limits
    return hybrid


# Engine replicas per role: `--prefill-replicas/--decode-replicas`, or PD_REPLICAS=N for
# both (`make serve REPLICAS=2`), so that the retry paths have a second replica to go to.
REPLICAS_ENV = "PD_REPLICAS"
MAX_LOCAL_REPLICAS = 2

# Deadlines for the tiny model on two shared cores: a prefill takes tens of ms here, and a
# restarted engine needs one to two minutes, which the fallbacks must bridge.
LOCAL_RESILIENCE = {
    # Not 1 s: at 16 streams on 2 cores the prefill engine can answer nothing for a second.
    "prefillTimeoutS": 3.0,
    # The tiny model prefills in milliseconds: a second without a replica taking the call is
    # already a dead or overloaded prefill tier (the cloud's default is 4 s).
    "prefillQueueTimeoutS": 1.0,
    "prefillAttempts": 2,
    "kvReadyTimeoutS": 5.0,
    "firstTokenTimeoutS": 45.0,
    "totalTimeoutS": 120.0,
    "failFastS": 2.0,
    "decodeAttempts": 2,
    "circuitOpenS": 3.0,
    "retryAfterS": 1,
}
# Bounded queues per role, small enough that `make chaos`'s 3x burst overflows them. Serve
# counts every request not yet assigned to a replica as queued, so requests that arrive
# together are refused past max_queued_requests even while replicas have free slots (Ray
# 2.60 ray/serve/_private/router.py, wrap_request_assignment): the queue is at least as
# deep as the bursts a replica's slots should absorb (the autoscaling test starts 24 at once).
LOCAL_ROLE_LIMITS = {"maxOngoingRequests": 16, "maxQueuedRequests": 32}


# --- what gets deployed ------------------------------------------------------------------
def local_spec(
    mode: Mode,
    model_dir: Path,
    *,
    auth: bool = True,
    hybrid: dict[str, Any] | None = None,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    signals: bool = False,
    scale_to_zero: bool = False,
    fixed: bool = False,
    models: int = 1,
    lora_path: str | None = None,
    key_models: dict[str, list[str]] | None = None,
    data_plane: str | None = None,
    prefill_router: str | None = None,
) -> ServingSpec:
    """The spec a stack file would hold, with CPU-friendly values (plus `hybrid_from_env`);
    with `models=2` the many-model form (the second model's adapters at `lora_path`, and
    `key_models`: key ids limited to some models)."""
    try:
        data = _local_spec(
            mode,
            model_dir,
            auth=auth,
            hybrid=hybrid or {},
            prefill_replicas=prefill_replicas,
            decode_replicas=decode_replicas,
            signals=signals,
            scale_to_zero=scale_to_zero,
            fixed=fixed,
        )
        if data_plane is not None:
            data["ingress"] = {**data["ingress"], "dataPlane": data_plane}
        if prefill_router is not None and mode is Mode.DISAGGREGATED:
            data["prefill"] = {**data["prefill"], "router": prefill_router}
        if models > 1:
            data = _many_models(data, models, lora_path, key_models or {})
        return ServingSpec.model_validate(data)
    except ValidationError as err:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise LocalConfigError(f"the PD_FALLBACK_*/PD_LIMIT_* settings are not valid: {where}") from None


def _local_spec(
    mode: Mode,
    model_dir: Path,
    *,
    auth: bool,
    hybrid: dict[str, Any],
    prefill_replicas: int,
    decode_replicas: int,
    signals: bool = False,
    scale_to_zero: bool = False,
    fixed: bool = False,
) -> dict[str, Any]:
    def role(n: int) -> dict[str, Any]:
        return {"minReplicas": n, "maxReplicas": n, **LOCAL_ROLE_LIMITS}

    # Serve autoscaling as in the cloud, with smaller numbers: with one decode replica asked
    # for, disaggregated decode may add a second on the decode node. More than
    # LOCAL_DECODE_TARGET requests in flight for a few seconds adds it; idle for
    # LOCAL_DOWNSCALE_S removes it. The aggregated app (mode both) shares the decode node and
    # keeps its engines fixed; so does an explicit replica count (make serve REPLICAS=2), and
    # `fixed` (make bench: per-token cost of a steady layout; a replica started and stopped
    # within a level would be counted as streaming cost).
    autoscaled = mode is Mode.DISAGGREGATED and decode_replicas == 1 and not fixed
    decode = {**LOCAL_DECODE_AUTOSCALING, **LOCAL_ROLE_LIMITS} if autoscaled else role(decode_replicas)
    if scale_to_zero and autoscaled:
        decode = {**decode, "minReplicas": 0, "initialReplicas": 1}
    prefill = role(prefill_replicas)
    if signals and mode is Mode.DISAGGREGATED and prefill_replicas == 1 and not fixed:
        prefill = {**LOCAL_PREFILL_AUTOSCALING, **LOCAL_ROLE_LIMITS}
    return {
        **hybrid,
        "model": {
            "id": MODEL_ID,
            "source": str(model_dir),
            "dtype": "float32",
            "maxModelLen": MAX_MODEL_LEN,
            # Tool calling as a cloud model has it: vLLM's hermes parser, and a template that
            # renders tools in its format (the same prompt as the model's own without them).
            "tools": LOCAL_TOOLS,
            "chatTemplate": LOCAL_CHAT_TEMPLATE,
        },
        "mode": mode.value,
        "auth": "api-key" if auth else "disabled",
        # One ingress replica: a second would only compete for the same two cores.
        "ingress": {"minReplicas": 1, "maxReplicas": 1},
        # No CUDA graphs on CPU. JSON of structured outputs (a tool call under tool_choice
        # required or named, response_format) without optional whitespace: the tiny model's
        # random weights, decoding greedily, repeat a newline forever where the grammar lets
        # them; without it a schema of bounded values always ends in a valid document.
        "engineKwargs": {"enforce_eager": True, "structured_outputs_config": LOCAL_STRUCTURED_OUTPUTS},
        "prefill": prefill,
        "decode": decode,
        "resilience": LOCAL_RESILIENCE,
        "slo": LOCAL_SLO,
    }


def _many_models(
    one: dict[str, Any], models: int, lora_path: str | None, key_models: dict[str, list[str]]
) -> dict[str, Any]:
    """The one-model local spec `one` as the first of `models` models (serving.models): the
    second aggregated with its LoRA adapters, a third aggregated at zero replicas; a fallback
    maps each model to the provider's."""
    first = {k: one[k] for k in PER_MODEL_KEYS if k in one}
    data = {k: v for k, v in one.items() if k not in PER_MODEL_KEYS}
    second: dict[str, Any] = {
        "model": {**first["model"], "id": MODEL_B_ID},
        "mode": Mode.AGGREGATED.value,
        "engineKwargs": first["engineKwargs"],
        "decode": {"minReplicas": 1, "maxReplicas": 1, **LOCAL_ROLE_LIMITS},
        "slo": first["slo"],
    }
    if lora_path is not None:
        second["lora"] = {"adaptersPath": lora_path, **LOCAL_LORA}
    third = {
        **second,
        "model": {**first["model"], "id": MODEL_C_ID},
        "decode": {"minReplicas": 0, "initialReplicas": 0, "maxReplicas": 1, **LOCAL_ROLE_LIMITS},
    }
    third.pop("lora", None)
    data["models"] = [first, second, third][:models]
    if "fallback" in data:
        theirs = data["fallback"]["model"]
        data["fallback"] = {**data["fallback"], "model": {m["model"]["id"]: theirs for m in data["models"]}}
    if key_models:
        keys = dict((data.get("limits") or {}).get("keys") or {})
        for kid, ids in key_models.items():
            keys[kid] = {**keys.get(kid, {}), "models": list(ids)}
        data["limits"] = {**(data.get("limits") or {}), "keys": keys}
    return data


# What a token costs on the local stack, per cost phase (serving.spec.Target.token_prices): notional
# prices, not a measurement (the cloud's come from the capacity plan, infra/plan/costs.py), so that
# make serve exports per-key costs and make usage has figures to print: USD 1 per million prompt
# tokens the engines compute, USD 4 per million output tokens.
LOCAL_TOKEN_PRICES = {"prefill": 1e-6, "decode": 4e-6}


def local_target(signals: bool = False) -> Target:
    """CPU target: vLLM's CPU KV-cache size and thread binding, the notional token prices; with
    `signals`, the per-role policies' engine series (the local Prometheus's `role` label)."""
    from local.prometheus import ROLE_LABEL

    return Target(
        token_prices=LOCAL_TOKEN_PRICES,
        metrics_selectors={r: f'{ROLE_LABEL}="{r}"' for r in LOCAL_SIGNAL_ROLES} if signals else {},
        accelerator_type=None,
        # One host, several Ray nodes: one proxy (on the head) or they clash on the port.
        proxy_location="HeadOnly",
        engine_env={
            # GiB of KV cache per engine; the tiny model needs far less.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Several engines share these cores, and each NIXL worker keeps a UCX progress
            # thread busy: pinning ('auto', or a core list) stacks them onto the same
            # cores and made decode ~9x slower per token here. Let the OS place threads.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            **LOCAL_TOOL_ENV,
        },
    )


def data_plane_env(data_plane: str | None) -> dict[str, str]:
    """Ray's environment from the local spec with `data_plane` (the spec's default when None):
    the data plane's switches and Serve's control-loop interval, which Ray reads in every
    process, not from the Serve config, and HAProxy's hard stop from the local deadlines
    (ServingSpec.ray_env)."""
    return local_spec(Mode.DISAGGREGATED, Path("/models/check"), data_plane=data_plane).ray_env()


def stack_ray_env(data_plane: str | None) -> dict[str, str]:
    """The environment a local stack's Ray cluster starts with, before its API keys, S3 and
    Prometheus settings (local/__main__.py; bench/idle_floor.py starts the bare cluster so)."""
    return {**cluster_env(), **data_plane_env(data_plane)}


def local_data_plane(data_plane: str | None) -> DataPlane:
    """The data plane a local run uses (`data_plane`, else the spec's default)."""
    return local_spec(Mode.DISAGGREGATED, Path("/models/check"), data_plane=data_plane).ingress.data_plane


def models_problem(models: int, mode: str) -> str | None:
    """Why `models` models cannot run in `mode` (the many-model form serves the tiny model
    P/D), else None."""
    if models > 1 and mode != Mode.DISAGGREGATED.value:
        return f"{MODELS_ENV}={models} serves the tiny model disaggregated: leave the mode at its default"
    return None


def render_local_config(
    mode: str,
    model_dir: Path,
    *,
    port: int,
    auth: bool = True,
    target: Target | None = None,
    hybrid: dict[str, Any] | None = None,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    signals: bool = False,
    scale_to_zero: bool = False,
    fixed: bool = False,
    models: int = 1,
    lora_path: str | None = None,
    key_models: dict[str, list[str]] | None = None,
    data_plane: str | None = None,
    prefill_router: str | None = None,
) -> dict[str, Any]:
    """The Serve config to deploy locally: serve_config() plus the local overrides."""
    target = target or local_target(signals)
    modes = [Mode.DISAGGREGATED, Mode.AGGREGATED] if mode == "both" else [Mode(mode)]
    problem = models_problem(models, mode)
    if problem:
        raise LocalConfigError(problem)
    configs = [
        local_spec(
            m,
            model_dir,
            auth=auth,
            hybrid=hybrid,
            prefill_replicas=prefill_replicas,
            decode_replicas=decode_replicas,
            signals=signals,
            scale_to_zero=scale_to_zero,
            fixed=fixed,
            models=models,
            lora_path=lora_path,
            key_models=key_models,
            data_plane=data_plane,
            prefill_router=prefill_router,
        ).serve_config(target, port=port)
        for m in modes
    ]
    config = copy.deepcopy(configs[0])
    config["http_options"]["host"] = HOST
    if mode == "both":
        agg = configs[1]["applications"][0]
        agg["name"] = AGGREGATED_APP
        agg["route_prefix"] = AGGREGATED_PREFIX
        config["applications"].append(agg)
    return config


def admission_bound(config: dict[str, Any]) -> int:
    """Requests the disaggregated app admits at once: decode's running plus queued slots
    (Serve's max_ongoing_requests per replica, max_queued_requests per caller)."""
    for app in config["applications"]:
        if app["args"]["mode"] == "disaggregated":
            dep = app["args"]["decode_config"]["deployment_config"]
            replicas = dep["autoscaling_config"]["max_replicas"]
            return int(dep["max_ongoing_requests"] * replicas + dep["max_queued_requests"])
    raise ValueError("no disaggregated application in the config")


def app_urls(config: dict[str, Any], port: int) -> dict[str, str]:
    """OpenAI base URL (…/v1) of each application, by its mode."""
    urls = {}
    for app in config["applications"]:
        if app["route_prefix"] is None:
            continue  # a model's own application (many-model form): reached through the front door
        prefix = app["route_prefix"].rstrip("/")
        urls[app_mode(app)] = f"http://{HOST}:{port}{prefix}/v1"
    return urls
