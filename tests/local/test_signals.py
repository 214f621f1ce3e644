"""`make serve SIGNALS=1` / `SCALE_TO_ZERO=1`: what the local stack deploys, and the
local Prometheus's scrape config checked by Prometheus's own `promtool check config`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from local import config as local_config
from local import prometheus as local_prom
from serving.spec.scaling import POLICY_PATHS
from tests.infra.k8s.test_alert_rules import promtool

MODEL_DIR = Path("/models/tiny")


def _engines(**kw):
    (app,) = local_config.render_local_config("disaggregated", MODEL_DIR, port=8000, **kw)["applications"]
    return app["args"]["prefill_config"]["deployment_config"], app["args"]["decode_config"]["deployment_config"]


def test_with_signals_each_role_runs_its_policy_on_its_own_series_and_prefill_may_scale():
    prefill, decode = _engines(signals=True)
    for role, dep in (("prefill", prefill), ("decode", decode)):
        scaling = dep["autoscaling_config"]
        assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2), role
        policy = scaling["policy"]
        assert policy["policy_function"] == POLICY_PATHS[role]
        assert policy["policy_kwargs"]["metrics_selector"] == f'role="{role}"'
    # The cloud's rule on the local objective: prefill adds a replica at half the TTFT queued.
    thresholds = prefill["autoscaling_config"]["policy"]["policy_kwargs"]["thresholds"]
    assert thresholds["queue_time_s"] == local_config.LOCAL_SLO["ttftSeconds"] / 2


def test_without_signals_prefill_stays_fixed_and_no_policy_reads_prometheus():
    prefill, decode = _engines()
    p = prefill.get("autoscaling_config") or {}
    assert p.get("min_replicas", prefill.get("num_replicas")) == p.get("max_replicas", prefill.get("num_replicas")) == 1
    assert "metrics_selector" not in decode["autoscaling_config"]["policy"]["policy_kwargs"]


def test_scale_to_zero_lets_decode_idle_to_zero_after_starting_with_one():
    _, decode = _engines(scale_to_zero=True)
    scaling = decode["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"]) == (0, 1)


def test_the_scrape_config_is_one_prometheus_loads_with_each_node_labelled_by_role(tmp_path):
    nodes = [
        {"label": "head", "metrics_url": "http://192.0.2.2:40001/metrics"},
        {"label": "prefill", "metrics_url": "http://192.0.2.2:40002/metrics"},
        {"label": "decode", "metrics_url": "http://192.0.2.2:40003/metrics"},
    ]
    text = local_prom.scrape_config(nodes)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(text)
    check = subprocess.run([promtool(), "check", "config", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    (job,) = json.loads(text)["scrape_configs"]
    got = {t["targets"][0]: t["labels"][local_prom.ROLE_LABEL] for t in job["static_configs"]}
    assert got == {"192.0.2.2:40001": "head", "192.0.2.2:40002": "prefill", "192.0.2.2:40003": "decode"}
