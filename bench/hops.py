"""Where the time to first token goes: a per-hop breakdown from Ray's and vLLM's own records.

What flows through here: Ray Serve's request spans (OpenTelemetry, written by Serve's
file exporter when `RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH` is set: one
`proxy_http_request` span in the proxy, one `replica_handle_request <deployment> <method>`
span per replica the request passes; in Serve's HAProxy mode no proxy span: HAProxy hands
the request to the ingress replica's own HTTP server, whose span is the trace's root), vLLM's engine histograms (Prometheus text: Ray
re-exports them as `ray_vllm_*` labelled by `ReplicaId`; plain vLLM serves `vllm:*`), the
NIXL transfer histogram, and the client's TTFTs -> mean milliseconds per request for each
hop of one target at one concurrency:

  proxy -> ingress       proxy span start -> ingress replica span start (Serve routing);
                         none in HAProxy mode (HAProxy is not traced; its time is in the rest)
  ingress -> engine      ingress span start -> engine (decode) replica span start
                         (our ingress: auth, parse, validation; then Serve routing)
  decode -> prefill      decode span start -> prefill span start (P/D only)
  prefill leg            prefill replica span duration (P/D only), of which the prefill
                         engine's queue wait and prefill compute (vLLM)
  engine to first token  vLLM's own TTFT in the engine that streams (arrival -> first
                         token), of which queue wait (for P/D decode: includes waiting for
                         the KV), KV transfer (NIXL), first-token compute
  delivery and the rest  client TTFT - all of the above: HTTP in, the streamed chunk's way
                         back (stream batching, ingress, proxy) and anything unaccounted

Means, not medians: histograms give sums and counts. Nothing here starts anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

Sample = tuple[str, dict[str, str], float]


def parse_prometheus(text: str) -> list[Sample]:
    """Prometheus text exposition -> (name, labels, value) per sample, by prometheus_client's
    own parser (`prometheus_client.parser`, the library Ray and vLLM export with). Sample names
    are the series' names as exposed: a counter's `_total`, a histogram's `_bucket`/`_sum`."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text) for s in fam.samples
    ]


def metric_total(
    samples: Iterable[Sample], name: str, where: Callable[[dict[str, str]], bool] = lambda _: True
) -> float:
    return sum(v for n, labels, v in samples if n == name and where(labels))


def scrape_by_label(metrics_urls: Iterable[str], name: str, label: str) -> dict[str, float]:
    """{value of `label`: total} of one series, summed over the metrics endpoints that answer
    (an endpoint that does not, e.g. a node restarting, is skipped)."""
    import httpx

    out: dict[str, float] = {}
    for url in metrics_urls:
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.HTTPError:
            continue
        for series, labels, value in parse_prometheus(text):
            if series == name:
                key = labels.get(label, "")
                out[key] = out.get(key, 0.0) + value
    return out


T = TypeVar("T")


# Ray's processes export what they recorded every 10 s (Ray 2.60's
# `ray._raylet.Config.metrics_report_interval_ms()`, 10,000 by default): a reading unchanged
# for less than that can still miss the last requests' (a 4 s window read 154 and 170 of 224
# KV transfers in two `make bench` runs).
SETTLED_QUIET_S = 12.0


def settled(snapshot: Callable[[], T], quiet_s: float = SETTLED_QUIET_S, poll_s: float = 3.0) -> T:
    """A reading of metrics that no longer moves: `snapshot()` unchanged for `quiet_s` (more
    than one of Ray's export intervals), so what earlier requests left is no longer arriving."""
    import time

    before, since = snapshot(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(poll_s)
        now = snapshot()
        if now != before:
            before, since = now, time.monotonic()
    return before


# The engine histograms the breakdown reads, by their vLLM names (vllm/v1/metrics/loggers.py).
ENGINE_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
NIXL_XFER = "vllm:nixl_xfer_time_seconds"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


def exported_name(vllm_name: str, via_ray: bool) -> str:
    """`vllm:x` as plain vLLM serves it, or as Ray's metrics agent re-exports it (`ray_vllm_x`)."""
    return "ray_" + vllm_name.replace(":", "_") if via_ray else vllm_name


@dataclass(frozen=True)
class EngineDelta:
    """Histogram (sum, count) deltas of one engine's metrics over a window."""

    sums: Mapping[str, float]
    counts: Mapping[str, float]
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0

    def mean_ms(self, key: str) -> float | None:
        c = self.counts.get(key, 0.0)
        return self.sums.get(key, 0.0) * 1000 / c if c else None

    def per_request_ms(self, key: str, requests: float) -> float | None:
        return self.sums.get(key, 0.0) * 1000 / requests if requests else None

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


def engine_delta(
    before: Sequence[Sample], after: Sequence[Sample], *, via_ray: bool, replica_ids: Iterable[str] | None = None
) -> EngineDelta:
    """The change in one engine's histograms between two scrapes.

    replica_ids: the Serve replicas whose engines count (Ray labels vLLM's metrics with
    `ReplicaId`); None counts every engine in the scrape (plain vLLM).
    """
    ids = set(replica_ids) if replica_ids is not None else None

    def where(labels: dict[str, str]) -> bool:
        return ids is None or labels.get("ReplicaId") in ids

    def delta(name: str) -> float:
        return metric_total(after, name, where) - metric_total(before, name, where)

    names = dict(ENGINE_HISTOGRAMS, nixl=NIXL_XFER)
    sums = {k: delta(exported_name(v, via_ray) + "_sum") for k, v in names.items()}
    counts = {k: delta(exported_name(v, via_ray) + "_count") for k, v in names.items()}
    return EngineDelta(
        sums=sums,
        counts=counts,
        prefix_queries=delta(exported_name(PREFIX_QUERIES, via_ray)),
        prefix_hits=delta(exported_name(PREFIX_HITS, via_ray)),
    )


# --- Serve's spans --------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    start: float  # epoch seconds
    end: float
    attributes: Mapping[str, object] = field(default_factory=dict)


def _epoch(ts: str) -> float:
    # OpenTelemetry's console exporter writes ISO 8601 with a Z suffix and microseconds.
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def parse_spans(text: str) -> list[Span]:
    """Concatenated JSON objects as OpenTelemetry's ConsoleSpanExporter writes them."""
    dec = json.JSONDecoder()
    spans, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            # A span half-written when the file was read: stop at it.
            break
        try:
            spans.append(
                Span(
                    name=obj["name"],
                    trace_id=obj["context"]["trace_id"],
                    start=_epoch(obj["start_time"]),
                    end=_epoch(obj["end_time"]),
                    attributes=obj.get("attributes") or {},
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return spans


REPLICA_SPAN = "replica_handle_request"
PROXY_SPAN = "proxy_http_request"


def _deployment(span: Span) -> str | None:
    if not span.name.startswith(REPLICA_SPAN):
        return None
    dep = span.attributes.get("deployment")
    return str(dep) if dep is not None else None


@dataclass(frozen=True)
class SpanHops:
    requests: int
    proxy_to_ingress_ms: float | None  # None: no trace had a proxy span (HAProxy mode)
    ingress_to_engine_ms: float | None
    decode_to_prefill_ms: float | None
    prefill_leg_ms: float | None
    proxied: int = 0  # of `requests`, the traces with a proxy span


def _mean(xs: list[float]) -> float | None:
    return sum(xs) * 1000 / len(xs) if xs else None


def span_hops(
    spans: Iterable[Span],
    *,
    app: str,
    ingress: str,
    engine: str,
    prefill: str | None = None,
    window: tuple[float, float] | None = None,
) -> SpanHops:
    """Mean hop times (ms) over the traces of one application's requests.

    ingress/engine/prefill: deployment names (engine: the one that streams, decode in P/D).
    Traces with the ingress and engine spans count. The proxy span is there when Serve's
    proxy took the request; in HAProxy mode (direct ingress, ray/serve/_private/replica.py
    `_wrap_request` on the replica's own HTTP server) the ingress replica's span is the root
    and proxy -> ingress is None (a mean over the traces that have a proxy span, if only some
    do). `window` keeps the traces whose first span (the proxy's, or else the ingress's)
    started inside it.
    """
    by_trace: dict[str, list[Span]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    p2i, i2e, d2p, leg = [], [], [], []
    requests = 0
    for trace in by_trace.values():
        proxy = min((s for s in trace if s.name.startswith(PROXY_SPAN)), key=lambda s: s.start, default=None)
        mine = [s for s in trace if _deployment(s) and s.attributes.get("app") == app]
        first: dict[str | None, Span] = {}
        for s in sorted(mine, key=lambda s: s.start):
            first.setdefault(_deployment(s), s)
        ing, eng = first.get(ingress), first.get(engine)
        if ing is None or eng is None:
            continue
        began = proxy.start if proxy is not None else ing.start
        if window and not window[0] <= began <= window[1]:
            continue
        requests += 1
        if proxy is not None:
            p2i.append(ing.start - proxy.start)
        i2e.append(eng.start - ing.start)
        pre = first.get(prefill) if prefill else None
        if pre is not None:
            d2p.append(pre.start - eng.start)
            leg.append(pre.end - pre.start)
    return SpanHops(
        requests=requests,
        proxy_to_ingress_ms=_mean(p2i),
        ingress_to_engine_ms=_mean(i2e),
        decode_to_prefill_ms=_mean(d2p),
        prefill_leg_ms=_mean(leg),
        proxied=len(p2i),
    )


# --- the table --------------------------------------------------------------------------------
HOP_ROWS = (
    ("client_ttft", "client TTFT (vLLM's benchmark client)"),
    ("proxy_to_ingress", "proxy -> ingress replica (Serve tracing; HAProxy: not traced, -)"),
    ("ingress_to_engine", "ingress -> engine replica: auth, parsing, routing (Serve tracing)"),
    ("decode_to_prefill", "decode replica -> prefill replica (Serve tracing)"),
    ("prefill_leg", "prefill call, whole (Serve tracing)"),
    ("prefill_queue", "  of which prefill engine queue wait (vLLM)"),
    ("prefill_compute", "  of which prefill compute (vLLM)"),
    ("engine_ttft", "streaming engine: arrival -> first token (vLLM)"),
    ("engine_queue", "  of which queue wait, incl. waiting for the KV (vLLM)"),
    ("kv_transfer", "  of which KV transfer (NIXL)"),
    ("engine_compute", "  of which first-token compute (vLLM)"),
    ("delivery_rest", "HTTP in, stream delivery back, the rest (difference)"),
)


# A row shown whenever its companion is, even with no value: in HAProxy mode a Ray target has
# Serve's spans (ingress -> engine) but no proxy span, and "-" there says so.
SHOWN_WITH = {"proxy_to_ingress": "ingress_to_engine"}


def row_shown(key: str, rows: Iterable[Mapping[str, float | None]]) -> bool:
    """Whether a table shows the row `key`: any column has a value for it or for its companion."""
    keys = (key, SHOWN_WITH[key]) if key in SHOWN_WITH else (key,)
    return any(r.get(k) is not None for r in rows for k in keys)


def _sub(a: float | None, *bs: float | None) -> float | None:
    if a is None:
        return None
    return a - sum(b for b in bs if b is not None)


def breakdown(
    client_ttft_ms: float | None,
    engine: EngineDelta,
    *,
    requests: int,
    hops: SpanHops | None = None,
    prefill: EngineDelta | None = None,
) -> dict[str, float | None]:
    """One target at one concurrency: mean ms per hop (keys of HOP_ROWS; None = not on this path)."""
    row: dict[str, float | None] = {k: None for k, _ in HOP_ROWS}
    row["client_ttft"] = client_ttft_ms
    if hops is not None:
        row["proxy_to_ingress"] = hops.proxy_to_ingress_ms
        row["ingress_to_engine"] = hops.ingress_to_engine_ms
        row["decode_to_prefill"] = hops.decode_to_prefill_ms
        row["prefill_leg"] = hops.prefill_leg_ms
    if prefill is not None:
        row["prefill_queue"] = prefill.mean_ms("queue")
        row["prefill_compute"] = prefill.mean_ms("prefill")
    row["engine_ttft"] = engine.mean_ms("ttft")
    row["engine_queue"] = engine.mean_ms("queue")
    if engine.counts.get("nixl"):
        row["kv_transfer"] = engine.per_request_ms("nixl", requests)
    row["engine_compute"] = engine.mean_ms("prefill")
    row["delivery_rest"] = _sub(
        client_ttft_ms,
        row["proxy_to_ingress"],
        row["ingress_to_engine"],
        row["decode_to_prefill"],
        row["prefill_leg"],
        row["engine_ttft"],
    )
    return row


# Rows read from vLLM's histograms (and the difference that subtracts one). Through Ray they
# are approximations: Ray 2.60 re-exports a histogram's _sum rebuilt from bucket midpoints
# (ray/_private/telemetry/open_telemetry_metric_recorder.py: "the histogram sum value will be
# an approximation"), so a mean is only as fine as vLLM's buckets.
ENGINE_HISTOGRAM_ROWS = frozenset(
    {
        "prefill_queue",
        "prefill_compute",
        "engine_ttft",
        "engine_queue",
        "kv_transfer",
        "engine_compute",
        "delivery_rest",
    }
)
RAY_HISTOGRAM_NOTE = (
    "~: from vLLM's histograms as Ray re-exports them; Ray 2.60 rebuilds a histogram's sum from "
    "bucket midpoints, so these are only as fine as vLLM's buckets (queue and prefill time: "
    "anything under 300 ms reads 150). Plain vLLM's own figures are exact."
)


def format_breakdown(
    table: Mapping[str, Mapping[int, Mapping[str, float | None]]], approx_targets: Iterable[str] = ()
) -> str:
    """Rows: hops; columns: target x concurrency. `table[target][conc][hop]` in ms.

    approx_targets: targets whose engine metrics came through Ray (their ENGINE_HISTOGRAM_ROWS
    are marked `~`, and the note is printed under the table)."""
    approx = set(approx_targets)
    cols = [(t, c) for t, by in table.items() for c in sorted(by)]
    width = max(len(label) for _, label in HOP_ROWS) + 2
    head = f"{'mean ms per request':<{width}}" + "".join(f"{t[:13]:>14}" for t, _ in cols)
    sub = f"{'':<{width}}" + "".join(f"{'conc ' + str(c):>14}" for _, c in cols)
    lines = [head, sub, "-" * len(head)]
    for key, label in HOP_ROWS:
        vals = [table[t][c].get(key) for t, c in cols]
        if not row_shown(key, [table[t][c] for t, c in cols]):
            continue
        marks = ["~" if t in approx and key in ENGINE_HISTOGRAM_ROWS else "" for t, _ in cols]
        lines.append(
            f"{label:<{width}}"
            + "".join(f"{'-' if v is None else f'{m}{v:.1f}':>14}" for v, m in zip(vals, marks, strict=True))
        )
    if approx:
        lines.append(RAY_HISTOGRAM_NOTE)
    return "\n".join(lines)
