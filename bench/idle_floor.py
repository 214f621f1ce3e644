"""Ray's own idle floor: the local stack's three nodes with the stack's Ray environment and no
Serve application, their CPU with nothing to do, as a share of one core.

What flows through here: `make bench` (bench/serving_bench.py), before it starts the stack ->
a child process (`python -m bench.idle_floor`) that starts the same local cluster the stack
starts (local/cluster.py: head, prefill and decode nodes, `stack_ray_env`: the data plane's
switches and Serve's control-loop interval included) and waits -> once it is up and settled,
every process under it metered over the idle window with the bench's own sampler and classes
(bench/cpu.py `Meter.idle`) -> hop class -> share of a core, under `per_token.RAY_FLOOR` ->
the idle line of the report, beside the stack's own idle figure. The stack's
idle CPU outside the engines is that floor (raylets, GCS, dashboard and its agents, log
monitors: processes a Ray cluster runs per node, whatever it serves) plus what Serve and the
apps add (controller, proxy, replicas, idle workers); the floor says how much of the idle
figure no setting of this project can remove on a three-node cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench import cpu, per_token

READY = "FLOOR READY"
SETTLE_S = 20.0  # after the nodes are up: their start-up work (dashboard modules, agents) done
START_TIMEOUT_S = 180.0


def measure(seconds: float) -> dict[str, float]:
    """Hop class -> share of a core of the bare local cluster over about `seconds` of idle."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.idle_floor"],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        start_new_session=True,  # its own process group: the cluster's processes with it
    )
    try:
        _wait_ready(child)
        time.sleep(SETTLE_S)
        spent, wall = cpu.Meter({"stack": child.pid}, {}).idle(seconds, {"floor": (cpu.RAY_SCOPE,)})
        return per_token.idle_cores(spent["floor"], wall)
    finally:
        if child.stdin is not None:
            child.stdin.close()  # the child shuts its cluster down at end of input
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def measured(seconds: float, say: Any) -> dict[str, float]:
    """`measure`, with a progress line before and the floor after (make bench's)."""
    say(f"Ray's idle floor: the local cluster's three nodes, no Serve app, {seconds:.0f} s")
    floor = measure(seconds)
    say(f"Ray's idle floor, share of a core: {cpu.non_engine(floor):.1%}")
    return floor


def _wait_ready(child: subprocess.Popen) -> None:
    """Until the child prints READY; RuntimeError if it exits or START_TIMEOUT_S passes first."""
    import selectors

    assert child.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(timeout=left):
                line = child.stdout.readline()
                if line.strip() == READY:
                    return
                if not line:  # the child ended
                    break
    raise RuntimeError(f"the bare Ray cluster did not start within {START_TIMEOUT_S:.0f} s (exit code {child.poll()})")


def main() -> None:
    """The child: the cluster up, READY printed, down again when standard input ends."""
    from local.cluster import LocalCluster
    from local.config import stack_ray_env

    cluster = LocalCluster()
    cluster.start(stack_ray_env(None))
    try:
        print(READY, flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
