"""`python -m local --mode ray-pd`: Ray Serve LLM's own P/D app, with our P/D app's engine configs.

What flows through here: the Serve config `make serve` renders for the disaggregated app (the
spec's prefill and decode LLMConfigs, the ingress's Serve options) -> `stock_config()`: one
application whose import path is Ray's own builder, `ray.serve.llm:build_pd_openai_app`, with
those two LLMConfigs and the ingress's deployment options, less what only our code reads (every
value that names a class or function of ours, such as the autoscaling policy and a server or
router class, and every experimental_configs key Ray does not read: our streaming switches) and
less our front door (its
auth, deadlines and user_config) -> Ray's ingress, PDDecodeServer and PDPrefillServer, built by
Ray -> the app a user of Ray Serve LLM would run on the same engines, to state each of our
features' cost against (`make bench-goodput`). `stock_ray_env()` takes the same out of the Ray
nodes' environment (the engine class every LLMServer is built from).

Local only, never rendered for the cloud: the stacks deploy serving.app. The local vLLM plugin
stays on the nodes' PYTHONPATH for both apps (local/vllm_plugin.py: a fix for this machine's
NIXL agents, not a feature of either app).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

RAY_PD_MODE = "ray-pd"
RAY_PD_IMPORT_PATH = "ray.serve.llm:build_pd_openai_app"
OUR_PACKAGE = "serving"
# Keys of Ray's PDServingArgs (Ray 2.60 serving_patterns/prefill_decode/builder.py) the stock
# app is given; ingress_cls_config is left to Ray's default (its OpenAiIngress).
_ENGINE_ARGS = ("prefill_config", "decode_config")
# The LLMConfig.experimental_configs keys Ray Serve LLM 2.60 reads (ray/llm/_internal/serve/):
# core/server/llm_server.py, serving_patterns/prefill_decode/pd_server.py and builder.py,
# engines/vllm/kv_transfer/nixl.py and moriio.py, routing_policies/kv_aware/constants.py. Any
# other key in our render is ours (read by serving/engines only) and is left out.
RAY_EXPERIMENTAL_KEYS = frozenset(
    {
        "stream_batching_interval_ms",
        "pd_tokenize_once",
        "_prewarm_prefill_decode",
        "NIXL_SIDE_CHANNEL_PORT_BASE",
        "MORI_HANDSHAKE_PORT_BASE",
        "MORI_NOTIFY_PORT_BASE",
        "KV_EVENTS_PORT_BASE",
        "KV_TOKEN_PORT_BASE",
        "KV_INDEXER_THREADS",
    }
)


def names_ours(value: Any) -> bool:
    """A string that is an import path into our package ("serving.x:Y", "serving.x.Y")."""
    return isinstance(value, str) and value.split(":")[0].split(".")[0] == OUR_PACKAGE and "." in value


def _strip(d: Mapping[str, Any]) -> dict[str, Any]:
    """`d` without the options that name our code: a key whose value names it, or whose dict
    value does at its top level (an autoscaling policy, a request router's config)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if names_ours(v) or (isinstance(v, Mapping) and any(names_ours(x) for x in v.values())):
            continue
        out[k] = _strip(v) if isinstance(v, Mapping) else copy.deepcopy(v)
    return out


def stock_llm_config(llm_config: Mapping[str, Any]) -> dict[str, Any]:
    """One of our rendered LLMConfigs as Ray's own app takes it: engine kwargs, runtime env,
    placement and Serve options unchanged; our classes and our experimental_configs keys left out."""
    out = _strip(llm_config)
    if "experimental_configs" in out:
        out["experimental_configs"] = {
            k: v for k, v in out["experimental_configs"].items() if k in RAY_EXPERIMENTAL_KEYS
        }
    return out


def stock_app(app: Mapping[str, Any]) -> dict[str, Any]:
    """Our disaggregated application -> Ray's P/D application on the same engines."""
    args = app["args"]
    if args.get("mode") != "disaggregated":
        raise ValueError(f"application {app['name']!r} is not the disaggregated app (mode {args.get('mode')!r})")
    return {
        "name": app["name"],
        "route_prefix": app["route_prefix"],
        "import_path": RAY_PD_IMPORT_PATH,
        "args": {
            **{k: stock_llm_config(args[k]) for k in _ENGINE_ARGS},
            # Serve's options (replicas, queues, placement on the head, drain): no code of ours.
            "ingress_deployment_config": _strip(args.get("ingress_deployment_config") or {}),
        },
    }


def stock_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A rendered one-model disaggregated config -> the same with Ray's own P/D app in place of ours."""
    apps = config["applications"]
    if len(apps) != 1:
        raise ValueError(f"--mode {RAY_PD_MODE} takes the one-model disaggregated app, not {len(apps)} applications")
    return {**copy.deepcopy(dict(config)), "applications": [stock_app(apps[0])]}


def stock_ray_env(env: Mapping[str, str]) -> dict[str, str]:
    """The Ray nodes' environment without the variables that name our code (Ray Serve LLM's
    engine class, RAYLLM_VLLM_ENGINE_CLS: serving.spec.base BUFFERED_ENGINE_CLS)."""
    return {k: v for k, v in env.items() if not names_ours(v)}


def app_mode(app: Mapping[str, Any]) -> str:
    """The target a rendered application serves: our apps' `args.mode`, or ray-pd for Ray's own."""
    return RAY_PD_MODE if app.get("import_path") == RAY_PD_IMPORT_PATH else app["args"]["mode"]


def ray_env_for(mode: str, env: Mapping[str, str]) -> dict[str, str]:
    """The Ray nodes' environment for a local run in `mode` (ray-pd: stock_ray_env)."""
    return stock_ray_env(env) if mode == RAY_PD_MODE else dict(env)
