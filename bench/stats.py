"""Benchmark arithmetic: per-request timings in, the figures `vllm bench serve` reports out.

What flows through here: one `RequestResult` per request (time to first token, the gaps
between streamed tokens, end-to-end latency, token counts, error) and the wall time the
batch took -> a summary per target and concurrency (TTFT p50/p99, ITL p50, TPOT p50,
output tokens/s, requests/s, errors) -> ratios between targets -> a text table.

Definitions follow vLLM's benchmark client (vllm/benchmarks/serve.py):
  TTFT   time from sending the request to the first streamed token;
  ITL    every gap between consecutive streamed token chunks, pooled over all requests;
  TPOT   per request, (latency - TTFT) / (output tokens - 1);
  output tokens/s   sum of output tokens of successful requests / duration;
  requests/s        successful requests / duration.
Percentiles are numpy.percentile's (linear interpolation), as in vLLM's client; what is ours
here is the pooling per target and concurrency, the ratios and the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def percentile(values: Sequence[float], q: float) -> float | None:
    """numpy's q-th percentile (0..100, linear interpolation), or None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    return float(np.percentile(values, q)) if len(values) else None


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def tpot_values(ok: Iterable[RequestResult]) -> list[float]:
    """Time per output token after the first, per request that produced more than one token."""
    return [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]


def samples(results: Iterable[RequestResult]) -> dict[str, list[float]]:
    """Per-request TTFT and TPOT (seconds) of the successful requests: what the plots draw."""
    ok = [r for r in results if r.ok]
    return {"ttft_s": [r.ttft_s for r in ok], "tpot_s": tpot_values(ok)}


def summarize(results: Iterable[RequestResult], duration_s: float) -> dict[str, float | int | None]:
    """One target at one concurrency: the figures in the report."""
    results = list(results)
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    tpot = tpot_values(ok)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration_s,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "e2el_p50_ms": _ms(percentile([r.latency_s for r in ok], 50)),
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else None,
        "req_s": len(ok) / duration_s if duration_s > 0 else None,
    }


RATIO_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms", "output_tok_s", "req_s")


def ratios(
    a: Mapping[str, float | None], c: Mapping[str, float | None], keys: Sequence[str] = RATIO_KEYS
) -> dict[str, float | None]:
    """a[k] / c[k] for each key; None where either side is missing or c is zero."""
    out: dict[str, float | None] = {}
    for k in keys:
        x, y = a.get(k), c.get(k)
        out[k] = None if x is None or y is None or y == 0 else x / y
    return out


def kv_transfer_per_request(delta: Mapping[str, float], requests: int) -> dict[str, float | None]:
    """Decode-side NIXL counters (deltas over the run) per disaggregated request."""
    transfers = delta.get("nixl_transfers", 0.0)
    per = (lambda v: v / requests) if requests else (lambda v: None)
    return {
        "requests": requests,
        "transfers": transfers,
        "bytes_per_request": per(delta.get("nixl_bytes", 0.0)),
        "kv_tokens_per_request": per(delta.get("external_kv_tokens", 0.0)),
        "xfer_ms_per_transfer": (delta.get("nixl_xfer_s", 0.0) * 1000 / transfers if transfers else None),
        "xfer_ms_per_request": per(delta.get("nixl_xfer_s", 0.0) * 1000),
    }


def kv_backends(serve_config: Mapping) -> list[str]:
    """The NIXL backends of the disaggregated app in a deployed Serve config (vLLM's default: UCX)."""
    found: list[str] = []
    for app in serve_config.get("applications", []):
        args = app.get("args") or {}
        for side in ("prefill_config", "decode_config"):
            kv = ((args.get(side) or {}).get("engine_kwargs") or {}).get("kv_transfer_config")
            if kv:
                extra = kv.get("kv_connector_extra_config") or {}
                found.extend(b for b in extra.get("backends", ["UCX"]) if b not in found)
    return found


def _fmt(v: float | int | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


def format_table(summaries: Mapping[str, Mapping[int, Mapping]], baseline: str) -> str:
    """Rows per target and concurrency; ratio columns against `baseline`."""
    head = (
        f"{'target':<14}{'conc':>5}{'reqs':>5}{'err':>4}{'TTFT p50':>9}{'TTFT p99':>9}"
        f"{'ITL p50':>8}{'TPOT p50':>9}{'out tok/s':>10}{'req/s':>7}"
        f"  | / {baseline}: {'TTFT50':>6}{'TPOT50':>7}{'tok/s':>6}{'req/s':>6}"
    )
    lines = [head, "-" * len(head)]
    for target, by_conc in summaries.items():
        for conc, s in sorted(by_conc.items()):
            base = summaries.get(baseline, {}).get(conc)
            r = ratios(s, base) if base and target != baseline else None
            ratio_txt = (
                f"{_fmt(r['ttft_p50_ms'], 2):>6}{_fmt(r['tpot_p50_ms'], 2):>7}"
                f"{_fmt(r['output_tok_s'], 2):>6}{_fmt(r['req_s'], 2):>6}"
                if r
                else ""
            )
            lines.append(
                f"{target:<14}{conc:>5}{s['requests']:>5}{s['errors']:>4}"
                f"{_fmt(s['ttft_p50_ms']):>9}{_fmt(s['ttft_p99_ms']):>9}{_fmt(s['itl_p50_ms']):>8}"
                f"{_fmt(s['tpot_p50_ms']):>9}{_fmt(s['output_tok_s']):>10}{_fmt(s['req_s'], 2):>7}"
                f"  | {' ' * (len(baseline) + 4)}{ratio_txt}"
            )
    return "\n".join(lines)


def aligned(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (header first) as aligned text: the first column left, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


def markdown(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (header first) as a Markdown table."""
    out = ["| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows[1:]])
