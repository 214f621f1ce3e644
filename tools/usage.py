"""`make usage [PROMETHEUS=http://...] [DAYS=7] [KEY=k-...]`: what each API key used and cost,
per UTC day, from the ingress's counters in Prometheus.

What flows through here: a Prometheus root URL -> for each UTC day, instant queries of its HTTP
API (`/api/v1/query`, at the day's end or now) of `increase(<counter>[<the day so far>])`
summed by key and destination (and phase for the cost), of the counters the ingress records
(serving/core/metrics.py: requests, prompt, completion and cached prompt tokens, USD by phase)
-> one row per key and day: requests, tokens, the cluster's USD split prefill/decode, the
provider's USD (requests the external fallback served), and the cluster's prefix-cache-hit
share (cached prompt tokens over prompt tokens). `increase` extrapolates to the window's
edges, as Prometheus does, so a figure is as exact as the scrape interval allows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from serving.core import metrics as m

PROMETHEUS_ENV = "PD_PROMETHEUS_URL"
DEFAULT_PROMETHEUS = "http://127.0.0.1:9090"
DEFAULT_DAYS = 7
DAY_S = 86400
QUERY_TIMEOUT_S = 30.0
CLUSTER, FALLBACK = m.DESTINATION_CLUSTER, m.DESTINATION_FALLBACK

# A row's count -> the ingress counter it sums.
COUNTS = {
    "requests": m.USAGE_REQUESTS.prometheus,
    "prompt": m.USAGE_PROMPT_TOKENS.prometheus,
    "completion": m.USAGE_COMPLETION_TOKENS.prometheus,
    "cached": m.USAGE_CACHED_TOKENS.prometheus,
}
COST = m.USAGE_COST.prometheus
# A key id as serving.spec.key_id writes it (what --key may name).
KEY_ID = re.compile(r"k-[0-9a-f]{12}")

Query = Callable[[str, float], list[dict]]


class UsageError(RuntimeError):
    """Prometheus could not be asked, or refused a query (the message says which)."""


@dataclass
class Row:
    """One key's day."""

    key: str
    day: str
    counts: dict[str, dict[str, float]] = field(default_factory=dict)  # count -> destination -> value
    usd: dict[tuple[str, str], float] = field(default_factory=dict)  # (destination, phase) -> USD

    def total(self, count: str) -> float:
        return sum(self.counts.get(count, {}).values())

    @property
    def cluster_prefill_usd(self) -> float:
        return self.usd.get((CLUSTER, m.CostPhase.PREFILL.value), 0.0)

    @property
    def cluster_decode_usd(self) -> float:
        return self.usd.get((CLUSTER, m.CostPhase.DECODE.value), 0.0)

    @property
    def provider_usd(self) -> float:
        return sum(v for (dest, _), v in self.usd.items() if dest == FALLBACK)

    @property
    def cache_hit_share(self) -> float | None:
        """The cluster's cached prompt tokens over its prompt tokens (None: no cluster prompt)."""
        prompt = self.counts.get("prompt", {}).get(CLUSTER, 0.0)
        return None if prompt <= 0 else self.counts.get("cached", {}).get(CLUSTER, 0.0) / prompt


def prometheus_query(base_url: str) -> Query:
    """An instant query of the Prometheus at `base_url`: (PromQL, unix time) -> its vector."""
    root = base_url.rstrip("/")

    def query(promql: str, at: float) -> list[dict]:
        url = f"{root}/api/v1/query?" + urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
        try:
            with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as resp:
                doc = json.loads(resp.read())
        except OSError as exc:
            raise UsageError(f"Prometheus at {root} did not answer: {exc}") from exc
        except ValueError as exc:
            raise UsageError(f"Prometheus at {root} answered something that is not JSON: {exc}") from exc
        if doc.get("status") != "success":
            raise UsageError(f"Prometheus refused {promql!r}: {doc.get('error') or doc}")
        return list(doc.get("data", {}).get("result") or [])

    return query


def days(now: float, count: int) -> list[tuple[str, float, float]]:
    """The last `count` UTC days up to `now`, oldest first: (date, start, end), today's end `now`."""
    today = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    out = []
    for back in range(count - 1, -1, -1):
        start = today - back * DAY_S
        out.append((datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d"), start, min(start + DAY_S, now)))
    return out


def _selector(key: str | None) -> str:
    return f'{{key="{key}"}}' if key else ""


def report(query: Query, now: float, count: int = DEFAULT_DAYS, key: str | None = None) -> list[Row]:
    """Per key and day (oldest first, keys sorted), what the ingress counted; days and keys
    with no request are left out."""
    rows: list[Row] = []
    sel = _selector(key)
    for day, start, end in days(now, count):
        window = int(end - start)
        if window <= 0:
            continue
        by_key: dict[str, Row] = {}
        for name, counter in COUNTS.items():
            promql = f"sum by (key, destination) (increase({counter}{sel}[{window}s]))"
            for sample in query(promql, end):
                labels, value = sample["metric"], float(sample["value"][1])
                row = by_key.setdefault(labels.get("key", ""), Row(labels.get("key", ""), day))
                row.counts.setdefault(name, {})[labels.get("destination", "")] = value
        for sample in query(f"sum by (key, destination, phase) (increase({COST}{sel}[{window}s]))", end):
            labels = sample["metric"]
            row = by_key.setdefault(labels.get("key", ""), Row(labels.get("key", ""), day))
            row.usd[(labels.get("destination", ""), labels.get("phase", ""))] = float(sample["value"][1])
        rows += [by_key[k] for k in sorted(by_key) if by_key[k].total("requests") > 0]
    return rows


HEADER = ("day", "key", "requests", "prompt", "completion", "cache hit", "cluster $ prefill", "decode", "provider $")


def render(rows: list[Row]) -> str:
    """The report as an aligned table, with a total line per day."""
    lines: list[tuple[str, ...]] = [HEADER]
    for r in rows:
        share = r.cache_hit_share
        lines.append(
            (
                r.day,
                r.key,
                f"{r.total('requests'):.0f}",
                f"{r.total('prompt'):.0f}",
                f"{r.total('completion'):.0f}",
                "-" if share is None else f"{share:.1%}",
                f"{r.cluster_prefill_usd:.4f}",
                f"{r.cluster_decode_usd:.4f}",
                f"{r.provider_usd:.4f}",
            )
        )
    if len(lines) == 1:
        return "no requests counted in these days"
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in lines
    )


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None, now: float | None = None) -> int:
    env = os.environ if environ is None else environ
    ap = argparse.ArgumentParser(prog="make usage", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default=env.get(PROMETHEUS_ENV) or DEFAULT_PROMETHEUS, help="Prometheus root URL")
    ap.add_argument("--days", type=int, default=DEFAULT_DAYS, help="UTC days back, today included")
    ap.add_argument("--key", default=None, help="one key id (k-<12 hex>; python -m tools.keyid)")
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of a table")
    args = ap.parse_args(argv)
    if args.days < 1:
        ap.error("--days must be at least 1")
    if args.key is not None and not KEY_ID.fullmatch(args.key):
        ap.error(f"--key {args.key!r} is not a key id (k- and 12 hex digits: python -m tools.keyid < keys.txt)")
    try:
        rows = report(prometheus_query(args.prometheus), time.time() if now is None else now, args.days, args.key)
    except UsageError as exc:
        print(f"make usage: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([_as_json(r) for r in rows], indent=2))
    else:
        print(render(rows))
    return 0


def _as_json(r: Row) -> dict[str, object]:
    return {
        "day": r.day,
        "key": r.key,
        "requests": r.total("requests"),
        "prompt_tokens": r.total("prompt"),
        "completion_tokens": r.total("completion"),
        "cached_tokens": r.total("cached"),
        "cache_hit_share": r.cache_hit_share,
        "cluster_prefill_usd": r.cluster_prefill_usd,
        "cluster_decode_usd": r.cluster_decode_usd,
        "provider_usd": r.provider_usd,
    }


if __name__ == "__main__":
    raise SystemExit(main())
