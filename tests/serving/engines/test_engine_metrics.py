"""serving/engines/engine_metrics.py: vLLM's metrics reach Ray's once per METRICS_FLUSH_S, with
the same totals, last values and observations, and every engine Ray Serve LLM starts gets that
stat logger."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from ray.llm._internal.serve.engines.vllm import vllm_engine as ray_vllm_engine
from vllm.v1.metrics import ray_wrappers
from vllm.v1.metrics.ray_wrappers import (
    RayCounterWrapper,
    RayGaugeWrapper,
    RayHistogramWrapper,
    RayPrometheusStatLogger,
)

from serving.engines import engine_metrics as em
from serving.spec import BUFFERED_ENGINE_CLS, ENGINE_CLS_ENV, METRICS_FLUSH_S


def _engine(metric) -> str:
    return metric._tags.get("engine", "-")  # "-": a metric not labelled yet


@pytest.fixture
def handed(monkeypatch):
    """Every call that reaches Ray's wrappers (what Ray records), in order; a short interval."""
    calls: list[tuple[str, str, float]] = []
    monkeypatch.setattr(RayGaugeWrapper, "set", lambda self, v: calls.append(("set", _engine(self), v)))
    monkeypatch.setattr(RayCounterWrapper, "inc", lambda self, v=1.0: calls.append(("inc", _engine(self), v)))
    monkeypatch.setattr(RayHistogramWrapper, "observe", lambda self, v: calls.append(("observe", _engine(self), v)))
    monkeypatch.setattr(em, "PENDING", em._Pending(0.05))
    return calls


def _gauge(name: str) -> em.BufferedRayGauge:
    return em.BufferedRayGauge(name, "test", labelnames=["engine"])


def _counter(name: str) -> em.BufferedRayCounter:
    return em.BufferedRayCounter(name, "test", labelnames=["engine"])


def _histogram(name: str) -> em.BufferedRayHistogram:
    return em.BufferedRayHistogram(name, "test", labelnames=["engine"], buckets=[0.01, 0.1, 1.0])


def _longest_run_between_turns(handed) -> int:
    """The most points handed to Ray with no "turn" (a stream's callback) between them."""
    run = longest = 0
    for h in handed:
        run = 0 if h[0] == "turn" else run + 1
        longest = max(longest, run)
    return longest


def _on_a_loop(coro_fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def test_a_steps_writes_reach_ray_once_with_the_total_and_the_last_value(handed):
    gauge, counter = _gauge("t_running").labels("0"), _counter("t_tokens").labels("0")

    async def steps():
        for running, tokens in [(3, 16), (4, 16), (2, 9), (0, 0)]:  # four engine steps
            gauge.set(running)
            counter.inc(tokens)
        before = list(handed)
        await asyncio.sleep(0.2)
        return before

    assert _on_a_loop(steps) == []  # nothing on the engine step itself
    assert sorted(handed) == [("inc", "0", 41), ("set", "0", 0)]


def test_every_histogram_observation_reaches_ray_once_in_the_hand_over(handed):
    """Inter-token latencies, one per streamed token: each is recorded, in order, with the same
    buckets, sum and count as before, a second later at most."""
    itl = _histogram("t_itl").labels("0")

    async def steps():
        for gap in (0.012, 0.02, 0.02, 0.5):
            itl.observe(gap)
        before = list(handed)
        await asyncio.sleep(0.2)
        itl.observe(0.03)
        await asyncio.sleep(0.2)
        return before

    assert _on_a_loop(steps) == []
    assert handed == [("observe", "0", v) for v in (0.012, 0.02, 0.02, 0.5, 0.03)]
    with pytest.raises(TypeError, match="int or float"):
        itl.observe("slow")


def test_a_large_hand_over_leaves_the_loop_to_the_streams_between_batches(handed, monkeypatch):
    """A busy replica's second of inter-token latencies goes to Ray a batch per loop turn, the
    streams' own callbacks between: never more than a batch in one go, and nothing lost."""
    monkeypatch.setattr(em, "PENDING", em._Pending(0.05, batch=3))
    itl, tokens = _histogram("t_burst").labels("0"), _counter("t_burst_tokens").labels("0")

    async def busy():
        for i in range(7):
            itl.observe(i / 100)
        tokens.inc(7)
        stop = asyncio.get_running_loop().time() + 0.3
        while asyncio.get_running_loop().time() < stop:  # a stream: one callback per turn
            handed.append(("turn", "", 0))
            await asyncio.sleep(0)

    _on_a_loop(busy)
    points = [h for h in handed if h[0] != "turn"]
    assert points == [*(("observe", "0", i / 100) for i in range(7)), ("inc", "0", 7)]
    assert _longest_run_between_turns(handed) == 3


def test_a_window_handed_over_while_the_last_still_drains_waits_its_turn(handed, monkeypatch):
    """The next second's hand-over joins the queue of one still draining instead of starting
    a second drain: still never more than a batch per loop turn, nothing lost or repeated."""
    pending = em._Pending(60, batch=3)  # the test hands over; no timer fires
    monkeypatch.setattr(em, "PENDING", pending)
    itl = _histogram("t_overlap").labels("0")

    async def busy():
        for i in range(7):
            itl.observe(i / 100)
        pending.flush()  # a batch now, the rest scheduled
        itl.observe(0.5)
        pending.flush()  # the next window, in the same loop turn
        for _ in range(10):
            handed.append(("turn", "", 0))
            await asyncio.sleep(0)

    _on_a_loop(busy)
    points = [h for h in handed if h[0] != "turn"]
    assert points == [*(("observe", "0", i / 100) for i in range(7)), ("observe", "0", 0.5)]
    assert _longest_run_between_turns(handed) == 3


def test_a_labelled_histogram_does_not_share_its_parents_pending_values(handed):
    parent = _histogram("t_hist_copies")

    async def step():
        parent.observe(0.1)
        child = parent.labels("1")
        child.observe(0.2)
        await asyncio.sleep(0.2)

    _on_a_loop(step)
    assert sorted(handed) == [("observe", "-", 0.1), ("observe", "1", 0.2)]


def test_writes_after_a_hand_over_start_a_new_one_and_nothing_is_repeated(handed):
    counter = _counter("t_repeat").labels("0")

    async def two_windows():
        counter.inc(5)
        await asyncio.sleep(0.2)
        counter.inc(2)
        await asyncio.sleep(0.2)
        await asyncio.sleep(0.2)  # a window with no write hands nothing over

    _on_a_loop(two_windows)
    assert handed == [("inc", "0", 5), ("inc", "0", 2)]


def test_each_labelled_series_keeps_its_own_pending_value(handed):
    parent = _counter("t_per_engine")

    async def step():
        parent.inc(7)  # pending when the copies are made: not carried into them
        one, two = parent.labels("1"), parent.labels("2")
        one.inc(1)
        two.inc(2)
        one.inc(1)
        await asyncio.sleep(0.2)

    _on_a_loop(step)
    assert sorted(handed) == [("inc", "-", 7), ("inc", "1", 2), ("inc", "2", 2)]


def test_without_a_running_loop_a_write_goes_through_at_once(handed):
    _gauge("t_info").labels("0").set(1)
    _counter("t_init").labels("0").inc(3)
    assert handed == [("set", "0", 1), ("inc", "0", 3)]


def test_a_counter_refuses_a_negative_increment_where_it_is_made(handed):
    counter = _counter("t_negative").labels("0")
    counter.inc(0)  # as Ray's wrapper: nothing to record
    with pytest.raises(ValueError, match="must be >0"):
        counter.inc(-1)
    assert handed == []


def test_one_failing_series_does_not_keep_the_others_from_ray(handed, monkeypatch):
    bad, good = _gauge("t_bad").labels("bad"), _counter("t_good").labels("good")

    def refuse(self, v):
        raise TypeError("not a number")

    monkeypatch.setattr(RayGaugeWrapper, "set", refuse)

    async def step():
        bad.set(1)
        good.inc(4)
        await asyncio.sleep(0.2)

    _on_a_loop(step)
    assert handed == [("inc", "good", 4)]


def test_the_stat_logger_builds_every_metric_buffered():
    """vLLM builds its metrics from these class attributes (loggers.py PrometheusStatLogger;
    the same names in vLLM 0.29, the worker image's, and 0.32)."""
    logger = em.BufferedRayStatLogger
    assert issubclass(logger, RayPrometheusStatLogger)
    assert logger._gauge_cls is em.BufferedRayGauge and logger._counter_cls is em.BufferedRayCounter
    assert logger._histogram_cls is em.BufferedRayHistogram
    for part in ("_spec_decoding_cls", "_kv_connector_cls", "_perf_metrics_cls"):
        cls = getattr(logger, part)
        assert issubclass(cls, getattr(RayPrometheusStatLogger, part)), part
        assert cls._counter_cls is em.BufferedRayCounter, part
    kv = logger._kv_connector_cls
    assert kv._gauge_cls is em.BufferedRayGauge and kv._histogram_cls is em.BufferedRayHistogram
    assert METRICS_FLUSH_S <= 10  # under Ray's export interval: no export misses a step's values


def test_rays_engine_start_hands_vllm_the_buffered_stat_logger(monkeypatch):
    """Ray 2.60's own `_start_async_llm_engine` runs, with vLLM's AsyncLLM and executor lookup
    stood in for: the stat loggers it passes are ours, and the upstream name is restored after."""
    from ray.serve.llm import LLMConfig
    from vllm.v1.engine import async_llm
    from vllm.v1.executor import abstract

    seen = {}

    class FakeAsyncLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(async_llm, "AsyncLLM", FakeAsyncLLM)
    monkeypatch.setattr(abstract.Executor, "get_class", staticmethod(lambda config: "executor"))
    engine = object.__new__(em.BufferedMetricsVLLMEngine)
    engine.llm_config = LLMConfig(model_loading_config={"model_id": "m"})
    args = SimpleNamespace(enable_log_requests=False, disable_log_stats=False)
    config = SimpleNamespace(parallel_config=SimpleNamespace(placement_group=None))

    engine._start_async_llm_engine(args, config, "pg")
    assert seen["stat_loggers"] == [em.BufferedRayStatLogger]
    assert ray_wrappers.RayPrometheusStatLogger is RayPrometheusStatLogger
    # Ray's own engine, as a contrast: the check can fail.
    object.__setattr__(engine, "__class__", ray_vllm_engine.VLLMEngine)
    engine._start_async_llm_engine(args, config, "pg")
    assert seen["stat_loggers"] == [RayPrometheusStatLogger]


def test_ray_imports_the_stat_logger_by_name_when_it_starts_the_engine():
    """What the binding relies on: Ray reads vLLM's module attribute at engine start, not once
    at import (Ray 2.60 engines/vllm/vllm_engine.py)."""
    source = inspect.getsource(ray_vllm_engine.VLLMEngine._start_async_llm_engine)
    assert "from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger" in source
    assert "RayPrometheusStatLogger" not in vars(ray_vllm_engine)


def test_every_ray_process_starts_engines_from_the_buffered_class(monkeypatch):
    """Ray Serve LLM reads the engine class from the environment every Ray process gets
    (ServingSpec.ray_env) when a server starts its engine; without it, Ray's own."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    from tests.serving.spec.test_performance import spec

    env = spec().ray_env()
    assert env[ENGINE_CLS_ENV] == BUFFERED_ENGINE_CLS
    server = object.__new__(LLMServer)
    monkeypatch.delenv(ENGINE_CLS_ENV, raising=False)
    assert server._get_default_engine_class() is ray_vllm_engine.VLLMEngine
    monkeypatch.setenv(ENGINE_CLS_ENV, env[ENGINE_CLS_ENV])
    assert server._get_default_engine_class() is em.BufferedMetricsVLLMEngine


def test_the_engine_start_turns_off_rays_usage_report_before_rays_server_pushes_it(monkeypatch):
    """Every engine replica builds its engine from this class: starting one leaves Ray's
    server calling the wrapper that pushes nothing while usage stats are off
    (serving.ray_internals.skip_usage_telemetry_when_off)."""
    from ray.llm._internal.serve.core.server import llm_server

    upstream = llm_server.push_telemetry_report_for_all_models
    monkeypatch.setattr(llm_server, "push_telemetry_report_for_all_models", upstream)

    async def started(self) -> None:
        return None

    monkeypatch.setattr(ray_vllm_engine.VLLMEngine, "start", started)
    asyncio.run(object.__new__(em.BufferedMetricsVLLMEngine).start())
    assert llm_server.push_telemetry_report_for_all_models is not upstream
    assert getattr(llm_server.push_telemetry_report_for_all_models, "_skips_when_usage_stats_off", False)
