"""How streams arrive at the client: the gaps between chunks, and chunks held to the end.

What flows through here: the per-request results of vLLM's benchmark client
(`bench.stats.RequestResult`: the time to the first chunk and the gap before each later
one; vLLM's client, vllm/benchmarks/lib/endpoint_request_func.py, stamps every streamed
event that carries `choices` with `time.perf_counter()` as it parses it, so events that
came in one network read get a gap of 0) -> `arrivals()`: each chunk's arrival, seconds
after the request was sent -> per target and concurrency, pooled over the streams:

  gap p50 / p99    the client-seen gap between consecutive chunks (ms);
  tail share       of the chunks after the first, the share that arrived in the last 10%
                   of their stream's span (first chunk -> last chunk). A stream delivered as
                   it is generated at an even pace puts about 10% there (plus the last
                   chunk itself); a server that holds the chunks and lets them go at the end
                   puts nearly all there. A starved client reads late too, but then the
                   gaps grow everywhere, not only before the tail.

Streams with fewer than three chunks have no span to speak of and are left out of the tail
share. Nothing here starts anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, pairwise
from typing import Any

from bench.stats import RequestResult, aligned, markdown, percentile

TAIL_FRACTION = 0.1  # the last 10% of a stream's span


def arrivals(r: RequestResult) -> list[float]:
    """Seconds after the request was sent at which each chunk arrived (first: the TTFT)."""
    if not r.ok:
        return []
    return list(accumulate([r.ttft_s, *r.itl_s]))


def tail_count(arrived: Sequence[float], fraction: float = TAIL_FRACTION) -> tuple[int, int]:
    """(chunks after the first that arrived in the last `fraction` of the span, chunks after
    the first); (0, 0) for a stream too short to have a span."""
    if len(arrived) < 3:
        return 0, 0
    first, last = arrived[0], arrived[-1]
    cut = last - fraction * (last - first)
    later = arrived[1:]
    return sum(1 for t in later if t >= cut), len(later)


def summary(results: Iterable[RequestResult]) -> dict[str, Any]:
    """Gap percentiles and the tail share of one target at one concurrency."""
    streams = [a for a in map(arrivals, results) if a]
    gaps = [b - a for s in streams for a, b in pairwise(s)]
    tails = [tail_count(s) for s in streams]
    held, counted = sum(t for t, _ in tails), sum(n for _, n in tails)
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {
        "streams": len(streams),
        "chunks": sum(len(s) for s in streams),
        "gap_p50_ms": None if p50 is None else p50 * 1000,
        "gap_p99_ms": None if p99 is None else p99 * 1000,
        "tail_share": held / counted if counted else None,
    }


def table_rows(by: dict[str, dict[str, dict[str, Any]]]) -> list[list[str]]:
    """Rows (header first): one per target and concurrency."""
    rows = [["target", "conc", "streams", "chunks", "gap p50 ms", "gap p99 ms", "chunks in last 10%"]]
    for t, levels in by.items():
        for c, s in levels.items():
            share = s.get("tail_share")
            rows.append(
                [
                    t,
                    c,
                    str(s["streams"]),
                    str(s["chunks"]),
                    "-" if s["gap_p50_ms"] is None else f"{s['gap_p50_ms']:.1f}",
                    "-" if s["gap_p99_ms"] is None else f"{s['gap_p99_ms']:.1f}",
                    "-" if share is None else f"{share:.0%}",
                ]
            )
    return rows


def format_text(by: dict[str, dict[str, dict[str, Any]]]) -> str:
    return aligned(table_rows(by))


def format_markdown(by: dict[str, dict[str, dict[str, Any]]]) -> str:
    return markdown(table_rows(by))
