"""The Ray head sized from the front door's CPU per request: the plan's numbers, checked
against an independent computation, and the stack config's one-line refusals."""

from __future__ import annotations

import copy
import math

import pytest

from bench.serving_bench import OUTPUT_LEN
from infra import config
from infra.plan import planning
from infra.plan.stack import load
from infra.sizing import head as head_sizing
from infra.sizing.head import FRONT_DOOR_CPU, HEAD_BASE_VCPUS, TARGET_UTILIZATION, front_door_cpu
from infra.sizing.streaming import STREAMING_CPU
from tools import stackfile

SOURCE = "stacks/Pulumi.prod.yaml"


@pytest.fixture
def prod():
    values, secrets, _ = stackfile.read_as_deployed("prod")
    return copy.deepcopy(values), secrets


def _load(values, secrets):
    return load(values, secret_keys=secrets, source=SOURCE)


def _error(values, secrets) -> str:
    with pytest.raises(config.ConfigError) as e:
        _load(values, secrets)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def streamed_ms(mode: str) -> float:
    """The ingress's CPU-ms for the plan's output tokens past the bench requests' own: the
    per-request figures were measured with the bench's output lengths (uniform over
    bench/serving_bench.py OUTPUT_LEN: their mean), and the ingress relays every token."""
    low, high = OUTPUT_LEN
    measured_with = (low + high) / 2
    return (planning.Workload().output_tokens - measured_with) * STREAMING_CPU.ingress_ms_per_1k[mode] / 1000


def expected(cfg: config.StackConfig) -> dict:
    """The sizing by hand: the slowest role's rate at maxReplicas (its scale-out rate at
    minReplicas, scaled), then the front door's CPU at that rate."""
    p = planning.plan(cfg)
    rates = []
    for r in p.roles:
        assert r.scaling is not None and r.scaling.scale_out_rps is not None
        spec = cfg.serving.engine_roles()[r.role]
        rates.append(r.scaling.scale_out_rps / spec.min_replicas * spec.max_replicas)
    rate = min(rates)
    mode = cfg.serving.mode.value
    figure = FRONT_DOOR_CPU[cfg.serving.ingress.data_plane.value]
    proxy, ingress = figure.proxy_ms[mode], figure.ingress_ms[mode] + streamed_ms(mode)
    cpu_s_per_s = rate * (proxy + ingress) / 1000
    return {
        "rate": rate,
        "busy": cpu_s_per_s,
        "head": math.ceil(HEAD_BASE_VCPUS + cpu_s_per_s / TARGET_UTILIZATION),
        "ingress": max(1, math.ceil(rate * ingress / 1000 / TARGET_UTILIZATION)),
    }


def test_the_plan_sizes_the_head_as_an_independent_computation_does(prod):
    cfg = _load(*prod)
    want = expected(cfg)
    head = planning.plan(cfg).head
    assert head is not None
    assert head.planned_rps == pytest.approx(want["rate"])
    assert head.busy_vcpus == pytest.approx(want["busy"])
    assert (head.head_vcpus, head.ingress_replicas) == (want["head"], want["ingress"])
    text = planning.format_plan(planning.plan(cfg))
    assert f"planned rate {want['rate']:,.1f} req/s" in text
    assert f"head pod needs {want['head']} vCPUs" in text
    assert f"ingress replicas needed {want['ingress']}" in text
    figure = FRONT_DOOR_CPU[cfg.serving.ingress.data_plane.value]
    assert figure.measured in text and figure.kind in text


def test_a_system_node_too_small_for_the_planned_rate_is_refused_with_the_key(prod):
    values, secrets = prod
    want = expected(_load(values, secrets))
    assert want["head"] > HEAD_BASE_VCPUS  # the rate, not only Ray's own work, asks for more
    # m7i.xlarge: 4 vCPUs, of which the head pod gets 2 (the node head-room rule).
    values["systemNodes"]["instanceType"] = "m7i.xlarge"
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: systemNodes.instanceType: m7i.xlarge gives the Ray head pod 2 vCPUs")
    assert f"needs {want['head']}" in msg
    values["systemNodes"]["instanceType"] = "m7i.2xlarge"  # 6 for the head pod: enough
    assert _load(values, secrets).system_nodes.instance_type == "m7i.2xlarge"


def test_too_few_ingress_replicas_for_the_planned_rate_are_refused_with_the_key(prod):
    values, secrets = prod
    # Serve's Python proxy in front (ray-proxy): prod's rate then needs several ingress replicas.
    values["serving"]["ingress"] = {**values["serving"].get("ingress", {}), "dataPlane": "ray-proxy", "maxReplicas": 16}
    want = expected(_load(values, secrets))
    assert want["ingress"] > 1
    values["serving"]["ingress"] = {"minReplicas": 1, "maxReplicas": want["ingress"] - 1, "dataPlane": "ray-proxy"}
    msg = _error(values, secrets)
    assert msg.startswith(f"{SOURCE}: serving.ingress.maxReplicas: {want['ingress'] - 1} ingress replicas cannot")
    assert f"it needs {want['ingress']}" in msg


def test_a_costlier_front_door_needs_more_of_both():
    base = front_door_cpu("haproxy")
    cheap = head_sizing.size_head(100.0, "decode", "aggregated", "m7i.2xlarge", 2, base)
    proxy, ingress = (2 * v for v in base.per_request_ms("aggregated"))
    dear = head_sizing.FrontDoorCpu(
        proxy_ms={"aggregated": proxy},
        ingress_ms={"aggregated": ingress},
        measured="test",
        machine="test",
        source="test",
        kind="test",
    )
    costly = head_sizing.size_head(100.0, "decode", "aggregated", "m7i.2xlarge", 2, dear)
    # 100 req/s x (proxy + ingress) ms of CPU per request, over 1000 ms per second.
    busy = 100.0 * (proxy + ingress) / 1000
    assert costly.busy_vcpus == pytest.approx(busy)
    assert costly.head_vcpus == math.ceil(HEAD_BASE_VCPUS + busy / TARGET_UTILIZATION)
    assert costly.ingress_replicas == math.ceil(100.0 * ingress / 1000 / TARGET_UTILIZATION)
    assert costly.head_vcpus > cheap.head_vcpus and costly.ingress_replicas > cheap.ingress_replicas
    keys = [k for k, _ in head_sizing.head_errors(costly)]
    assert keys == ["systemNodes.instanceType", "serving.ingress.maxReplicas"]


@pytest.mark.parametrize(
    ("instance", "vcpus"),
    # AWS's published vCPU counts.
    [("m7i.large", 2), ("m7i.xlarge", 4), ("m7i.2xlarge", 8), ("m7i.24xlarge", 96), ("c7a.metal-48xl", 192)],
)
def test_vcpus_from_the_size_name(instance, vcpus):
    assert head_sizing.vcpus_of(instance) == vcpus


def test_a_size_the_rule_cannot_read_is_refused_with_the_key(prod):
    values, secrets = prod
    assert head_sizing.vcpus_of("x2iezn.metal") is None
    values["systemNodes"]["instanceType"] = "x2iezn.metal"
    assert _error(values, secrets).startswith(f"{SOURCE}: systemNodes.instanceType: 'x2iezn.metal': the head sizing")


@pytest.mark.parametrize("stack", stackfile.stacks())
def test_shipped_stacks_carry_their_planned_rate(stack):
    values, secrets, _ = stackfile.read_as_deployed(stack)
    cfg = load(values, secret_keys=secrets, source=stack)
    head = planning.plan(cfg).head
    assert head is None or not head_sizing.head_errors(head)


def test_the_rendered_head_pod_asks_for_the_planned_vcpus(rendered_stacks):
    """Through the real program under mocks: the RayService head's CPU request is the plan's."""
    for name, r in rendered_stacks.items():
        head = planning.plan(r.config).head
        want = head.head_vcpus if head else HEAD_BASE_VCPUS
        (rs,) = [x for x in r.result.resources if x.type == "kubernetes:ray.io/v1:RayService"]
        res = rs.inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["cpu"] == str(want), name
        assert int(res["limits"]["cpu"]) >= want, name


def test_the_stacks_data_plane_picks_its_own_measured_figure(prod):
    """serving.ingress.dataPlane decides what a request costs the head: Serve's Python proxy
    (ray-proxy) was measured dearer per request than HAProxy in front of the ingress
    replica's own HTTP server (haproxy), so the same planned rate asks more of the head."""
    values, secrets = prod
    sizes = {}
    for plane in ("haproxy", "grpc", "ray-proxy"):
        v = copy.deepcopy(values)
        v["serving"]["ingress"] = {**v["serving"].get("ingress", {}), "dataPlane": plane, "maxReplicas": 16}
        v["systemNodes"]["instanceType"] = "m7i.8xlarge"  # room for the dearest
        cfg = _load(v, secrets)
        head = planning.plan(cfg).head
        assert head is not None
        fig = FRONT_DOOR_CPU[plane]
        mode = cfg.serving.mode.value
        assert head.proxy_ms == fig.proxy_ms[mode]
        assert head.ingress_ms == pytest.approx(fig.ingress_ms[mode] + streamed_ms(mode))
        assert fig.measured in planning.format_plan(planning.plan(cfg))
        sizes[plane] = head.busy_vcpus
    assert sizes["haproxy"] < sizes["ray-proxy"]


def test_every_data_plane_has_a_measured_figure_for_every_mode():
    from serving.spec import DataPlane, Mode

    for plane in DataPlane:
        fig = front_door_cpu(plane.value)
        for mode in (Mode.DISAGGREGATED, Mode.AGGREGATED):
            proxy, ingress = fig.per_request_ms(mode.value)
            assert proxy > 0 and ingress > 0


def test_the_head_check_reads_the_plan_after_the_configs_own_checks(prod):
    """The config's own load accepts a head too small for the planned rate (the config never
    reads the plan); the stack loader that pulumi up and the tools use refuses it."""
    values, secrets = prod
    values["systemNodes"] = {**values.get("systemNodes", {}), "instanceType": "m7i.large"}
    assert config.load(values, secret_keys=secrets, source=SOURCE).system_nodes.instance_type == "m7i.large"
    assert "systemNodes" in _error(values, secrets)


def test_the_ingress_relays_every_planned_token_past_the_measured_requests():
    """The per-request figures were measured with the bench's short answers; a planned request
    with 1,000 more output tokens costs the ingress 1,000 x the per-token figure more, and one
    with fewer costs no less than the figure (the floor)."""
    fig = front_door_cpu("haproxy")
    proxy, measured = fig.per_request_ms("aggregated")
    per_1k = {"aggregated": 200.0}
    n0 = head_sizing.FIGURE_OUTPUT_TOKENS
    longer = head_sizing.size_head(
        10.0, "decode", "aggregated", "m7i.2xlarge", 2, fig, output_tokens=n0 + 1000, stream_ms_per_1k=per_1k
    )
    assert longer.ingress_ms == pytest.approx(measured + 200.0)
    assert longer.busy_vcpus == pytest.approx(10.0 * (proxy + measured + 200.0) / 1000)
    assert longer.ingress_replicas == math.ceil(10.0 * (measured + 200.0) / 1000 / TARGET_UTILIZATION)
    text = head_sizing.format_head(longer)[0]
    assert f"({measured:g} measured + 1000 more output tokens x 200 CPU-ms per 1,000)" in text
    shorter = head_sizing.size_head(
        10.0, "decode", "aggregated", "m7i.2xlarge", 2, fig, output_tokens=8, stream_ms_per_1k=per_1k
    )
    assert shorter.ingress_ms == measured and "measured +" not in head_sizing.format_head(shorter)[0]


def test_a_plan_for_longer_answers_costs_the_ingress_more_per_request(prod):
    cfg = _load(*prod)
    short = planning.plan(cfg).head
    long = planning.plan(cfg, workload=planning.Workload(output_tokens=2048)).head
    assert short is not None and long is not None
    assert long.ingress_ms > short.ingress_ms
    # The same roofline emits the same tokens/s: fewer requests, each streaming more tokens.
    assert long.planned_rps < short.planned_rps
