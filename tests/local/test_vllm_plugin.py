"""local/vllm_plugin.py: the local stack's NIXL agents run without a busy-polling thread.

Contract (vLLM 0.32, NIXL 1.3.2): vLLM loads `vllm.general_plugins` entry points found on
sys.path (`vllm/plugins/__init__.py`), and NixlConnector's worker builds its agent with the
`nixl_agent_config` it imports from `vllm.distributed.nixl_utils`
(`kv_connector/v1/nixl/base_worker.py`). Each check runs in a fresh interpreter with the
local cluster's PYTHONPATH, as a vLLM worker process of `make serve` starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from local.config import cluster_env
from local.vllm_plugin import PLUGIN_NAME

PROBE = r"""
import json
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import nixl_agent_config
from nixl._api import nixl_agent
cfg = nixl_agent_config(num_threads=4, capture_telemetry=True)  # as base_worker calls it
agent = nixl_agent("probe", cfg)
print(json.dumps({
    "plugins": sorted(e.name for e in entry_points(group="vllm.general_plugins")),
    "prog_thread": cfg.enable_pthread,
}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_local_vllm_process_builds_nixl_agents_without_a_progress_thread():
    got = _probe({**os.environ, **cluster_env()})
    assert PLUGIN_NAME in got["plugins"]
    # No progress thread: NIXL's own polls with a 0 ms timeout, about a whole core while idle.
    # What the engines then use while idle is a figure, sampled by `make bench`
    # (bench/serving_bench.py idle_cpu, "idle engine workers" in docs/performance.md).
    assert got["prog_thread"] is False


def test_without_the_local_pythonpath_vllm_keeps_nixl_defaults():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = _probe(env)
    assert PLUGIN_NAME not in got["plugins"]
    assert got["prog_thread"] is True


TOPOLOGY = r"""
import json
from vllm.platforms.cpu import CpuPlatform
before = CpuPlatform.discover_numa_topology()
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.platforms import current_platform
print(json.dumps({"before": before, "after": current_platform.discover_numa_topology()}))
"""


def _topology(bind: str) -> dict:
    env = {**os.environ, **cluster_env(), "VLLM_CPU_OMP_THREADS_BIND": bind}
    out = subprocess.run(
        [sys.executable, "-c", TOPOLOGY], env=env, capture_output=True, text=True, timeout=180, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_with_a_core_list_nixl_finds_no_core_to_move_the_engines_thread_to():
    """vLLM 0.32 `kv_connector/v1/nixl/base_worker.py` pins the thread that builds the NIXL
    worker (the worker's main thread, which runs the model) to the last core of each NUMA node
    that `current_platform.discover_numa_topology()` reports; with none, it leaves it alone."""
    bound = _topology("0")
    assert bound["before"]  # vLLM sees this machine's NUMA topology (Linux sysfs)
    assert bound["after"] == []
    # vLLM's own modes keep vLLM's behaviour.
    for mode in ("nobind", "auto"):
        kept = _topology(mode)
        assert kept["after"] == kept["before"]
