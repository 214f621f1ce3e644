"""Which cores each local engine's compute threads run on: `make serve PD_ENGINE_CPUS=...`.

What flows through here: `--engine-cpus` or PD_ENGINE_CPUS, e.g. "prefill=0,decode=1,aggregated=0-1"
(a role, `=`, and a core list in vLLM's own syntax: ids and ranges joined by commas) ->
`parse()`: role -> core list, checked against the machine's cores -> `pin()`: the rendered
Serve config with each engine's `VLLM_CPU_OMP_THREADS_BIND` set in its LLMConfig's runtime env
(prefill_config -> prefill, decode_config -> decode, an aggregated app's llm_configs ->
aggregated), which Ray Serve LLM gives the replica actor and vLLM's processes under it inherit.
A role not named keeps the local default (`local.config.local_target`: nobind). Local only: the
cloud's Target renders no binding, and nothing here is rendered for a stack.

vLLM 0.32's CPU backend reads the variable when it starts its workers
(`vllm/utils/ompmultiprocessing.py`, OMPProcessManager: "auto", "nobind", or one core list per
local rank separated by "|", each parsed by `cpu_resource_utils.parse_id_list`): the worker's
OpenMP threads get OMP_NUM_THREADS = the list's length and are bound to those cores. A P/D
engine's NIXL worker re-pins its thread to the last core of each NUMA node on CPU
(`kv_connector/v1/nixl/base_worker.py`); the local vLLM plugin stops that where a core list is
given (local/vllm_plugin.py), or the prefill engine would compute on decode's core.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

ENGINE_CPUS_ENV = "PD_ENGINE_CPUS"
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
ROLES = ("prefill", "decode", "aggregated")
# One rank's core list as vLLM parses it: "0", "0-1", "0,2-3".
_CORES = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class EngineCpusError(ValueError):
    """A bad PD_ENGINE_CPUS / --engine-cpus value; the message is one line naming it."""


def cores(raw: str) -> list[int]:
    """A core list ("0-1,3") -> its core ids, as vLLM's parse_id_list reads it."""
    out: set[int] = set()
    for part in raw.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def parse(raw: str | None, cpu_count: Callable[[], int | None] = os.cpu_count) -> dict[str, str]:
    """ "prefill=0,decode=1,aggregated=0-1" -> {role: core list}; "" or None -> {}. A comma
    not followed by `role=` continues the previous role's list ("aggregated=0,1")."""
    if not raw or not raw.strip():
        return {}
    where = f"{ENGINE_CPUS_ENV}={raw!r}"
    out: dict[str, list[str]] = {}
    role = None
    for item in (x.strip() for x in raw.split(",")):
        if "=" in item:
            role, _, item = (s.strip() for s in item.partition("="))
            if role not in ROLES:
                raise EngineCpusError(f"{where}: {role!r} is not one of {', '.join(ROLES)}")
            if role in out:
                raise EngineCpusError(f"{where}: {role} is named twice")
            out[role] = []
        if role is None:
            raise EngineCpusError(f"{where}: start with a role, e.g. prefill=0,decode=1,aggregated=0-1")
        out[role].append(item)
    have = cpu_count() or 1
    binds = {}
    for r, parts in out.items():
        text = ",".join(parts)
        if not _CORES.match(text) or any(int(lo) > int(hi) for lo, hi in re.findall(r"(\d+)-(\d+)", text)):
            raise EngineCpusError(f"{where}: {r}'s cores {text!r} are not a core list such as 0, 0-1 or 0,2")
        if max(cores(text)) >= have:
            raise EngineCpusError(f"{where}: {r} names core {max(cores(text))}; this machine has cores 0-{have - 1}")
        binds[r] = text
    return binds


def _bind(llm_config: dict[str, Any], cpus: str | None) -> None:
    if cpus is not None:
        env = llm_config.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env[OMP_BIND_ENV] = cpus


def pin(config: Mapping[str, Any], binds: Mapping[str, str]) -> dict[str, Any]:
    """The Serve config with each engine role's core list in its LLMConfig's runtime env."""
    out = copy.deepcopy(dict(config))
    for app in out.get("applications", []):
        args = app.get("args") or {}
        _bind(args.get("prefill_config") or {}, binds.get("prefill"))
        _bind(args.get("decode_config") or {}, binds.get("decode"))
        for c in args.get("llm_configs") or []:
            _bind(c, binds.get("aggregated"))
    return out


def _option(raw: str) -> dict[str, str]:
    try:
        return parse(raw)
    except EngineCpusError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_option(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """`python -m local --engine-cpus`, by default from PD_ENGINE_CPUS in `environ` (parsed: role
    -> core list; a bad value is argparse's one-line error)."""
    p.add_argument(
        "--engine-cpus",
        type=_option,
        default=environ.get(ENGINE_CPUS_ENV) or "",
        help="the cores each engine role's compute threads are bound to, e.g. "
        f"prefill=0,decode=1,aggregated=0-1 (default ${ENGINE_CPUS_ENV}, else unbound; local/engine_cpus.py)",
    )
    return p
