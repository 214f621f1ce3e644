"""CPU per output token, per hop, net of idle: what streaming costs each process, and its ceiling.

What flows through here: bench/cpu.py's tallies (target -> level -> CPU seconds per hop class
over its batches, and the batches' wall time), the requests and output tokens each target
completed, and the idle phase (`cpu.Meter.idle`: CPU seconds per hop class over a window with
no request in flight, before the load) -> per target, all levels pooled:
  idle          each hop's share of a core with no traffic (background: controller loops,
                metrics, health checks), and the whole stack's outside the engines
  net of idle   each hop's load-phase CPU minus its idle rate x the batches' wall time, so
                background work is not spread over requests
  per token     CPU-ms per 1,000 output tokens, raw and net, and the streaming ceiling it
                implies: output tokens/s one core can carry through that hop
  ratios        each against plain vLLM's API server process in the same run
-> the issue's verdicts (met / not met, with the ratio), the tables, and, when `make bench`
ran a second pass with every request traced, tracing's own CPU cost (traced pass - the
prod-rate pass, per hop). Pure arithmetic: nothing here starts or reads a process.

The ceiling: c CPU-ms per 1,000 tokens is c / 1000 CPU-ms per token; one core gives 1,000
CPU-ms per second, so it carries 1000 / (c / 1000) = 1e6 / c tokens/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench import cpu
from bench.stats import markdown

# The per-token targets: (target, hop class, bar) on CPU-ms per 1,000 output tokens
# net of idle, all levels pooled, over plain vLLM's API server process's in the same run.
TOKEN_BARS = (
    ("disaggregated", "pd_orchestration", 1.5),
    ("disaggregated", "ingress", 0.5),
    ("aggregated", "ingress", 0.5),
)
# Non-engine CPU per request (net of idle) over plain vLLM's API server's.
REQUEST_BARS = (("disaggregated", 3.0), ("aggregated", 2.0))
# Idle CPU outside the engines, as a share of one core: a Ray target's app plus Ray's shared
# processes (what a one-model stack runs).
IDLE_BAR = 0.10
BASELINE_CLASS = "vllm_api_server"
# The idle figures' key for Ray's own floor (bench/idle_floor.py: the bare local cluster).
RAY_FLOOR = "ray floor"
ALL = "all"


# --- the arithmetic -----------------------------------------------------------------------------
def idle_cores(cpu_s: Mapping[str, float], seconds: float) -> dict[str, float]:
    """CPU seconds per hop over an idle window of `seconds` -> each hop's share of one core."""
    return {k: v / seconds for k, v in cpu_s.items()} if seconds > 0 else {}


def net_of_idle(cpu_s: Mapping[str, float], idle: Mapping[str, float], wall_s: float) -> dict[str, float]:
    """Each hop's CPU seconds minus what it spends idle over `wall_s` (never below zero)."""
    return {k: max(0.0, v - idle.get(k, 0.0) * wall_s) for k, v in cpu_s.items()}


def ceiling_tok_s_per_core(ms_per_1k: float | None) -> float | None:
    """Output tokens/s one core carries at `ms_per_1k` CPU-ms per 1,000 tokens (module doc)."""
    return 1e6 / ms_per_1k if ms_per_1k else None


def ratio(ours: float | None, base: float | None) -> float | None:
    return ours / base if ours is not None and base else None


# --- one target --------------------------------------------------------------------------------
def target_figures(
    tally: cpu.Tally, requests: int, tokens: int, idle: Mapping[str, float], top: cpu.Tally | None = None
) -> dict[str, Any]:
    """One target, its levels pooled: per hop raw and net CPU-ms per 1,000 output tokens, the
    net ceiling and the idle share; the non-engine totals per request, raw and net. `top`: the
    tally of its highest concurrency, whose busiest-thread share each replica hop reports (the
    event loop's share grows with the streams, and the cap matters under load)."""
    net = net_of_idle(tally.cpu_s, idle, tally.wall_s)
    hops = {}
    for k in cpu.CLASSES:
        if k not in tally.cpu_s:
            continue
        net_ms = cpu.ms_per_1k_tokens(net[k], tokens)
        hops[k] = {
            "idle_cores": idle.get(k, 0.0),
            "raw_ms_per_1k_tokens": cpu.ms_per_1k_tokens(tally.cpu_s[k], tokens),
            "net_ms_per_1k_tokens": net_ms,
            "ceiling_tok_s_per_core": ceiling_tok_s_per_core(net_ms),
            # A replica's event loop: one process carries at most 1 / share cores of this hop.
            "busiest_thread_share": (top or tally).busiest_share(k),
        }
    per_req = (lambda s: s * 1000 / requests) if requests else (lambda s: None)
    return {
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": tally.wall_s,
        "hops": hops,
        "non_engine_ms_per_request": {"raw": per_req(cpu.non_engine(tally.cpu_s)), "net": per_req(cpu.non_engine(net))},
        "idle_non_engine_cores": cpu.non_engine(idle),
    }


def run(
    tallies: Mapping[str, Mapping[str, cpu.Tally]],
    counts: Mapping[str, Mapping[str, tuple[int, int]]],
    idle: Mapping[str, Mapping[str, float]],
) -> dict[str, Any]:
    """target -> `target_figures` over all its levels, with each hop's and the non-engine
    total's ratio to plain vLLM's API server (net); "stack_idle_cores": the whole local stack's
    idle share outside the engines (both apps), when measured."""
    out: dict[str, Any] = {}
    for t, levels in tallies.items():
        n, k = (sum(counts[t][lv][i] for lv in levels) for i in (0, 1))
        top = levels[max(levels, key=int)] if levels else None
        out[t] = target_figures(cpu.pooled(levels.values()), n, k, idle.get(t) or {}, top)
    base = out.get(cpu.PLAIN)
    base_hop = ((base or {}).get("hops") or {}).get(BASELINE_CLASS) or {}
    for t, fig in out.items():
        if t == cpu.PLAIN:
            continue
        for h in fig["hops"].values():
            h["net_vs_vllm_api_server"] = ratio(h["net_ms_per_1k_tokens"], base_hop.get("net_ms_per_1k_tokens"))
        base_req = ((base or {}).get("non_engine_ms_per_request") or {}).get("net")
        fig["non_engine_net_vs_vllm_api_server"] = ratio(fig["non_engine_ms_per_request"]["net"], base_req)
    out["stack_idle_cores"] = cpu.non_engine(idle["stack"]) if "stack" in idle else None
    out["ray_floor_idle_cores"] = cpu.non_engine(idle[RAY_FLOOR]) if RAY_FLOOR in idle else None
    return out


# --- the verdicts -------------------------------------------------------------------------------
def _met(v: float | None, bar: float) -> str:
    return "-" if v is None else ("yes" if v <= bar else "no")


def verdicts(fig: Mapping[str, Any]) -> list[tuple[str, float | None, str, str]]:
    """(bar, measured, how it reads, met) per target of the issue, from `run`'s figures."""
    rows: list[tuple[str, float | None, str, str]] = []
    for t, cls, bar in TOKEN_BARS:
        v = (((fig.get(t) or {}).get("hops") or {}).get(cls) or {}).get("net_vs_vllm_api_server")
        name = f"{t} {cpu.CLASSES[cls]}, CPU per 1,000 output tokens net of idle ÷ plain vLLM API server <= {bar}"
        rows.append((name, v, f"{v:.2f}x" if v is not None else "-", _met(v, bar)))
    for t, bar in REQUEST_BARS:
        v = (fig.get(t) or {}).get("non_engine_net_vs_vllm_api_server")
        name = f"{t} non-engine CPU per request net of idle ÷ plain vLLM API server <= {bar}"
        rows.append((name, v, f"{v:.2f}x" if v is not None else "-", _met(v, bar)))
    for t, _ in REQUEST_BARS:
        v = (fig.get(t) or {}).get("idle_non_engine_cores")
        name = f"{t} app + Ray's shared processes idle, outside the engines <= {IDLE_BAR:.0%} of a core"
        rows.append((name, v, f"{v:.1%}" if v is not None else "-", _met(v, IDLE_BAR)))
    return rows


def tracing_cost(prod_rate: Mapping[str, Any], traced: Mapping[str, Any]) -> dict[str, Any]:
    """Ray target -> per hop and in all, what tracing every request adds: the traced pass's net
    CPU-ms per 1,000 output tokens (and the non-engine total per request) minus the prod-rate
    pass's. Two passes are two stacks: their vLLM API server figures show the drift between them."""
    out: dict[str, Any] = {}
    for t, fig in prod_rate.items():
        other = traced.get(t)
        if not isinstance(fig, dict) or not isinstance(other, dict):
            continue
        hops = {
            k: _diff(other["hops"].get(k, {}).get("net_ms_per_1k_tokens"), h.get("net_ms_per_1k_tokens"))
            for k, h in fig["hops"].items()
        }
        per_req = _diff(other["non_engine_ms_per_request"]["net"], fig["non_engine_ms_per_request"]["net"])
        out[t] = {"ms_per_1k_tokens": hops, "non_engine_ms_per_request": per_req}
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# --- text -------------------------------------------------------------------------------------
def _c(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def hop_rows(fig: Mapping[str, Any]) -> list[list[str]]:
    """Rows (header first): per target and hop, idle share, raw and net CPU-ms per 1,000 output
    tokens, the net ceiling and the ratio to plain vLLM's API server."""
    rows = [
        [
            "target",
            "hop",
            "idle, % of a core",
            "CPU-ms per 1k tokens",
            "net of idle",
            "ceiling, tok/s per core",
            "busiest thread at the top level, % of its CPU",
            "net ÷ vLLM API server",
        ]
    ]
    for t, f in fig.items():
        if not isinstance(f, dict):
            continue
        for k, h in f["hops"].items():
            if k in cpu.ENGINE_CLASSES:
                continue
            rows.append(
                [
                    t,
                    cpu.CLASSES[k],
                    _c(h["idle_cores"] * 100),
                    _c(h["raw_ms_per_1k_tokens"]),
                    _c(h["net_ms_per_1k_tokens"]),
                    _c(h["ceiling_tok_s_per_core"], 0),
                    _c(None if h.get("busiest_thread_share") is None else h["busiest_thread_share"] * 100),
                    _c(h.get("net_vs_vllm_api_server"), 2),
                ]
            )
    return rows


def verdict_rows(fig: Mapping[str, Any]) -> list[list[str]]:
    return [["bar", "measured", "met"], *([name, shown, met] for name, _, shown, met in verdicts(fig))]


def idle_line(fig: Mapping[str, Any]) -> str:
    """The idle phase in one line: each target's and the whole local stack's share of a core."""
    parts = [
        f"{t} {f['idle_non_engine_cores']:.1%}"
        for t, f in fig.items()
        if isinstance(f, dict) and f.get("idle_non_engine_cores") is not None
    ]
    whole = fig.get("stack_idle_cores")
    if whole is not None:
        parts.append(f"the whole local stack (both apps and Ray's shared processes) {whole:.1%}")
    floor = fig.get("ray_floor_idle_cores")
    if floor is not None:
        parts.append(f"Ray's own floor (the same three nodes, no Serve app, before the stack) {floor:.1%}")
    return "Idle CPU outside the engines, share of one core: " + ("; ".join(parts) or "-")


def tracing_rows(cost: Mapping[str, Any]) -> list[list[str]]:
    """Rows (header first): per Ray target and hop, what tracing every request adds."""
    rows = [["target", "hop", "+ CPU-ms per 1k tokens, every request traced"]]
    for t, c in cost.items():
        for k, v in c["ms_per_1k_tokens"].items():
            if k not in cpu.ENGINE_CLASSES:
                rows.append([t, cpu.CLASSES[k], _c(v)])
        rows.append([t, "non-engine total, CPU-ms per request", _c(c["non_engine_ms_per_request"])])
    return rows


def format_markdown(fig: Mapping[str, Any]) -> str:
    return "\n\n".join(
        [markdown(hop_rows(fig)), idle_line(fig), "The issue's per-token targets:\n\n" + markdown(verdict_rows(fig))]
    )
