"""A 503 sent while decode has no running replica says when to come back.

What flows through here: a dev stack whose decode role may scale to zero -> the Pulumi
program under mocks (the real `__main__.py`) -> the planner's "first request after idle" for
decode (infra/plan/planning.py, what `make plan` prints) -> the RayService's serveConfigV2,
`args.resilience.cold_start_retry_after_s` -> the ingress's ResilienceSpec -> the
Retry-After of the 503s the ingress sends because decode has no running replica:
`first_chunk`'s decode-unavailable refusals (serving/ingress/relay.py), and the hybrid
router's answer when no fallback takes a request while Serve reports decode at zero
(serving/ingress/routing.py). Serve itself scales 0 -> 1 when a request waits (Ray 2.60
ray/serve/autoscaling_policy.py `_get_cold_start_scale_up_replicas`); the Retry-After tells
the client how long that start takes.
"""

from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import yaml

from infra import config as stack_config
from infra.plan import planning
from serving.core.failures import Reason, Unservable, overloaded
from serving.ingress.relay import DecodeHealth, first_chunk
from serving.spec import ResilienceSpec
from tests.serving.fakes import FakeStream, is_5xx, run
from tests.serving.ingress.test_routing import _routing, _run, _Watch
from tools import mock_runtime, stackfile


@functools.cache
def _dev(decode_min: int, **resilience: int) -> tuple[stack_config.StackConfig, dict]:
    """dev with serving.decode.minReplicas = decode_min: (its config, its rendered args.resilience)."""
    values, secrets, others = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["serving"]["decode"]["minReplicas"] = decode_min
    if resilience:
        values["serving"]["resilience"] = resilience
    cfg = stack_config.load(values, secret_keys=secrets, source="stacks/Pulumi.dev.yaml")
    result = mock_runtime.run("dev", values, secrets, others)
    rs = next(r for r in result.resources if r.inputs.get("kind") == "RayService")
    serve = yaml.safe_load(rs.inputs["spec"]["serveConfigV2"])
    return cfg, serve["applications"][0]["args"]["resilience"]


@pytest.fixture(scope="module")
def dev_at_zero() -> tuple[stack_config.StackConfig, dict]:
    return _dev(0)


def _planned_decode_cold_start_s(cfg: stack_config.StackConfig) -> float:
    decode = next(r for r in planning.plan(cfg).roles if r.role == "decode")
    assert decode.first_request_after_idle_s is not None
    return decode.first_request_after_idle_s


# --- the render --------------------------------------------------------------------------
def test_a_decode_at_zero_renders_the_planners_time_to_serve(dev_at_zero):
    cfg, resilience = dev_at_zero
    planned = _planned_decode_cold_start_s(cfg)
    assert resilience["cold_start_retry_after_s"] == math.ceil(planned)
    # dev's decode pool may empty too (minSize 0): a new node's time, as make plan says.
    assert cfg.node_pools.decode.min_size == 0
    text = planning.format_plan(planning.plan(cfg))
    line = next(x for x in text.splitlines() if x.startswith("First request after idle"))
    assert f"{planned / 60:.1f} min (new node)" in line
    # Everything else keeps its value: the fast refusals still say retryAfterS.
    assert resilience["retry_after_s"] == cfg.serving.resilience.retry_after_s < resilience["cold_start_retry_after_s"]


def test_a_decode_that_keeps_a_replica_renders_retry_after():
    cfg, resilience = _dev(1)
    assert resilience["cold_start_retry_after_s"] == resilience["retry_after_s"] == cfg.serving.resilience.retry_after_s


def test_the_stack_can_set_its_own_cold_start_retry_after():
    _, resilience = _dev(0, coldStartRetryAfterS=90)
    assert resilience["cold_start_retry_after_s"] == 90


def test_a_bad_cold_start_retry_after_is_one_line_naming_the_key():
    values, secrets, _ = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["serving"]["resilience"] = {"coldStartRetryAfterS": 0}
    with pytest.raises(stack_config.ConfigError) as e:
        stack_config.load(values, secret_keys=secrets, source="stacks/Pulumi.dev.yaml")
    assert "\n" not in str(e.value) and "coldStartRetryAfterS" in str(e.value)


# --- the ingress's 503s ------------------------------------------------------------------
def _first_chunk(streams, cfg: ResilienceSpec, health: DecodeHealth):
    calls = list(streams)

    async def go():
        import time

        return await first_chunk(
            lambda: calls.pop(0),
            cfg=cfg,
            health=health,
            started=time.monotonic(),
            is_server_error=is_5xx,
            on_retry=lambda r: None,
        )

    return run(go())


def test_decode_lost_and_no_replica_taking_the_call_503_says_the_cold_start(dev_at_zero):
    _, resilience = dev_at_zero
    cfg = ResilienceSpec.from_args({**resilience, "fail_fast_s": 0.05})
    health = DecodeHealth()
    health.trouble()  # a decode replica died; nothing has succeeded since
    with pytest.raises(Unservable) as e:
        _first_chunk([FakeStream(["tok"], assigned=False)], cfg, health)
    assert e.value.reason is Reason.DECODE_UNAVAILABLE and e.value.status == 503
    assert e.value.headers == {"Retry-After": str(resilience["cold_start_retry_after_s"])}


def test_decode_dying_on_every_attempt_503_says_the_cold_start(dev_at_zero):
    from ray.exceptions import ActorDiedError

    _, resilience = dev_at_zero
    cfg = ResilienceSpec.from_args(resilience)
    streams = [FakeStream([ActorDiedError()]) for _ in range(cfg.decode_attempts)]
    with pytest.raises(Unservable) as e:
        _first_chunk(streams, cfg, DecodeHealth())
    assert e.value.headers == {"Retry-After": str(resilience["cold_start_retry_after_s"])}


def test_args_rendered_before_the_field_existed_still_load():
    """A Serve config rendered by the previous release has no cold_start_retry_after_s."""
    _, resilience = _dev(1)
    old = {k: v for k, v in resilience.items() if k != "cold_start_retry_after_s"}  # a copy: _dev caches
    cfg = ResilienceSpec.from_args(old)
    assert cfg.unavailable_retry_after_s == cfg.retry_after_s
    assert cfg.scale_from_zero_retry_after_s is None


def test_no_fallback_and_decode_at_zero_the_503_says_the_cold_start(monkeypatch, dev_at_zero):
    """The request waited for Serve to start decode from zero and gave up (the ingress's
    overload 503); Serve still reports no running decode replica, and no fallback is set."""
    _, resilience = dev_at_zero
    cfg = ResilienceSpec.from_args(resilience)
    r, _, _ = _routing(monkeypatch, fallback=False)
    r.cold_start_retry_after_s = cfg.scale_from_zero_retry_after_s
    r.watch = _Watch({"Decode": 0, "Prefill": 0, "Ingress": 1})

    async def call(body):
        raise overloaded(cfg.retry_after_s)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.status_code == 503
    assert resp.headers["Retry-After"] == str(resilience["cold_start_retry_after_s"])
    assert b"decode_unavailable" in resp.body


def test_a_busy_decode_that_runs_keeps_the_overload_refusal(monkeypatch, dev_at_zero):
    """Decode runs (queued behind busy replicas): the 503 stands as it was, Retry-After too."""
    _, resilience = dev_at_zero
    cfg = ResilienceSpec.from_args(resilience)
    r, _, _ = _routing(monkeypatch, fallback=False)
    r.cold_start_retry_after_s = cfg.scale_from_zero_retry_after_s
    r.watch = _Watch({"Decode": 1, "Prefill": 1, "Ingress": 1})

    async def call(body):
        raise overloaded(cfg.retry_after_s)

    resp, _ = _run(r, {"model": "ours", "prompt": "x"}, call)
    assert resp.status_code == 503 and json.loads(resp.body)["error"]["code"] == Reason.OVERLOADED.value
    assert resp.headers["Retry-After"] == str(cfg.retry_after_s)


def test_the_ingress_watches_serve_when_decode_may_scale_to_zero(monkeypatch, dev_at_zero):
    """Without a fallback the router watches Serve's status only for the cold start."""
    import asyncio

    from serving.ingress import routing as hybrid

    started = []

    class _Recorder:
        def __init__(self, app_name, own_deployment):
            pass

        def start(self):
            started.append(self)

        def stop(self):
            pass

    monkeypatch.setattr(hybrid, "ClusterWatch", _Recorder)  # no Serve controller polled here
    _, resilience = dev_at_zero
    at_zero, _, _ = _routing(monkeypatch, fallback=False)
    at_zero.cold_start_retry_after_s = ResilienceSpec.from_args(resilience).scale_from_zero_retry_after_s
    kept, _, _ = _routing(monkeypatch, fallback=False)
    kept.cold_start_retry_after_s = ResilienceSpec.from_args(_dev(1)[1]).scale_from_zero_retry_after_s

    async def go():
        await at_zero.reconfigure({})
        await kept.reconfigure({})

    asyncio.run(go())
    assert (at_zero.watch in started, kept.watch) == (True, None)
