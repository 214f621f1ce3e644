"""The alert rules, evaluated by Prometheus's own rule engine: `promtool test rules`.

What flows through here: the PrometheusRule that a stack renders (its `spec.groups` is a
Prometheus rule file) -> `promtool check rules` (syntax, as Prometheus loads it) and
`promtool test rules` with synthetic series for each alert: it fires on the failure it names,
after its `for`, with its labels and annotations, and stays quiet on healthy series.

promtool comes from Debian's `prometheus` package (before the tests run, `make test` extracts
the binary into .cache/ when it is not on PATH; see the Makefile). Runbook sections: docs/runbooks.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.config import Observability
from infra.k8s import alerts
from infra.k8s.serving_metrics import STREAM_MIGRATIONS
from infra.paths import ROOT
from serving.spec import SloSpec

NS = "llm"


def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    cached = ROOT / ".cache" / "prometheus" / "usr" / "bin" / "promtool"
    if not found and not cached.exists():
        # Installed by the Makefile as a prerequisite of `make test` and `make test-fast`
        # (promtool from Debian's prometheus package, no service); a test downloads nothing.
        pytest.fail(f"promtool is not on PATH nor in .cache/: `make {cached.relative_to(ROOT)}` extracts it")
    return found or str(cached)


@pytest.fixture(scope="module")
def rule_file(tmp_path_factory) -> Path:
    rule = alerts.prometheus_rule("pd-inference", NS, SloSpec(), Observability())
    d = tmp_path_factory.mktemp("rules")
    path = d / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _series(name: str, values: str, **labels: str) -> dict:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _annotations(alert: str, summary: str) -> dict:
    return {"summary": summary, "runbook_url": alerts.runbook(alert)}


def _ttft_burn(role: str, bad_per_min: int, model: str = "m") -> list[dict]:
    # 100 requests a minute; `bad_per_min` of them slower than the 2.5 s threshold.
    good = 100 - bad_per_min
    return [
        _series("ray_vllm_time_to_first_token_seconds_bucket", f"0+{good}x120", role=role, model_name=model, le="2.5"),
        _series("ray_vllm_time_to_first_token_seconds_count", "0+100x120", role=role, model_name=model),
    ]


def _tests() -> list[dict]:
    return _service_tests() + _hybrid_and_node_tests()


def _service_tests() -> list[dict]:
    burn = (
        "{m} on decode: time to first token above 2.5s for more than {b}x the error budget of a 99.00% SLO (window {w})"
    )
    return [
        {  # Half the requests miss the TTFT SLO: both burn windows fire, on the role that burns.
            "interval": "1m",
            "input_series": _ttft_burn("decode", 50) + _ttft_burn("prefill", 0),
            "alert_rule_test": [
                {
                    "eval_time": "30m",
                    "alertname": "PDTTFTBudgetBurn",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "slo": "ttft", "role": "decode", "model_name": "m"},
                            "exp_annotations": _annotations("PDTTFTBudgetBurn", burn.format(m="m", b=14.4, w="1h")),
                        },
                        {
                            "exp_labels": {"severity": "warning", "slo": "ttft", "role": "decode", "model_name": "m"},
                            "exp_annotations": _annotations("PDTTFTBudgetBurn", burn.format(m="m", b=6.0, w="6h")),
                        },
                    ],
                }
            ],
        },
        {  # Two models on one cluster: model b burns (30% slow), model a is healthy. Both
            # burn windows fire for b alone: summed over models (the one-model expression)
            # the share would be 15%, past the limits too, but without saying which model.
            "interval": "1m",
            "input_series": _ttft_burn("decode", 0, model="a") + _ttft_burn("decode", 30, model="b"),
            "alert_rule_test": [
                {
                    "eval_time": "30m",
                    "alertname": "PDTTFTBudgetBurn",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": sev, "slo": "ttft", "role": "decode", "model_name": "b"},
                            "exp_annotations": _annotations("PDTTFTBudgetBurn", burn.format(m="b", b=b, w=w)),
                        }
                        for sev, b, w in (("critical", 14.4, "1h"), ("warning", 6.0, "6h"))
                    ],
                }
            ],
        },
        {  # 0.5% slow requests is within a 99% SLO's budget: silence.
            "interval": "1m",
            "input_series": [
                _series(
                    "ray_vllm_time_to_first_token_seconds_bucket", "0+995x120", role="decode", model_name="m", le="2.5"
                ),
                _series("ray_vllm_time_to_first_token_seconds_count", "0+1000x120", role="decode", model_name="m"),
                _series(
                    "ray_vllm_inter_token_latency_seconds_bucket", "0+1000x120", role="decode", model_name="m", le="0.1"
                ),
                _series("ray_vllm_inter_token_latency_seconds_count", "0+1000x120", role="decode", model_name="m"),
            ],
            "alert_rule_test": [
                {"eval_time": "60m", "alertname": "PDTTFTBudgetBurn", "exp_alerts": []},
                {"eval_time": "60m", "alertname": "PDITLBudgetBurn", "exp_alerts": []},
            ],
        },
        {  # Every token slower than the ITL SLO on decode.
            "interval": "1m",
            "input_series": [
                _series(
                    "ray_vllm_inter_token_latency_seconds_bucket", "0+0x120", role="decode", model_name="m", le="0.1"
                ),
                _series("ray_vllm_inter_token_latency_seconds_count", "0+500x120", role="decode", model_name="m"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "10m",
                    "alertname": "PDITLBudgetBurn",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": sev, "slo": "itl", "role": "decode", "model_name": "m"},
                            "exp_annotations": _annotations(
                                "PDITLBudgetBurn",
                                f"m on decode: inter-token latency above 0.1s for more than {b}x the error budget "
                                f"of a 99.00% SLO (window {w})",
                            ),
                        }
                        for sev, b, w in (("critical", 14.4, "1h"), ("warning", 6.0, "6h"))
                    ],
                }
            ],
        },
        {  # A Ray pod Pending longer than the stack's limit (default 15 min), not before.
            "interval": "1m",
            "input_series": [
                _series(
                    "kube_pod_status_phase", "1x40", namespace=NS, pod="llm-raycluster-decode-abc", phase="Pending"
                ),
                _series("kube_pod_status_phase", "1x40", namespace="other", pod="x", phase="Pending"),
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": "PDReplicasPending", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "PDReplicasPending",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "namespace": NS, "pod": "llm-raycluster-decode-abc"},
                            "exp_annotations": _annotations(
                                "PDReplicasPending",
                                "Ray pod llm-raycluster-decode-abc has been Pending for more than 15 minutes "
                                "(no GPU capacity, quota, or an unschedulable spec)",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # A GPU reports XID 79 (fallen off the bus).
            "interval": "1m",
            "input_series": [
                _series("DCGM_FI_DEV_XID_ERRORS", "0 0 79 79 79", Hostname="ip-10-0-1-2", gpu="3"),
                _series("DCGM_FI_DEV_XID_ERRORS", "0 0 0 0 0", Hostname="ip-10-0-1-2", gpu="4"),
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "PDGpuXidErrors", "exp_alerts": []},
                {
                    "eval_time": "3m",
                    "alertname": "PDGpuXidErrors",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "Hostname": "ip-10-0-1-2", "gpu": "3"},
                            "exp_annotations": _annotations("PDGpuXidErrors", "GPU 3 on ip-10-0-1-2 reported XID 79"),
                        }
                    ],
                },
            ],
        },
        {  # 10% of requests answered 500 for 10 minutes; 4xx alone never counts.
            "interval": "1m",
            "input_series": [
                _series("ray_serve_num_http_requests_total", "0+90x20", application="llm", status_code="200"),
                _series("ray_serve_num_http_requests_total", "0+10x20", application="llm", status_code="500"),
                _series("ray_serve_num_http_requests_total", "0+50x20", application="llm", status_code="401"),
                _series("ray_serve_num_http_error_requests_total", "0+10x20", application="llm", error_code="500"),
                _series("ray_serve_num_http_error_requests_total", "0+50x20", application="llm", error_code="401"),
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "PDHighErrorRate", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "PDHighErrorRate",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "application": "llm"},
                            "exp_annotations": _annotations(
                                "PDHighErrorRate", "llm: more than 5% of API requests fail with 5xx (6.667%)"
                            ),
                        }
                    ],
                },
            ],
        },
        {  # Decode's replica died and Serve started a new one (a new series); target stayed 1.
            # Then a Ray container restarts. Prefill, steady, stays quiet.
            "interval": "1m",
            "input_series": [
                _series(
                    "ray_serve_deployment_replica_starts_total",
                    "1 1 1 1 _ _ _ _ _ _ _ _",
                    application="llm",
                    deployment="Decode:m",
                    replica="a",
                ),
                _series(
                    "ray_serve_deployment_replica_starts_total",
                    "_ _ _ _ _ 1 1 1 1 1 1 1",
                    application="llm",
                    deployment="Decode:m",
                    replica="b",
                ),
                _series(
                    "ray_serve_deployment_replica_starts_total",
                    "1x12",
                    application="llm",
                    deployment="Prefill:m",
                    replica="c",
                ),
                _series("ray_serve_autoscaling_target_replicas", "1x12", application="llm", deployment="Decode:m"),
                _series("ray_serve_autoscaling_target_replicas", "1x12", application="llm", deployment="Prefill:m"),
                _series(
                    "kube_pod_container_status_restarts_total",
                    "0 0 0 0 0 0 0 0 0 1 1 1",
                    namespace=NS,
                    pod="llm-decode-x",
                    container="ray-decode",
                ),
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "PDEngineRestarts", "exp_alerts": []},
                {
                    "eval_time": "6m",
                    "alertname": "PDEngineRestarts",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "application": "llm", "deployment": "Decode:m"},
                            "exp_annotations": _annotations(
                                "PDEngineRestarts", "Replicas restarted in the last 30 minutes: llm/Decode:m"
                            ),
                        }
                    ],
                },
                {
                    "eval_time": "11m",
                    "alertname": "PDEngineRestarts",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "application": "llm", "deployment": "Decode:m"},
                            "exp_annotations": _annotations(
                                "PDEngineRestarts", "Replicas restarted in the last 30 minutes: llm/Decode:m"
                            ),
                        },
                        {
                            "exp_labels": {"severity": "warning", "namespace": NS, "pod": "llm-decode-x"},
                            "exp_annotations": _annotations(
                                "PDEngineRestarts", "Replicas restarted in the last 30 minutes: llm-decode-x"
                            ),
                        },
                    ],
                },
            ],
        },
    ]


def _hybrid_and_node_tests() -> list[dict]:
    usage = "ray_pd_usage_requests_total"
    share = "{model}: more than 20% of requests answered by the external fallback for 10m ({pct})"
    return [
        {  # 30% of model m's answers come from the fallback, for good; model q's 10% stays quiet.
            "interval": "1m",
            "input_series": [
                _series(usage, "0+70x30", application="llm", key="k-1", model="m", destination="cluster"),
                _series(usage, "0+30x30", application="llm", key="k-1", model="m", destination="fallback"),
                _series(usage, "0+90x30", application="llm", key="k-2", model="q", destination="cluster"),
                _series(usage, "0+10x30", application="llm", key="k-2", model="q", destination="fallback"),
            ],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "PDFallbackShareHigh", "exp_alerts": []},
                {
                    "eval_time": "15m",
                    "alertname": "PDFallbackShareHigh",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "model": "m"},
                            "exp_annotations": _annotations("PDFallbackShareHigh", share.format(model="m", pct="30%")),
                        }
                    ],
                },
            ],
        },
        {  # The limits ledger stops answering: every request counts a limiter error.
            "interval": "1m",
            "input_series": [
                _series("ray_pd_limiter_errors_total", "0x5 1+2x20", application="llm", replica="a"),
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "PDLimiterErrors", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "PDLimiterErrors", "exp_alerts": []},
                {
                    "eval_time": "14m",
                    "alertname": "PDLimiterErrors",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning"},
                            "exp_annotations": _annotations(
                                "PDLimiterErrors",
                                "The limits ledger does not answer: per-key request and token limits are not enforced",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # 3 of 100 requests a minute refused (decode unavailable, then deadlines); 0.5% stays quiet.
            "interval": "1m",
            "input_series": [
                _series("ray_serve_num_http_requests_total", "0+100x20", application="llm", status_code="200"),
                _series(
                    "ray_pd_ingress_refusals_total",
                    "0+2x20",
                    application="llm",
                    model="m",
                    reason="decode_unavailable",
                    status="503",
                ),
                _series(
                    "ray_pd_ingress_refusals_total",
                    "0+1x20",
                    application="llm",
                    model="m",
                    reason="deadline",
                    status="504",
                ),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "PDRequestsRefused", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "PDRequestsRefused",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "model": "m"},
                            "exp_annotations": _annotations(
                                "PDRequestsRefused",
                                "m: more than 1% of requests refused as unservable (503/504, or sent to the fallback) "
                                "(3%)",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # Two models behind one front door: a's refusals (4 of 200 requests a minute) breach,
            # b's (1 of 200) do not. One alert, for a; summed (the one-model expression) 2.5%.
            "interval": "1m",
            "input_series": [
                _series("ray_serve_num_http_requests_total", "0+200x20", application="llm", status_code="200"),
                _series(
                    "ray_pd_ingress_refusals_total",
                    "0+4x20",
                    application="llm",
                    model="a",
                    reason="decode_unavailable",
                    status="503",
                ),
                _series(
                    "ray_pd_ingress_refusals_total",
                    "0+1x20",
                    application="llm",
                    model="b",
                    reason="deadline",
                    status="504",
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "12m",
                    "alertname": "PDRequestsRefused",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "model": "a"},
                            "exp_annotations": _annotations(
                                "PDRequestsRefused",
                                "a: more than 1% of requests refused as unservable (503/504, or sent to the fallback) "
                                "(2%)",
                            ),
                        }
                    ],
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                _series("ray_serve_num_http_requests_total", "0+200x20", application="llm", status_code="200"),
                _series(
                    "ray_pd_ingress_refusals_total",
                    "0+1x20",
                    application="llm",
                    model="m",
                    reason="overloaded",
                    status="503",
                ),
            ],
            "alert_rule_test": [{"eval_time": "15m", "alertname": "PDRequestsRefused", "exp_alerts": []}],
        },
        {  # The 2026-12-01 defect: every request answered, all prefilled on decode, for good.
            "interval": "1m",
            "input_series": [
                _series("ray_pd_prefill_path_total", "0+10x4 40x25", model="tiny", path="remote", reason=""),
                _series("ray_pd_prefill_path_total", "0x4 0+10x25", model="tiny", path="local", reason="circuit_open"),
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "PDRunningAggregated", "exp_alerts": []},
                {
                    "eval_time": "22m",
                    "alertname": "PDRunningAggregated",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "model": "tiny"},
                            "exp_annotations": _annotations(
                                "PDRunningAggregated",
                                "tiny: more than 20% of P/D requests prefilled on decode for 10m (100%): "
                                "the stack is serving aggregated",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # A prefill restart: two minutes of local prefill, then the circuit closes again.
            "interval": "1m",
            "input_series": [
                _series("ray_pd_prefill_path_total", "0+10x5 50x2 50+10x20", model="tiny", path="remote", reason=""),
                _series(
                    "ray_pd_prefill_path_total", "0x5 0+10x2 20x20", model="tiny", path="local", reason="circuit_open"
                ),
            ],
            "alert_rule_test": [{"eval_time": "25m", "alertname": "PDRunningAggregated", "exp_alerts": []}],
        },
        {  # n > 1 prefills on decode by design: a steady 30% of such requests is not a fault.
            "interval": "1m",
            "input_series": [
                _series("ray_pd_prefill_path_total", "0+7x25", model="tiny", path="remote", reason=""),
                _series("ray_pd_prefill_path_total", "0+3x25", model="tiny", path="local", reason="parallel_sampling"),
            ],
            "alert_rule_test": [{"eval_time": "25m", "alertname": "PDRunningAggregated", "exp_alerts": []}],
        },
        {  # EC2 has no p5 capacity: the autoscaler's scale-up fails (counters start at 0).
            "interval": "1m",
            "input_series": [
                _series("cluster_autoscaler_failed_scale_ups_total", "0 0 0 1 1 1 1 1", reason="cloudProviderError"),
                _series("cluster_autoscaler_failed_scale_ups_total", "0x7", reason="timeout"),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "PDNodeScaleUpFailed", "exp_alerts": []},
                {
                    "eval_time": "5m",
                    "alertname": "PDNodeScaleUpFailed",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "reason": "cloudProviderError"},
                            "exp_annotations": _annotations(
                                "PDNodeScaleUpFailed",
                                "The node autoscaler failed to add a node in the last 15 minutes (cloudProviderError)",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # Decode keeps dying and continuations fail: 1 failed + 1 not continuable a minute, for good.
            "interval": "1m",
            "input_series": [
                _series(STREAM_MIGRATIONS, "0+2x30", model="tiny", reason="replica_died", outcome="continued"),
                _series(STREAM_MIGRATIONS, "0+1x30", model="tiny", reason="replica_died", outcome="failed"),
                _series(STREAM_MIGRATIONS, "0+1x30", model="tiny", reason="stall", outcome="not_migratable"),
            ],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "PDStreamMigrationsFailing", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "PDStreamMigrationsFailing",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "model": "tiny"},
                            "exp_annotations": _annotations(
                                "PDStreamMigrationsFailing",
                                "tiny: streams cut mid-answer for 10m (2 a minute): migration did not continue them",
                            ),
                        }
                    ],
                },
            ],
        },
        {  # Migrations that continue, however many: every client got its whole answer.
            "interval": "1m",
            "input_series": [
                _series(STREAM_MIGRATIONS, "0+5x30", model="tiny", reason="replica_died", outcome="continued"),
                _series(STREAM_MIGRATIONS, "0+3x30", model="tiny", reason="stall", outcome="continued"),
                _series(STREAM_MIGRATIONS, "0x30", model="tiny", reason="replica_died", outcome="failed"),
            ],
            "alert_rule_test": [{"eval_time": "25m", "alertname": "PDStreamMigrationsFailing", "exp_alerts": []}],
        },
        {  # One decode death cuts three streams that could not be continued, once: not sustained.
            "interval": "1m",
            "input_series": [
                _series(STREAM_MIGRATIONS, "0x5 3x25", model="tiny", reason="replica_died", outcome="not_migratable"),
                _series(STREAM_MIGRATIONS, "0x5 5x25", model="tiny", reason="replica_died", outcome="continued"),
            ],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "PDStreamMigrationsFailing", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "PDStreamMigrationsFailing", "exp_alerts": []},
            ],
        },
    ]


def test_rules_load_in_prometheus(rule_file):
    r = _run("check", "rules", str(rule_file), cwd=rule_file.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_behaves_under_prometheus_rule_engine(rule_file):
    tests = rule_file.parent / "alerts_test.yaml"
    tests.write_text(
        yaml.safe_dump(
            {"rule_files": [rule_file.name], "evaluation_interval": "1m", "tests": _tests()}, sort_keys=False
        )
    )
    r = _run("test", "rules", tests.name, cwd=rule_file.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_test_and_a_runbook_section(rule_file):
    groups = yaml.safe_load(rule_file.read_text())["groups"]
    names = {r["alert"] for g in groups for r in g["rules"]}
    tested = {t["alertname"] for case in _tests() for t in case["alert_rule_test"]}
    assert names <= tested, f"alerts without a promtool test: {sorted(names - tested)}"
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    for name in names:
        assert f"## {name}" in runbooks, f"docs/runbooks.md has no section for {name}"


def test_promtool_catches_a_renamed_metric(rule_file, tmp_path):
    """A rule whose metric was renamed no longer fires on the series the stack exports."""
    broken = rule_file.read_text().replace("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR")
    xid = next(t for t in _tests() if t["alert_rule_test"][0]["alertname"] == "PDGpuXidErrors")
    (tmp_path / "rules.yaml").write_text(broken)
    (tmp_path / "t.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [xid]}, sort_keys=False)
    )
    r = _run("test", "rules", "t.yaml", cwd=tmp_path)
    assert r.returncode != 0
