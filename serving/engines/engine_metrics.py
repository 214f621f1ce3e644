"""vLLM's engine metrics into Ray's, counters and gauges handed over once a second.

What flows through here: on every engine step vLLM's output handler, on the engine replica's
event loop, hands the step's scheduler and iteration stats to its stat loggers (vLLM 0.29 and
0.32 `vllm/v1/metrics/loggers.py` `PrometheusStatLogger.record`): about ten gauge sets and
counter increments per step, one inter-token-latency observation per streamed token and a dozen
observations per finished request. Ray Serve LLM has them recorded through Ray's metrics
(`vllm/v1/metrics/ray_wrappers.py` `RayPrometheusStatLogger`, which Ray 2.60's
`engines/vllm/vllm_engine.py` `_start_async_llm_engine` hands to vLLM when
`LLMConfig.log_engine_metrics` is on, its default) -> here, every counter increment is added up
and every gauge keeps its last value in the process, and both go to Ray's metric at most
METRICS_FLUSH_S later, one call per series; histograms are recorded as before, one call per
observation. Ray's metrics agent exports every 10 s (`metrics_report_interval_ms`) and
Prometheus scrapes every 30 s, so no series reads differently: counters keep their totals, a
gauge's value is the last one set, and an idle engine's gauges still age out as before.

Why: one call into Ray's metric API costs 3-5 µs of the event loop (its tag checks, then the
C++ recorder), against 0.3-0.8 µs for prometheus_client, which is what vLLM's own API server
records into; at one stream a decode step streams one token, so a dozen such calls ride on
every token. Measured (make serve's stack, P/D, decode replica outside its engine, CPU per
1,000 streamed chunks, two pairs of runs, 2026-12-06): with Ray's wrappers 1,155-1,208 at one
stream, 419-522 at four, 253-276 at sixteen; with vLLM's own prometheus_client logger 536-652,
377-399 and 197-249, and one stream's chunks/s rose from 162-165 to 232-291. What this module
keeps of that is measured by `make bench` (docs/performance.md, "Switches").

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
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from vllm.v1.metrics import ray_wrappers
from vllm.v1.metrics.ray_wrappers import (
    RayCounterWrapper,
    RayGaugeWrapper,
    RayKVConnectorProm,
    RayPerfMetricsProm,
    RayPrometheusStatLogger,
    RaySpecDecodingProm,
)

from serving.ray_internals import VLLMEngine
from serving.spec import METRICS_FLUSH_S

logger = logging.getLogger(__name__)


class _Pending:
    """The counters and gauges written since the last hand-over, and the one timer that hands
    them to Ray. Written from vLLM's output handler, on the replica's event loop; a write from a
    thread without a running loop goes through at once."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._metrics: dict[int, _Buffered] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, metric: _Buffered) -> None:
        self._metrics[id(metric)] = metric
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop here (vLLM's set-up, a test): write through
            self.flush()
            return
        self._timer = loop.call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        self._timer = None
        metrics, self._metrics = self._metrics, {}
        for metric in metrics.values():
            try:
                metric.hand_over()
            except Exception:  # one bad series must not keep the others from Ray
                logger.exception("could not record engine metric %s", getattr(metric.metric, "_name", "?"))


PENDING = _Pending(METRICS_FLUSH_S)


class _Buffered:
    """What the buffered gauge and counter share: a labelled copy starts with nothing pending
    (vLLM labels each metric once per engine, `labels()` copies the instance)."""

    metric: Any

    def _reset(self) -> None:
        raise NotImplementedError

    def hand_over(self) -> None:
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

    def hand_over(self) -> None:
        if self._value is not None:
            RayGaugeWrapper.set(self, self._value)


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

    def hand_over(self) -> None:
        total, self._total = self._total, 0.0
        if total:
            RayCounterWrapper.inc(self, total)


class BufferedRaySpecDecodingProm(RaySpecDecodingProm):
    _counter_cls = BufferedRayCounter


class BufferedRayKVConnectorProm(RayKVConnectorProm):
    _gauge_cls = BufferedRayGauge
    _counter_cls = BufferedRayCounter


class BufferedRayPerfMetricsProm(RayPerfMetricsProm):
    _counter_cls = BufferedRayCounter


class BufferedRayStatLogger(RayPrometheusStatLogger):
    """Ray's stat logger for vLLM with the buffered counters and gauges: the same metric names,
    labels and histograms."""

    _gauge_cls = BufferedRayGauge
    _counter_cls = BufferedRayCounter
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
    """Ray Serve LLM's vLLM engine, its metrics recorded through BufferedRayStatLogger."""

    def _start_async_llm_engine(self, *args: Any, **kwargs: Any) -> Any:
        with _stat_logger(BufferedRayStatLogger):
            return super()._start_async_llm_engine(*args, **kwargs)
