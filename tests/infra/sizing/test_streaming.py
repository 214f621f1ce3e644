"""The streaming replica's API-side CPU sized from its CPU per output token: the arithmetic by
hand, the plan of the shipped stacks against an independent computation, and the refusal."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from infra import config
from infra.plan import planning
from infra.plan.stack import load, stack_replica_cpus, streaming
from infra.sizing import streaming as st
from infra.sizing.head import TARGET_UTILIZATION
from tools import stackfile

FIGURE = st.StreamingCpu(
    replica_ms_per_1k={"disaggregated": 500.0, "aggregated": 250.0},
    ingress_ms_per_1k={"disaggregated": 200.0, "aggregated": 200.0},
    measured="m",
    machine="x",
    source="s",
    # Half the replica's CPU on its event loop: one process turns at most 2 cores into streaming.
    loop_share={"disaggregated": 0.5, "aggregated": 0.5},
    loop_source="l",
)


def test_cpus_and_ceiling_by_hand():
    # 2,000 tok/s x 0.5 CPU-ms per token = 1,000 CPU-ms per second: 1.0 busy CPU; / 0.7 = 1.43 -> 2.
    s = st.size_streaming(
        2000.0,
        "disaggregated",
        pod_cpus=180,
        replicas_per_node=1,
        gpus_per_replica=8,
        figure=FIGURE,
    )
    assert (s.cpus, s.cpus_needed, s.node_cpus) == (2, 2, 180)
    # min(2 CPUs, 1 / 0.5) x 1e6 / 500 = 4,000 tok/s; one core 2,000.
    assert s.ceiling_tok_s == pytest.approx(4000.0) and s.one_core_tok_s == pytest.approx(2000.0)
    assert st.replica_cpus(s) == {"decode": 2} and not st.streaming_errors(s)
    # Below 0.7 of a core the replica keeps Ray's default of 1 and renders nothing.
    low = dataclasses.replace(s, cpus=1, cpus_needed=1)
    assert st.replica_cpus(low) == {}
    assert st.replica_cpus(None) == {}


def test_a_node_that_cannot_give_the_cpus_caps_them_and_the_ceiling_falls_below_the_plan():
    # 4 vCPUs, pod 2 (catalog.pod_cpus), one replica: 2 CPUs. 2,618 tok/s x 0.7655 = 2.0 busy
    # / 0.7 = 2.86 -> 3 needed; 2 x 1e6 / 765.5 = 2,612.7 tok/s < 2,618.
    fig = dataclasses.replace(FIGURE, replica_ms_per_1k={"disaggregated": 765.5})
    kw = dict(pod_cpus=2, replicas_per_node=1, gpus_per_replica=1)
    s = st.size_streaming(2618.0, "disaggregated", **kw, figure=fig)
    assert (s.cpus, s.cpus_needed, s.node_cpus) == (2, 3, 2)
    assert s.ceiling_tok_s == pytest.approx(2 * 1e6 / 765.5)
    [(key, msg)] = st.streaming_errors(s)
    assert key == "serving.decode.targetOngoingRequests"
    assert "planned for 2,618 output tokens/s" in msg and "streams at most 2,613" in msg and "needs 3 CPUs" in msg
    assert "FAILS" in st.format_streaming(s)[0]
    # Nothing searched (or nothing fits): the way out is a node with more CPUs.
    assert "even targetOngoingRequests 1 plans more than that" in msg
    # A target found to fit is named as the fix.
    [(_, found)] = st.streaming_errors(dataclasses.replace(s, fitting_target=12))
    assert found.endswith("set targetOngoingRequests to 12 or less")


def test_cpus_past_what_one_event_loop_uses_are_not_asked_for_and_add_no_ceiling():
    # 91.5% of the replica's CPU on its event loop: one process uses at most 1 / 0.915 = 1.093
    # cores. 6,000 tok/s x 0.5 = 3.0 busy / 0.7 = 4.29 -> 5 needed, but asked: ceil(1.093) = 2;
    # ceiling 1.093 x 1e6 / 500 = 2,186 tok/s, below the plan.
    fig = dataclasses.replace(FIGURE, loop_share={"disaggregated": 0.915})
    s = st.size_streaming(6000.0, "disaggregated", pod_cpus=180, replicas_per_node=1, gpus_per_replica=8, figure=fig)
    assert (s.cpus, s.cpus_needed, s.node_cpus) == (2, 5, 180)
    assert s.usable_cores == pytest.approx(1 / 0.915)
    assert s.ceiling_tok_s == pytest.approx(1e6 / 0.915 / 500)
    [(_, msg)] = st.streaming_errors(s)
    assert "streams at most 2,186: 1.09 of its 2 CPUs (one process, 91.5% of its CPU on its event loop)" in msg
    # On one CPU (1,000 tok/s: 0.5 busy / 0.7 -> 1) the loop's share does not bind: the CPU does.
    one = st.size_streaming(1000.0, "disaggregated", pod_cpus=180, replicas_per_node=1, gpus_per_replica=8, figure=fig)
    assert one.cpus == 1 and one.usable_cores == 1 and one.ceiling_tok_s == pytest.approx(2000.0)


def _cfg(stack: str) -> config.StackConfig:
    values, secrets, _ = stackfile.read_as_deployed(stack)
    return load(copy.deepcopy(values), secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")


@pytest.mark.parametrize("stack", ["dev", "staging", "prod", "platform", "deepseek-p5", "deepseek-p5en"])
def test_every_shipped_stack_is_sized_from_its_decode_roofline(stack):
    cfg = _cfg(stack)
    for spec in cfg.serving.served:
        p = planning.plan(planning.model_view(cfg, spec))
        s = p.streaming
        assert s is not None, "every shipped stack's model shape is known"
        dec = next(r for r in p.roles if r.role == "decode")
        # The decode roofline at targetOngoingRequests, per replica, as the plan's scale-out rests
        # on it; a data-parallel group's ranks are Serve replicas of their own, each with its own
        # API side (Ray 2.60 dp_server.py: num_replicas = groups x data_parallel_size), so each
        # streams its share.
        group = dec.scaling.max_rps / dec.max_replicas * planning.Workload().output_tokens
        tok_s = group / spec.decode.data_parallel_size
        assert s.planned_tok_s == pytest.approx(tok_s)
        ms = st.STREAMING_CPU.replica_ms_per_1k[spec.mode.value]
        want = max(1, math.ceil(tok_s * ms / 1e6 / TARGET_UTILIZATION))
        # Never more than one process's event loop can use (1 / its share of the CPU).
        usable = math.ceil(1 / st.STREAMING_CPU.loop_share[spec.mode.value])
        assert s.cpus == min(want, usable, s.node_cpus)
        # What one node gives each of its replicas: its pod's CPUs over the ranks it holds.
        rank_gpus = spec.decode.tensor_parallel_size * spec.decode.pipeline_parallel_size
        pool = cfg.node_pools[spec.pool_of("decode")].instance
        assert s.node_cpus == pool.pod_cpus // max(1, pool.gpus // rank_gpus)
        rendered = stack_replica_cpus(cfg).get(spec.model.id, {})
        assert rendered == ({} if s.cpus == 1 else {"decode": s.cpus})
        assert any(line.startswith("Stream ") for line in planning.format_plan(p).splitlines())


def test_a_layout_whose_ceiling_is_below_its_plan_is_refused_naming_the_key_and_the_target_that_fits(monkeypatch):
    # dev's decode replica (g5.xlarge: 2 pod CPUs, targetOngoingRequests 14) is planned at
    # 2,337 tok/s. At the net figure, 465.8 CPU-ms per 1,000 tokens, one process streams at most
    # 1 / 0.915 x 1e6 / 465.8 = 2,346 tok/s: it plans. At the raw figure of 2026-12-02 (765.5,
    # idle and full tracing included) that is 1,428 tok/s: the stack is refused, naming the key.
    cfg = _cfg("dev")
    [s] = streaming(cfg).values()
    assert s is not None and not st.below_plan(s)
    raw = {"disaggregated": 765.5, "aggregated": 326.2}
    monkeypatch.setattr(st, "STREAMING_CPU", dataclasses.replace(st.STREAMING_CPU, replica_ms_per_1k=raw))
    with pytest.raises(config.ConfigError) as e:
        _cfg("dev")
    assert "stacks/Pulumi.dev.yaml: serving.decode.targetOngoingRequests:" in str(e.value)
    assert "\n" not in str(e.value)
    fits = int(str(e.value).rsplit("set targetOngoingRequests to ", 1)[1].split()[0])
    # The named target is the largest that loads: the stack file with it loads, one more is refused.
    assert 1 <= fits < cfg.serving.decode.target_ongoing_requests
    assert _cfg_with_decode_target("dev", fits).serving.decode.target_ongoing_requests == fits
    with pytest.raises(config.ConfigError, match=r"serving\.decode\.targetOngoingRequests"):
        _cfg_with_decode_target("dev", fits + 1)


def _cfg_with_decode_target(stack: str, target: int) -> config.StackConfig:
    values, secrets, _ = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    values["serving"].setdefault("decode", {})["targetOngoingRequests"] = target
    return load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")


def test_a_many_model_stack_names_the_model_whose_replica_cannot_stream_its_plan(monkeypatch):
    # platform's first model (llama-3.1-8b, P/D on g6e.xlarge: 2 pod CPUs) is planned at about
    # 738 tok/s per decode replica; a figure 10x the net one puts its one-core ceiling below that.
    slow = {"disaggregated": 4658.0, "aggregated": 278.1}
    monkeypatch.setattr(st, "STREAMING_CPU", dataclasses.replace(st.STREAMING_CPU, replica_ms_per_1k=slow))
    with pytest.raises(config.ConfigError) as e:
        _cfg("platform")
    assert "serving.models[0] (llama-3.1-8b-instruct).decode.targetOngoingRequests:" in str(e.value)


def test_each_rank_of_a_data_parallel_decode_group_streams_its_share():
    # deepseek-p5: decode DP 16 x TP 1 with expert parallelism on p5.48xlarge (8 GPUs, 180 pod
    # CPUs). The group's roofline is split over 16 Serve replicas, 8 per node: each streams a
    # sixteenth and may take 180 // 8 = 22 CPUs; a sixteenth needs Ray's default, so nothing
    # is rendered (the group as one replica asked 10 CPUs of every rank).
    cfg = _cfg("deepseek-p5")
    [s] = streaming(cfg).values()
    assert s is not None and s.data_parallel_size == 16
    p = planning.plan(cfg)
    dec = next(r for r in p.roles if r.role == "decode")
    group = dec.scaling.max_rps / dec.max_replicas * planning.Workload().output_tokens
    assert s.planned_tok_s == pytest.approx(group / 16)
    assert s.node_cpus == 22 and s.cpus == 1
    assert stack_replica_cpus(cfg) == {}
    assert "decode replica (one of a group's 16 DP ranks) planned for" in planning.format_plan(p)
