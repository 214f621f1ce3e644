"""The serving mode of a running P/D stack: how its requests were prefilled, over time.

What flows through here: the nodes' Prometheus endpoints of a local stack -> the decode
replicas' `pd_prefill_path` counter (serving/engines/pd_server.py: one count per request, labelled
remote / remote_retry / local and why) -> cumulative counts per path, sampled over time ->
the share of requests prefilled remotely (the designed mode) in a phase or a window, and
how long after a fault that share was back at the target.

"Requests succeed" is not the invariant: a P/D stack that silently prefills everything on
decode answers every request too (the defect of 2026-12-01). `make chaos` and the prefill
kill test in `make test` use these figures to check that the stack returns to P/D.

Ray exports counters every few seconds, so a count lags the request by up to one export
interval; a recovery time read from samples is late by at most that much.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx

from bench.hops import Sample, parse_prometheus
from serving.core.metrics import PREFILL_PATH
from serving.core.metrics import PrefillPath as Path

# Ray exports a Serve Counter named N as ray_N_total.
PATH_METRIC = PREFILL_PATH.prometheus
REMOTE = (Path.REMOTE.value, Path.REMOTE_RETRY.value)
TARGET_SHARE = 0.95


def path_counts(metrics_texts: Iterable[str]) -> dict[str, float]:
    """{series: requests}, one entry per exported series ("path|reason|replica|node"), so a
    series Ray stops exporting (an idle counter ages out) is told apart from one that fell."""
    return series_counts(parse_prometheus(text) for text in metrics_texts)


def series_counts(scrapes: Iterable[Iterable[Sample]]) -> dict[str, float]:
    """path_counts of already parsed scrapes, one per node."""
    out: dict[str, float] = {}
    for i, samples in enumerate(scrapes):
        for name, labels, value in samples:
            if name == PATH_METRIC:
                key = "|".join((labels.get("path", ""), labels.get("reason", ""), labels.get("replica", ""), str(i)))
                out[key] = out.get(key, 0.0) + value
    return out


def by_path(counts: dict[str, float]) -> dict[str, float]:
    """{path: requests} from path_counts' series."""
    out: dict[str, float] = {}
    for key, value in counts.items():
        path = key.split("|", 1)[0]
        out[path] = out.get(path, 0.0) + value
    return out


def read_counts(metrics_urls: Iterable[str]) -> dict[str, float]:
    texts = []
    for url in metrics_urls:
        try:
            texts.append(httpx.get(url, timeout=10).text)
        except httpx.HTTPError:
            continue
    return path_counts(texts)


def path_delta(before: Mapping[str, float], after: Mapping[str, float], *, by_reason: bool = False) -> dict[str, float]:
    """{path: requests} counted between two path_counts readings ("path|reason|..." keys; a
    series that disappeared counts as unchanged, not as fallen to zero); by_reason:
    {"path/reason": requests} instead, the reasons behind each local prefill."""
    out: dict[str, float] = {}
    for key, value in after.items():
        path, reason = [*key.split("|"), ""][:2]
        name = f"{path}/{reason}" if by_reason else path
        out[name] = out.get(name, 0.0) + max(0.0, value - before.get(key, 0.0))
    return out


def share_of(delta: Mapping[str, float]) -> tuple[float | None, float]:
    """(share of the requests in `delta` ({path: requests}) prefilled remotely, number of
    requests); share None when there were none."""
    total = sum(delta.values())
    if total <= 0:
        return None, 0.0
    return sum(delta.get(p, 0.0) for p in REMOTE) / total, total


def remote_share(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float]:
    """share_of the requests counted between two path_counts readings."""
    return share_of(path_delta(before, after))


@dataclass
class ModeSampler:
    """Samples the path counts every `every_s` in the background (use as an async context)."""

    metrics_urls: list[str]
    t0: float
    every_s: float = 2.0
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            counts = await asyncio.to_thread(read_counts, self.metrics_urls)
            self.samples.append((time.monotonic() - self.t0, counts))
            await asyncio.sleep(self.every_s)

    async def __aenter__(self) -> ModeSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def share_between(self, start: float, end: float) -> tuple[float | None, float]:
        """Remote share of the requests counted between the samples nearest `start` and `end`."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None, 0.0
        return remote_share(inside[0][1], inside[-1][1])

    def back_to_remote_after(
        self, since: float, *, window_s: float = 10.0, min_requests: float = 8, target: float = TARGET_SHARE
    ) -> float | None:
        """Seconds from `since` to the first window (>= `min_requests` counted requests) in
        which at least `target` of the requests were prefilled remotely; None if never."""
        for i, (t, counts) in enumerate(self.samples):
            if t < since:
                continue
            for t2, later in self.samples[i + 1 :]:
                share, n = remote_share(counts, later)
                if n >= min_requests or t2 - t >= window_s:
                    if share is not None and n >= min_requests and share >= target:
                        return t - since
                    break
        return None
