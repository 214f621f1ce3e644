"""`make bench-goodput`'s arithmetic: latency as the client sees it, goodput, who passes whom, and why.

What flows through here: the requests of one window (bench/goodput_load.py `Sent`: each event's
arrival and token count) -> `Request`s: events that came within BURST_S of the one before are one
chunk (what one network read brought), and a chunk of n tokens gives the client one gap (since
the previous chunk) and n - 1 gaps of zero: the per-token ITL a client computes -> per target and
rate (`summary`): TTFT p50/p99, the decode streams' per-token ITL p50/p99/p99.9 beside their
chunk intervals, the mean time per output token, and goodput per threshold pair: requests sent
in the window that completed with TTFT <= the TTFT threshold and a per-token ITL p99 <= the ITL
threshold, per second of the window -> across rates (`crossing`): per threshold pair the lowest
rate where the disaggregated app's goodput passes the aggregated app's, and the best ratio;
from the CPU each target's processes spent (bench/cpu.py tallies) the share of its cores each
engine used and the resource that binds (`binding`). Pure arithmetic: nothing here starts or
reads a process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from bench import cpu
from bench.goodput_load import PROMPT, STREAM, Sent
from bench.stats import percentile
from local.engine_cpus import cores
from local.ray_pd import RAY_PD_MODE

# Events closer than this to the one before came in one network read: one chunk.
BURST_S = 0.001
# The per-request ITL a threshold is held against: this percentile of its per-token gaps.
REQUEST_ITL_PERCENTILE = 99.0
# An engine (or the machine) using at least this share of its cores is saturated.
SATURATED = 0.9
# The targets.
PD_OVER_AGGREGATED = 1.3  # our P/D's goodput over our aggregated app's, at an ITL threshold
# The share of its loosest-threshold goodput our P/D app must keep at a threshold pair for that
# pair's ratio to count as the best one (`crossing`).
BEST_SHARE = 0.5
OURS_OVER_RAY = 1.15  # our P/D's TTFT p50 and ITL p50 over Ray's stock P/D app's
CPU_OURS_OVER_RAY = 1.3  # CPU per 1,000 output tokens outside the engines, ours over Ray's


Chunk = tuple[float, int]  # (seconds after the request was sent, tokens)


def group_chunks(events: Iterable[Chunk], within_s: float = BURST_S) -> list[Chunk]:
    """Events -> chunks: an event within `within_s` of the one before joins its chunk (the
    chunk keeps its first event's time)."""
    out: list[Chunk] = []
    last = None
    for t, n in events:
        if out and last is not None and t - last <= within_s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((t, n))
        last = t
    return out


def token_gaps(chunks: Sequence[Chunk]) -> list[float]:
    """The per-token ITL a client computes: every token after the first, the time since the
    token before it arrived (a chunk's first token: since the previous chunk; the rest: 0)."""
    gaps: list[float] = [0.0] * max(0, chunks[0][1] - 1) if chunks else []
    for (t0, _), (t1, n) in pairwise(chunks):
        gaps += [t1 - t0, *([0.0] * (n - 1))]
    return gaps


def chunk_intervals(chunks: Sequence[Chunk]) -> list[float]:
    """The time between consecutive chunks."""
    return [t1 - t0 for (t0, _), (t1, _) in pairwise(chunks)]


@dataclass(frozen=True)
class Request:
    """One request as the client saw it."""

    kind: str
    at_s: float  # sent, seconds after the window opened
    ok: bool
    chunks: tuple[Chunk, ...]  # seconds after it was sent, tokens
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def itl_s(self) -> float | None:
        """Its per-token gaps' REQUEST_ITL_PERCENTILE (None: one token, no gap)."""
        return percentile(token_gaps(self.chunks), REQUEST_ITL_PERCENTILE)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: first to last chunk over tokens - 1."""
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.tokens - 1) if self.tokens > 1 else None


def from_sent(s: Sent) -> Request:
    got = s.got
    chunks = group_chunks((t - got.start, n) for t, n in got.chunk_tokens)
    return Request(s.kind, s.at_s, got.ok and bool(chunks), tuple(chunks), "" if got.ok else got.kind)


def meets(r: Request, ttft_s: float, itl_s: float) -> bool:
    """Completed, first token within `ttft_s`, per-token ITL p99 within `itl_s`."""
    ttft, itl = r.ttft_s, r.itl_s
    return r.ok and ttft is not None and ttft <= ttft_s and (itl is None or itl <= itl_s)


def pair_key(ttft_s: float, itl_s: float) -> str:
    """A threshold pair's key in the JSON: "<TTFT s>/<ITL s>"."""
    return f"{ttft_s:g}/{itl_s:g}"


def goodput(reqs: Sequence[Request], ttft_s: float, itl_s: float, window_s: float) -> dict[str, float | int]:
    """Requests sent in the window that met both thresholds, per second of the window, and per kind."""
    good = [r for r in reqs if meets(r, ttft_s, itl_s)]
    return {
        "req_s": len(good) / window_s if window_s > 0 else 0.0,
        STREAM: sum(1 for r in good if r.kind == STREAM),
        PROMPT: sum(1 for r in good if r.kind == PROMPT),
    }


def _ms(values: Sequence[float], q: float) -> float | None:
    v = percentile(values, q)
    return None if v is None else v * 1000


def summary(reqs: Sequence[Request], window_s: float, pairs: Iterable[tuple[float, float]]) -> dict[str, Any]:
    """One target at one rate: the figures of the JSON (module doc)."""
    ok = [r for r in reqs if r.ok]
    streams = [r for r in ok if r.kind == STREAM]
    ttft = {k: [r.ttft_s for r in ok if r.ttft_s is not None and k in (r.kind, "all")] for k in (STREAM, PROMPT, "all")}
    gaps = [g for r in streams for g in token_gaps(r.chunks)]
    intervals = [g for r in streams for g in chunk_intervals(r.chunks)]
    tpot = [t for r in streams if (t := r.tpot_s) is not None]
    chunks = sum(len(r.chunks) for r in streams)
    out: dict[str, Any] = {
        "requests": len(reqs),
        "completed": len(ok),
        "errors": {k: sum(1 for r in reqs if not r.ok and r.kind == k) for k in (STREAM, PROMPT)},
        "window_s": window_s,
        "output_tokens": sum(r.tokens for r in ok),
        "completed_by_kind": {k: sum(1 for r in ok if r.kind == k) for k in (STREAM, PROMPT)},
        "req_s": len(ok) / window_s if window_s > 0 else None,
        "ttft_p50_ms": _ms(ttft["all"], 50),
        "ttft_p99_ms": _ms(ttft["all"], 99),
        **{f"{k}_ttft_p{q}_ms": _ms(ttft[k], q) for k in (STREAM, PROMPT) for q in (50, 99)},
        "itl_p50_ms": _ms(gaps, 50),
        "itl_p99_ms": _ms(gaps, 99),
        "itl_p999_ms": _ms(gaps, 99.9),
        "chunk_interval_p50_ms": _ms(intervals, 50),
        "chunk_interval_p99_ms": _ms(intervals, 99),
        "chunk_interval_p999_ms": _ms(intervals, 99.9),
        "tokens_per_chunk": sum(r.tokens for r in streams) / chunks if chunks else None,
        "tpot_mean_ms": sum(tpot) * 1000 / len(tpot) if tpot else None,
        "goodput": {pair_key(t, i): goodput(reqs, t, i, window_s) for t, i in pairs},
        "errors_sample": [r.error for r in reqs if not r.ok][:5],
    }
    out["errors_total"] = sum(out["errors"].values())
    return out


# --- across rates ---------------------------------------------------------------------------------
def _gp(figs: Mapping[str, Mapping[str, Any]], rate: str, pair: str) -> float | None:
    return (((figs.get(rate) or {}).get("goodput") or {}).get(pair) or {}).get("req_s")


def crossing(ours: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`ours` (the disaggregated app: rate -> summary) against `base` (the aggregated app), per
    threshold pair: the lowest rate where ours serves more goodput ("passes_at", None: at no
    measured rate) and each rate's ratio; "best": the pair and rate of the highest ratio, with
    both apps' ITL p99, and whether it reaches PD_OVER_AGGREGATED. A pair counts toward "best"
    only where ours meets it for at least BEST_SHARE of what it serves at that rate's loosest
    pair: a ratio of two goodputs near zero (a threshold neither app meets) is noise, while a
    threshold ours meets and the aggregated app does not is exactly what disaggregation is for."""
    rates = sorted((r for r in ours if r in base), key=float)
    pairs = sorted(
        {p for r in rates for p in (ours[r].get("goodput") or {})}, key=lambda k: tuple(map(float, k.split("/")))
    )
    loosest = {r: max((_gp(ours, r, p) or 0.0 for p in pairs), default=0.0) for r in rates}
    out: dict[str, Any] = {"pairs": {}, "best": None}
    best: tuple[float, str, str] | None = None
    for p in pairs:
        ratios: dict[str, float | None] = {}
        passes_at = None
        for r in rates:
            a, b = _gp(ours, r, p) or 0.0, _gp(base, r, p) or 0.0
            ratios[r] = a / b if b > 0 else (None if a == 0 else float("inf"))
            if passes_at is None and a > b:
                passes_at = r
            counts = a > 0 and a >= BEST_SHARE * loosest[r]
            if b > 0 and counts and (best is None or a / b > best[0]):
                best = (a / b, r, p)
        out["pairs"][p] = {"passes_at": passes_at, "ratio": ratios}
    if best is not None:
        ratio, r, p = best
        out["best"] = {
            "rate": r,
            "pair": p,
            "ratio": ratio,
            "met": ratio >= PD_OVER_AGGREGATED,
            "itl_p99_ms": {"disaggregated": ours[r].get("itl_p99_ms"), "aggregated": base[r].get("itl_p99_ms")},
        }
    return out


def allotted(binds: Mapping[str, str], cpus: int) -> dict[str, int]:
    """Engine hop class -> the cores its role was bound to (local/engine_cpus.py; unbound: all)."""

    def n(role: str) -> int:
        return len(cores(binds[role])) if role in binds else cpus

    return {
        "engine_prefill": n("prefill"),
        "engine_decode": n("decode"),
        "engine_aggregated": n("aggregated"),
        "vllm_engine": n("aggregated"),
    }


def binding(tally: cpu.Tally, client_cpu_s: float, binds: Mapping[str, str], cpus: int) -> dict[str, Any]:
    """What one window used of the machine: each engine's cores busy over its allotment, the
    processes outside the engines and the bench's own client in cores, the whole machine's
    share, and the resource that binds: an engine at SATURATED of its cores, else the machine's
    cores when they are, else none."""
    wall = tally.wall_s
    if wall <= 0:
        return {"binds": None}
    share = allotted(binds, cpus)
    engines = {k: v / wall / share[k] for k, v in tally.cpu_s.items() if k in cpu.ENGINE_CLASSES and k in share}
    outside = cpu.non_engine(tally.cpu_s) / wall
    machine = (sum(tally.cpu_s.values()) + client_cpu_s) / wall / cpus
    top = max(engines.items(), key=lambda kv: kv[1], default=None)
    if top is not None and top[1] >= SATURATED:
        binds_on = f"{cpu.CLASSES[top[0]]}: {top[1]:.0%} of its {share[top[0]]} core(s)"
    elif machine >= SATURATED:
        binds_on = f"the machine's {cpus} cores, shared by the engines, Ray and the client: {machine:.0%}"
    else:
        binds_on = None
    return {
        "engine_share_of_cores": engines,
        "outside_engines_cores": outside,
        "client_cores": client_cpu_s / wall,
        "machine_share": machine,
        "binds": binds_on,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def outside_engines(fig: Mapping[str, Any]) -> dict[str, float | None]:
    """hop -> net CPU-ms per 1,000 output tokens outside the engines (bench/per_token.py's
    figures of one target), and their total under "total"."""
    hops = {k: h.get("net_ms_per_1k_tokens") for k, h in (fig.get("hops") or {}).items() if k not in cpu.ENGINE_CLASSES}
    known = [v for v in hops.values() if v is not None]
    return {**hops, "total": sum(known) if known else None}


def versus_ray(figs: Mapping[str, Mapping[str, Any]], per_token_fig: Mapping[str, Any]) -> dict[str, Any]:
    """Our P/D app against Ray's stock P/D app on the same engines: per rate TTFT p50 and ITL p50
    (per token; where bursts make both 0, the mean time per output token), chunk interval p50;
    CPU per 1,000 output tokens outside the engines, hop by hop, net of idle; the worst ratios
    against the issue's bars."""
    ours, ray = figs.get("disaggregated") or {}, figs.get(RAY_PD_MODE) or {}
    rates: dict[str, Any] = {}
    for r in sorted(set(ours) & set(ray), key=float):
        a, b = ours[r], ray[r]
        itl = "itl_p50_ms" if a.get("itl_p50_ms") and b.get("itl_p50_ms") else "tpot_mean_ms"
        rates[r] = {
            "ttft_p50": _ratio(a.get("ttft_p50_ms"), b.get("ttft_p50_ms")),
            "itl_p50": _ratio(a.get(itl), b.get(itl)),
            "itl_from": itl,
            "chunk_interval_p50": _ratio(a.get("chunk_interval_p50_ms"), b.get("chunk_interval_p50_ms")),
        }
    mine = outside_engines(per_token_fig.get("disaggregated") or {})
    theirs = outside_engines(per_token_fig.get(RAY_PD_MODE) or {})
    cpu_rows = {
        k: {"ours": mine.get(k), "ray": theirs.get(k), "ratio": _ratio(mine.get(k), theirs.get(k))}
        for k in {*mine, *theirs}
    }

    def worst(key: str) -> float | None:
        vals = [v[key] for v in rates.values() if v[key] is not None]
        return max(vals) if vals else None

    worst_of = {
        "ttft_p50": worst("ttft_p50"),
        "itl_p50": worst("itl_p50"),
        "cpu": cpu_rows.get("total", {}).get("ratio"),
    }
    bars = {"ttft_p50": OURS_OVER_RAY, "itl_p50": OURS_OVER_RAY, "cpu": CPU_OURS_OVER_RAY}
    return {
        "rates": rates,
        "cpu_ms_per_1k_tokens": cpu_rows,
        "worst": worst_of,
        "met": {k: None if (v := worst_of[k]) is None else v <= bar for k, bar in bars.items()},
    }
