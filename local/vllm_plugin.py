"""vLLM general plugin of the local CPU stack: NIXL agents without the busy-polling progress thread.

What flows through here: vLLM loads the `vllm.general_plugins` entry points in every process
it starts, the engine core's workers included (vLLM 0.32 `vllm/plugins/__init__.py`,
`v1/worker/worker_base.py` `init_worker`). The local cluster finds this one through its
PYTHONPATH (`local/entry_points/`, added by `local.config.cluster_env`) ->
`register()` puts a `nixl_agent_config` into `vllm.distributed.nixl_utils` whose
`enable_prog_thread` defaults to False -> NixlConnector's worker builds its agent with it
(`kv_connector/v1/nixl/base_worker.py` imports `nixl_agent_config` from there).

Why: NIXL 1.3.2's Python agent sets the progress thread's delay to 0 (`nixl/_api.py`,
`agent_config.pthrDelay = 0`), and the UCX backend's shared progress thread then calls
poll() with a 0 ms timeout (ai-dynamo/nixl `src/plugins/ucx/ucx_backend.cpp`,
`nixlUcxSharedThread::run`): one core per agent, idle or not. On this 2-core machine the
prefill and decode agents take most of both cores. Without the thread, UCX makes progress
where vLLM already asks for it in every engine step (`checkXferState`, and `getNotifs`,
which runs the progress loop itself when no thread exists). In the cloud the thread stays:
the plugin is on no PYTHONPATH there and `local/` is not shipped
(`infra/package.py`), and one core of a p5's 192 buys transfers that progress between steps.

Second, where the engine's cores are named (`VLLM_CPU_OMP_THREADS_BIND` a core list:
local/engine_cpus.py), `respect_core_list()` keeps NIXL from moving the engine's compute
thread: on CPU, NixlConnector's worker pins the thread that builds it to the last core of each
NUMA node (vLLM 0.32 `kv_connector/v1/nixl/base_worker.py`, `os.sched_setaffinity(0, ...)`
on `CpuPlatform.discover_numa_topology()`, core 1 of this 2-core machine). That thread is the
worker's main thread, which runs the model: with prefill bound to core 0 it would compute on
decode's core 1. With a core list, the topology it reads is empty and the binding stands.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PLUGIN_NAME = "pd_local_nixl"  # its name in entry_points/*.dist-info/entry_points.txt
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's: "auto" (its default), "nobind" or core lists


def agent_config(*args: Any, **kwargs: Any) -> Any:
    """NIXL's `nixl_agent_config`, with the progress thread off unless asked for."""
    from nixl._api import nixl_agent_config

    kwargs.setdefault("enable_prog_thread", False)
    return nixl_agent_config(*args, **kwargs)


def register() -> None:
    """Entry point: idempotent, as vLLM may load plugins more than once per process."""
    from vllm.distributed import nixl_utils

    nixl_utils.nixl_agent_config = agent_config
    worker = sys.modules.get(NIXL_WORKER_MODULE)
    if worker is not None:  # imported before the plugin ran: it holds NIXL's own class
        worker.nixl_agent_config = agent_config  # type: ignore[attr-defined]
    respect_core_list()


def _no_topology(cls: Any) -> list[list[int]]:
    return []


def respect_core_list() -> None:
    """With a core list in VLLM_CPU_OMP_THREADS_BIND, CpuPlatform reports no NUMA topology to
    NIXL's worker, which then leaves its thread's cores alone (module doc); "auto" and
    "nobind" keep vLLM's behaviour."""
    if os.environ.get(OMP_BIND_ENV, "auto") in ("auto", "nobind"):
        return
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.discover_numa_topology = classmethod(_no_topology)
