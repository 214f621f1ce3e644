"""vLLM's engine metrics into Ray's, handed over once a second instead of on every step.

What flows through here: on every engine step vLLM's output handler, on the engine replica's
event loop, hands the step's scheduler and iteration stats to its stat loggers (vLLM 0.29 and
0.32 `vllm/v1/metrics/loggers.py` `PrometheusStatLogger.record`): about ten gauge sets and
counter increments per step, one inter-token-latency observation per streamed token and a dozen
observations per finished request. Ray Serve LLM has them recorded through Ray's metrics
(`vllm/v1/metrics/ray_wrappers.py` `RayPrometheusStatLogger`, which Ray 2.60's
`engines/vllm/vllm_engine.py` `_start_async_llm_engine` hands to vLLM when
`LLMConfig.log_engine_metrics` is on, its default) -> here, every counter increment is added up,
every gauge keeps its last value and every histogram observation is kept, and a timer hands
them to Ray's metric at most METRICS_FLUSH_S later: one call per counter and gauge, the
observations one after the other, HAND_OVER_BATCH points per turn of the event loop so that
the streams' own callbacks run between batches. Ray's metrics agent exports every 10 s
(`metrics_report_interval_ms`) and Prometheus scrapes every 30 s, so no series reads
differently: counters keep their totals, histograms their buckets, sums and counts, a gauge
reads the last value set, and an idle engine's gauges still age out as before.

Why: each call into Ray's metric API runs its tag checks, then hands the point to Ray's C++
recorder, which wakes its own thread (`pthread_cond_signal` under `record` in py-spy's native
frames): 3-5 µs of the calling thread in a quiet process (prometheus_client, what vLLM's own
API server records into: 0.3-0.8 µs), and far more in a replica whose two cores the engines
keep busy. At one stream a decode step streams one token, so a dozen such calls ride on every
token; at sixteen, every token still carries its inter-token latency. Measured on `make serve`'s
P/D app, decode replica outside its engine, CPU-ms per 1,000 streamed chunks at 16 / 4 / 1
streams (2026-12-06, one stack per reading): Ray's wrappers 253-283 / 419-537 / 963-1,208;
counters and gauges buffered 283 / 537 / 963; everything buffered 225 / 363 / 672, one stream's
chunks/s from 162-167 to 239. What `make bench` reads is in docs/performance.md ("Switches").

How it is put in: Ray Serve LLM builds every engine from the class that `RAYLLM_VLLM_ENGINE_CLS`
names (Ray 2.60 `core/server/llm_server.py` `_get_default_engine_class`, "escape-hatch for
patching purposes"); serving.spec puts BUFFERED_ENGINE_CLS there in every Ray process
(`ServingSpec.ray_env`), so our server classes and Ray's own (batched aggregated, prefill) all
get it. The engine starts vLLM as Ray's does and only its stat logger class differs: Ray's code
imports `RayPrometheusStatLogger` from vLLM's module when it starts the engine, and the name is
bound to the subclass below for that call. tests/serving/engines/test_engine_metrics.py pins
that import in Ray's source and the class attributes vLLM builds its metrics from.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from vllm.v1.metrics import ray_wrappers
from vllm.v1.metrics.ray_wrappers import (
    RayCounterWrapper,
    RayGaugeWrapper,
    RayHistogramWrapper,
    RayKVConnectorProm,
    RayPerfMetricsProm,
    RayPrometheusStatLogger,
    RaySpecDecodingProm,
)

from serving.ray_internals import VLLMEngine, adopt_tokenization, skip_usage_telemetry_when_off
from serving.spec import METRICS_FLUSH_S

logger = logging.getLogger(__name__)


# At most this many points go to Ray in one turn of the event loop, the rest in later turns,
# after the streams' own callbacks: a decode replica streaming 10,000 tokens/s holds as many
# inter-token latencies a second, tens of ms of Ray calls that would otherwise stall its streams
# at once.
HAND_OVER_BATCH = 256


class _Pending:
    """The metrics written since the last hand-over, and the one timer that hands them to Ray,
    HAND_OVER_BATCH points per turn of the loop. Written from vLLM's output handler, on the
    replica's event loop; a write from a thread without a running loop goes through at once."""

    def __init__(self, interval_s: float, batch: int = HAND_OVER_BATCH) -> None:
        self.interval_s = interval_s
        self.batch = batch
        self._metrics: dict[int, _Buffered] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._draining: collections.deque[_Buffered] = collections.deque()

    def add(self, metric: _Buffered) -> None:
        self._metrics[id(metric)] = metric
        if self._timer is not None:
            return
        loop = _running_loop()
        if loop is None:  # no event loop here (vLLM's set-up, a test): write through
            self.flush()
            return
        self._timer = loop.call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        self._timer = None
        # Something left to drain means its next batch is already scheduled (`_drain` leaves
        # nothing behind without a loop): this window's metrics join that queue.
        drain_scheduled = bool(self._draining)
        self._draining.extend(self._metrics.values())
        self._metrics = {}
        if not drain_scheduled:
            self._drain(_running_loop())

    def _drain(self, loop: asyncio.AbstractEventLoop | None) -> None:
        budget = self.batch if loop is not None else sys.maxsize
        while self._draining and budget > 0:
            metric = self._draining[0]
            try:
                budget -= metric.hand_over(budget)
            except Exception:  # one bad series must not keep the others from Ray
                logger.exception("could not record engine metric %s", getattr(metric.metric, "_name", "?"))
                metric._reset()
            if not metric.pending():
                self._draining.popleft()
        if self._draining and loop is not None:
            loop.call_soon(self._drain, loop)


PENDING = _Pending(METRICS_FLUSH_S)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Buffered:
    """What the buffered metrics share: a labelled copy starts with nothing pending
    (vLLM labels each metric once per engine, `labels()` copies the instance)."""

    metric: Any

    def _reset(self) -> None:
        raise NotImplementedError

    def pending(self) -> bool:
        raise NotImplementedError

    def hand_over(self, budget: int) -> int:
        """Hand at most `budget` points to Ray; how many it handed."""
        raise NotImplementedError

    def labels(self, *labels: Any, **labelskwargs: Any) -> Any:
        clone = super().labels(*labels, **labelskwargs)  # type: ignore[misc]
        clone._reset()
        return clone


class BufferedRayGauge(_Buffered, RayGaugeWrapper):
    """Ray's gauge wrapper whose `set` keeps the value until the hand-over."""

    _value: float | None = None

    def _reset(self) -> None:
        self._value = None

    def set(self, value: int | float) -> None:
        self._value = value
        PENDING.add(self)

    def pending(self) -> bool:
        return self._value is not None

    def hand_over(self, budget: int) -> int:
        value, self._value = self._value, None
        if value is None:
            return 0
        RayGaugeWrapper.set(self, value)
        return 1


class BufferedRayCounter(_Buffered, RayCounterWrapper):
    """Ray's counter wrapper whose `inc` adds up until the hand-over."""

    _total: float = 0.0

    def _reset(self) -> None:
        self._total = 0.0

    def inc(self, value: int | float = 1.0) -> None:
        if value == 0:  # as Ray's wrapper: nothing to record
            return
        if value < 0:  # as Ray's Counter.inc, here rather than a second later
            raise ValueError(f"value must be >0, got {value}")
        self._total += value
        PENDING.add(self)

    def pending(self) -> bool:
        return self._total != 0

    def hand_over(self, budget: int) -> int:
        total, self._total = self._total, 0.0
        if not total:
            return 0
        RayCounterWrapper.inc(self, total)
        return 1


class BufferedRayHistogram(_Buffered, RayHistogramWrapper):
    """Ray's histogram wrapper whose `observe` keeps the values until the hand-over, then
    records each: the same buckets, sum and count, off the token's own path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._values: list[float] = []

    def _reset(self) -> None:
        self._values = []  # not the parent's list: copy.copy shares it

    def observe(self, value: int | float) -> None:
        if not isinstance(value, (int, float)):  # as Ray's Histogram.observe, where it is made
            raise TypeError(f"value must be int or float, got {type(value)}.")
        self._values.append(value)
        PENDING.add(self)

    def pending(self) -> bool:
        return bool(self._values)

    def hand_over(self, budget: int) -> int:
        values = self._values[:budget]
        del self._values[: len(values)]
        for value in values:
            RayHistogramWrapper.observe(self, value)
        return len(values)


class BufferedRaySpecDecodingProm(RaySpecDecodingProm):
    _counter_cls = BufferedRayCounter


class BufferedRayKVConnectorProm(RayKVConnectorProm):
    _gauge_cls = BufferedRayGauge
    _counter_cls = BufferedRayCounter
    _histogram_cls = BufferedRayHistogram


class BufferedRayPerfMetricsProm(RayPerfMetricsProm):
    _counter_cls = BufferedRayCounter


class BufferedRayStatLogger(RayPrometheusStatLogger):
    """Ray's stat logger for vLLM with every metric buffered: the same names, labels, buckets
    and values, handed to Ray at most METRICS_FLUSH_S later."""

    _gauge_cls = BufferedRayGauge
    _counter_cls = BufferedRayCounter
    _histogram_cls = BufferedRayHistogram
    _spec_decoding_cls = BufferedRaySpecDecodingProm
    _kv_connector_cls = BufferedRayKVConnectorProm
    _perf_metrics_cls = BufferedRayPerfMetricsProm


@contextlib.contextmanager
def _stat_logger(cls: type) -> Iterator[None]:
    """vLLM's `RayPrometheusStatLogger` name bound to `cls` while Ray starts the engine."""
    upstream = ray_wrappers.RayPrometheusStatLogger
    ray_wrappers.RayPrometheusStatLogger = cls
    try:
        yield
    finally:
        ray_wrappers.RayPrometheusStatLogger = upstream


class BufferedMetricsVLLMEngine(VLLMEngine):
    """Ray Serve LLM's vLLM engine, its metrics recorded through BufferedRayStatLogger.

    Every engine replica's process builds its engine from this class, so it is also where the
    process stops Ray Serve LLM from starting its usage telemetry actor while usage stats are
    off (serving.ray_internals.skip_usage_telemetry_when_off): Ray's server pushes that report
    right after `start` returns."""

    async def start(self) -> None:
        skip_usage_telemetry_when_off()
        await super().start()
        adopt_tokenization(self)

    def _start_async_llm_engine(self, *args: Any, **kwargs: Any) -> Any:
        with _stat_logger(BufferedRayStatLogger):
            return super()._start_async_llm_engine(*args, **kwargs)
