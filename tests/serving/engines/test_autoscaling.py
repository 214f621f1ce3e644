"""The per-role policies (serving/engines/autoscaling.py), driven with Ray's own context object.

Upstream, read in the installed Ray 2.60:
- `ray/serve/config.py` AutoscalingContext (PublicAPI stable): built here with its own
  constructor, as Serve's controller builds it (`_private/autoscaling_state.py`).
- `ray/serve/_private/autoscaling_state.py` `_resolve_policy_callable`: a class policy is
  instantiated once with `policy_kwargs`; `ray/serve/autoscaling_policy.py`
  `_apply_autoscaling_config` wraps it (bounds, delays, the 0 -> 1 cold start).
- `ray/serve/autoscaling_policy.py` PrometheusQueryMixin (PublicAPI alpha): instant queries
  against `<address>/api/v1/query`, answered here by a stand-in speaking Prometheus's HTTP API
  (its response shape: `{"status": "success", "data": {"resultType": "vector", ...}}`).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.engines import autoscaling
from serving.spec import ServingSpec, Target

ray_config = pytest.importorskip("ray.serve.config")


def _ctx(replicas: int, ongoing: float, queued: float = 0.0, target: int | None = None):
    from ray.serve._private.common import DeploymentID

    return ray_config.AutoscalingContext(
        deployment_id=DeploymentID(name="PDDecodeServer", app_name="llm"),
        deployment_name="PDDecodeServer",
        app_name="llm",
        current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=queued,
        aggregated_metrics={},
        raw_metrics={},
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=None,
    )


class _Prometheus:
    """Answers instant queries with the value set for each, as one-sample vectors."""

    def __init__(self, values: dict[str, float]):
        self.values = values
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["query"][0]
                result = [{"metric": {}, "value": [time.time(), str(outer.values[q])]}] if q in outer.values else []
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


def _with_metrics(policy, expected: int, deadline_s: float = 20.0):
    """Wait (bounded) until the policy's refresh thread has fetched `expected` results."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if len(policy.observed()) == expected:
            return policy
        time.sleep(0.05)
    raise AssertionError(f"the policy never read its metrics: {policy.observed()}")


PREFILL = {"queue_time_s": 1.25, "waiting_requests": 10.0, "ttft_s": 2.5}
DECODE = {"running_requests": 16.0, "kv_cache_usage": 0.9, "itl_s": 0.1}


def test_prefill_scales_on_queue_time_that_ongoing_requests_do_not_show():
    """A long-prompt burst: few requests in flight (under target), but each waits 2.5 s queued."""
    sel = 'role="prefill"'
    prom = _Prometheus({autoscaling.query("queue_time_s", sel): 2.5, autoscaling.query("ttft_s", sel): 3.0})
    try:
        policy = autoscaling.PrefillPolicy(
            target_ongoing_requests=8,
            thresholds=PREFILL,
            metrics_selector=sel,
            prometheus_address=prom.address,
            fetch_interval_s=0.05,
        )
        _with_metrics(policy, 2)
        desired, state = policy(_ctx(replicas=2, ongoing=6))
        # queue time 2.5 s / 1.25 s = 2.0 is the largest pressure (TTFT 3.0 / 2.5 = 1.2).
        assert desired == pytest.approx(4.0)
        assert state["pd_signal"] == "queue_time_s"
    finally:
        prom.close()


def test_decode_scales_on_running_sequences_and_kv_cache_not_prefills_signals():
    sel = 'role="decode"'
    # 2 replicas run 48 sequences (24 each, threshold 16) with the fullest KV cache at 45%.
    prom = _Prometheus({autoscaling.query("running_requests", sel): 48, autoscaling.query("kv_cache_usage", sel): 0.45})
    try:
        policy = autoscaling.DecodePolicy(
            target_ongoing_requests=32,
            thresholds=DECODE,
            metrics_selector=sel,
            prometheus_address=prom.address,
            fetch_interval_s=0.05,
        )
        _with_metrics(policy, 2)
        desired, state = policy(_ctx(replicas=2, ongoing=48))
        assert desired == pytest.approx(3.0)  # 24 / 16 = 1.5 (KV 0.45 / 0.9 = 0.5)
        assert state["pd_signal"] == "running_requests"
        # A quiet decode pool asks for fewer replicas (Serve's bounds and delays apply on top).
        prom.values = {autoscaling.query("running_requests", sel): 4, autoscaling.query("kv_cache_usage", sel): 0.09}
        end = time.monotonic() + 20
        while policy.observed().get("running_requests") != 4 and time.monotonic() < end:
            time.sleep(0.05)
        desired, _ = policy(_ctx(replicas=2, ongoing=4))
        assert desired < 1.0
    finally:
        prom.close()


def test_a_long_prompt_burst_does_not_scale_decode_on_requests_that_wait_for_prefill():
    """P/D: decode holds every request while its prefill runs remotely. 40 of them are
    ongoing on one decode replica (5x its target of 8), but its engine runs 3 sequences."""
    sel = 'role="decode"'
    prom = _Prometheus({autoscaling.query("running_requests", sel): 3, autoscaling.query("kv_cache_usage", sel): 0.05})
    try:
        policy = autoscaling.DecodePolicy(
            target_ongoing_requests=8,
            thresholds={**DECODE, "running_requests": 8.0},
            metrics_selector=sel,
            prometheus_address=prom.address,
            fetch_interval_s=0.05,
        )
        _with_metrics(policy, 2)
        desired, state = policy(_ctx(replicas=1, ongoing=40))
        assert desired <= 1.0 and state["pd_signal"] == "running_requests"
        # The same load without engine signals (Prometheus gone): Serve's rule, 40 / 8.
        prom.close()
        stale = autoscaling.DecodePolicy(target_ongoing_requests=8, thresholds=DECODE)
        assert stale(_ctx(replicas=1, ongoing=40))[0] == pytest.approx(5.0)
    finally:
        prom.close()


def test_without_prometheus_the_policy_is_serves_own_rule_on_ongoing_requests():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
    from ray.serve.config import AutoscalingConfig

    policy = autoscaling.DecodePolicy(target_ongoing_requests=4, thresholds=DECODE)
    ctx = _ctx(replicas=3, ongoing=30)
    ctx.config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=4)
    ours, _ = policy(ctx)
    theirs, _ = replica_queue_length_autoscaling_policy(ctx)
    assert ours == pytest.approx(theirs)  # 3 x 30 / 12 = 7.5


def test_at_zero_replicas_the_policy_leaves_the_cold_start_to_serve():
    policy = autoscaling.PrefillPolicy(target_ongoing_requests=4, thresholds=PREFILL)
    desired, _ = policy(_ctx(replicas=0, ongoing=0, target=0))
    assert desired == 0


def test_serve_wraps_the_rendered_policy_with_bounds_and_the_cold_start():
    """The rendered config, resolved and wrapped the way Serve's controller does it."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    spec = ServingSpec.model_validate(
        {"model": {"id": "m", "source": "org/model"}, "decode": {"minReplicas": 0, "maxReplicas": 3}}
    )
    raw = spec.app_args(Target(accelerator_type="H100"))["decode_config"]["deployment_config"]["autoscaling_config"]
    config = AutoscalingConfig.model_validate(raw)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    # Idle at zero, a request arrives: Serve's cold-start path asks for one replica at once.
    cold = _ctx(replicas=0, ongoing=1, target=0)
    cold.config = config
    assert policy(cold)[0] == 1


def test_unknown_thresholds_are_refused_by_the_policy():
    with pytest.raises(ValueError, match="unknown signals"):
        autoscaling.DecodePolicy(target_ongoing_requests=4, thresholds={"queue_time_s": 1.0})


def test_the_policy_module_imports_only_the_standard_library_and_ray():
    """The Serve controller unpickles it by value without the app's working_dir."""
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(autoscaling.__file__).read_text())
    roots = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert roots - {"__future__", "ray"} <= set(sys.stdlib_module_names), roots
