"""`make chaos`: did the fault hit what the scenario is about, and what the verdicts are then.

What flows through here: Serve's replicas of the deployment under test ({replica_id, pid})
and the engines' running requests as Ray exports them (`ray_vllm_num_requests_running` by
`ReplicaId`) -> the victim (the replica whose engine runs the most requests); a scenario's
result (bench/chaos.py, bench/chaos_streams.py), whose `fault` entry records what the fault
hit -> the landing checks per scenario (the killed replica had requests in flight, the outage
was seen, streams were cut and continued, the burst was refused in part) -> each acceptance
line as PASS, FAIL or INCONCLUSIVE (the checks held but the fault missed its target: a run
whose fault misses reads differently from one that survived it), the latency during and after
the fault as ratios to before, and one line per scenario saying what the fault hit.

Pure functions only: the scenarios gather the figures, this module judges and prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bench import chaos_streams
from bench.prefill_mode import TARGET_SHARE

PASS, FAIL, INCONCLUSIVE, NA = "PASS", "FAIL", "INCONCLUSIVE", "n/a"


def open_at(spans: Iterable[tuple[float, float]], t: float) -> int:
    """How many (start, end) requests were open at t: sent before it, answered after it."""
    return sum(1 for start, end in spans if start <= t < end)


def delta_total(before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """How much a counter's series ({label value: total}) rose between two readings (a series
    that disappeared counts as unchanged)."""
    return sum(max(0.0, v - before.get(k, 0.0)) for k, v in after.items())


# --- the acceptance figures -------------------------------------------------------------------
def acceptance(results: Mapping[str, Mapping[str, Any]]) -> dict[str, bool | None]:
    """The acceptance figures, computed from the results (True/False/None: no figure)."""
    out: dict[str, bool | None] = {}
    kp = results.get("kill-prefill")
    if kp:
        b, d = kp["phases"]["before"], kp["phases"]["during"]
        out["kill-prefill: 0 failed, 0 hung"] = all(p["failed"] == 0 for p in kp["phases"].values())
        out["kill-prefill: p99 during <= 2x before"] = (
            d["p99_s"] <= 2 * b["p99_s"] if d["p99_s"] and b["p99_s"] else None
        )
        # The tail: the requests the kill hit or met while the stack noticed (chaos.by_phase).
        tail = [p["max_s"] for p in (kp["phases"].get("hit") or {}, kp["phases"].get("switch") or {}) if p.get("max_s")]
        out["kill-prefill: slowest request hit or met by the kill <= 2x before's slowest"] = (
            max(tail) <= 2 * b["max_s"] if tail and b.get("max_s") else None
        )
        # A stack that answers everything but stopped doing P/D fails here.
        out[f"kill-prefill: back to >= {TARGET_SHARE:.0%} remote prefill after recovery"] = (
            kp.get("back_to_remote_prefill_s") is not None
        )
    kd = results.get("kill-decode")
    if kd:
        # Cut streams are continued on the other decode replica: none may fail.
        out["kill-decode: 0 failed, 0 streams cut"] = all(p["failed"] == 0 for p in kd["phases"].values())
    out.update(chaos_streams.verdicts(results))
    ov = results.get("overload")
    if ov:
        ok_kinds = {"ok", "http_429", "http_503"}
        out["overload: every burst request 200/429/503, none hung"] = set(ov["burst_outcomes"]) <= ok_kinds
    sk = results.get("soak")
    if sk:
        out["soak: 0 errors"] = sk["phases"]["soak"]["failed"] == 0
        g = sk["rss_peak_growth_pct"]
        out["soak: RSS growth <= 10% after warm-up"] = g <= 10 if g is not None else None
    return out


# --- did the fault land -----------------------------------------------------------------------
def _restarted(f: Mapping[str, Any]) -> bool:
    return bool(f.get("replaced_by")) and f.get("replica_id") not in (f.get("replaced_by") or [])


def landing_checks(name: str, res: Mapping[str, Any]) -> dict[str, bool]:
    """{check: held} that show the scenario's fault hit its target; {} for a scenario without a
    fault (the soak)."""
    f = res.get("fault") or {}
    mig = res.get("migrations") or {}
    if name == "kill-prefill":
        return {
            "prefilled locally while prefill was down": (f.get("local_prefills") or 0) > 0,
            "restart observed": _restarted(f),
        }
    if name == "kill-decode":
        return {
            "victim's engine ran requests at the kill": (f.get("running") or 0) > 0,
            "restart observed": _restarted(f),
        }
    if name == "kill-ingress":
        # One ingress replica: every request open at the kill was on it.
        return {"requests in flight at the kill": (f.get("open_requests") or 0) > 0, "restart observed": _restarted(f)}
    if name == "migrate-decode":
        return {
            "victim's engine ran streams at the kill": (f.get("running") or 0) > 0,
            ">= 1 stream continued (ray_pd_stream_migrations_total)": (mig.get("continued") or 0) >= 1,
        }
    if name == "scale-in":
        return {"the removed replica ran streams at the update": (f.get("running") or 0) > 0}
    if name == "overload":
        refused = sum(n for kind, n in (res.get("burst_outcomes") or {}).items() if kind in ("http_429", "http_503"))
        return {"the burst exceeded the admission bound (some 429/503)": refused > 0}
    return {}


def judge(acceptance: Mapping[str, bool | None], results: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Each acceptance line ("<scenario>: ...") as PASS / FAIL / n/a, or INCONCLUSIVE when it
    did not fail but its scenario's fault missed. A failure stays FAIL: it broke either way. A
    fault scenario without a bar (kill-ingress) gets a line too, so its miss is not silent."""
    missed = {name for name, res in results.items() if not all(landing_checks(name, res).values())}
    lines = dict(acceptance)
    for name, res in results.items():
        if landing_checks(name, res) and not any(k.split(":", 1)[0] == name for k in lines):
            lines[f"{name}: figures only, no bar"] = None
    out: dict[str, str] = {}
    for line, ok in lines.items():
        if ok is False:
            out[line] = FAIL
        elif line.split(":", 1)[0] in missed:
            out[line] = INCONCLUSIVE
        else:
            out[line] = NA if ok is None else PASS
    return out


def exit_code(judged: Mapping[str, str]) -> int:
    """1 when a bar failed; 2 when none failed but a fault missed (the run proves nothing about
    what it was to test); 0 when every fault landed and every bar held."""
    if FAIL in judged.values():
        return 1
    return 2 if INCONCLUSIVE in judged.values() else 0


# --- latency against before -------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def latency_ratios(phases: Mapping[str, Mapping[str, Any]], base: str = "before") -> dict[str, dict[str, float | None]]:
    """{phase: {p99, max}} of each phase's latency as a ratio to `base`'s (None without figures)."""
    b = phases.get(base) or {}
    return {
        ph: {"p99": _ratio(st.get("p99_s"), b.get("p99_s")), "max": _ratio(st.get("max_s"), b.get("max_s"))}
        for ph, st in phases.items()
        if ph != base
    }


# --- what the fault hit, in words ---------------------------------------------------------------
def _n(v: Any) -> str:
    return "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def fault_line(name: str, res: Mapping[str, Any]) -> str:
    f = res.get("fault") or {}
    parts = []
    if f.get("pid") is not None:
        parts.append(f"replica {f.get('replica_id')} (pid {f['pid']})")
    if f.get("running") is not None:
        parts.append(f"{_n(f['running'])} requests running in its engine")
    if "open_requests" in f:
        parts.append(f"{_n(f['open_requests'])} client requests open")
    if "replaced_by" in f:
        parts.append(f"replaced by {','.join(f['replaced_by'] or []) or 'nothing seen'}")
    if "local_prefills" in f:
        why = ", ".join(
            f"{k.split('/', 1)[1] or '-'} {_n(v)}" for k, v in sorted((f.get("local_reasons") or {}).items())
        )
        parts.append(f"{_n(f['local_prefills'])} local prefills after the kill" + (f" ({why})" if why else ""))
    if "migrations" in res:
        parts.append(f"migrations {dict(sorted(res['migrations'].items()))}")
    if "burst_outcomes" in res:
        parts.append(f"burst {res['burst_outcomes']}")
    checks = landing_checks(name, res)
    missed = [c for c, ok in checks.items() if not ok]
    verdict = "fault missed: " + "; ".join(missed) if missed else ("fault landed" if checks else "no fault")
    return f"{name}: hit {', '.join(parts) or '-'} -> {verdict}"


# --- the printed report ---------------------------------------------------------------------------
def _f(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return ",".join(f"{k}:{n}" for k, n in sorted(v.items())) or "-"
    return str(v)


def table(name: str, phases: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per phase; p99x / maxx: the phase's p99 and max latency over before's."""
    cols = ["requests", "ok", "failures", "hung", "failed_before_streaming", "p50_s", "p99_s", "max_s", "ttfb_p99_s"]
    head = ["phase"] + ["fail<stream" if c == "failed_before_streaming" else c for c in cols] + ["p99x", "maxx"]
    ratios = latency_ratios(phases)
    rows = [
        [ph] + [_f(st.get(c)) for c in cols] + [_f((ratios.get(ph) or {}).get(k)) for k in ("p99", "max")]
        for ph, st in phases.items()
    ]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"== {name} =="]
    for r in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)))
    return "\n".join(lines)


def report(name: str, res: Mapping[str, Any]) -> str:
    """What `make chaos` prints for one scenario: its figures and what its fault hit."""
    if name in chaos_streams.NAMES:
        lines = [chaos_streams.line(name, res)]
        r = (res.get("latency_vs_before") or {}).get("faulted") or {}
        lines.append(f"stream latency vs the no-fault round: p99 x{_f(r.get('p99'))}, max x{_f(r.get('max'))}")
        return "\n".join([*lines, fault_line(name, res)])
    lines = [table(name, res["phases"])]
    if "remote_prefill_share" in res:
        sh = res["remote_prefill_share"]
        lines.append(
            "remote prefill share: "
            + ", ".join(f"{k} {_f(v if v is None else round(v, 3))}" for k, v in sh.items())
            + f"; back to >= {TARGET_SHARE:.0%} {_f(res['back_to_remote_prefill_s'])} s after recovery"
        )
    if name == "overload":
        pr = res["probes_while_full"]
        lines.append(
            f"burst: {res['burst_outcomes']}; refused in p50 {_f(res['burst_refused_p50_s'])} s, "
            f"max {_f(res['burst_refused_max_s'])} s, all with Retry-After: "
            f"{res['burst_refused_with_retry_after'] == res['burst_outcomes'].get('http_503', 0)}; "
            f"single requests while full: {pr['outcomes']}, refused in p50 "
            f"{_f(pr['refused_p50_s'])} s, max {_f(pr['refused_max_s'])} s"
        )
    return "\n".join([*lines, fault_line(name, res)])
