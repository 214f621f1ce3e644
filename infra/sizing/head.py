"""Sizing the Ray head from what the front door costs per request in CPU.

What flows through here: the stack's planned request rate (the capacity plan's roofline
requests/s at maxReplicas, the slower engine role's: `infra.plan.planning.planned_rate`),
the serving mode, the system node instance type and `FRONT_DOOR_CPU` (the measured input,
per data plane: CPU-ms per request of Serve's HTTP proxy (and HAProxy) and of the ingress
replicas, with its date, machine and source) -> `HeadSizing`: vCPUs the front door keeps
busy, vCPUs the head pod needs, ingress replicas needed, and what one system node can give
the head pod -> `format_head` (the plan's text) and `head_errors` (the stack's refusal,
one line naming the key, through `infra.plan.stack.load`).

The arithmetic, for a planned rate R (requests/s) of n output tokens each, proxy and
ingress CPU-ms per request p and m (measured with requests of n0 = FIGURE_OUTPUT_TOKENS
output tokens), the ingress's CPU-ms per 1,000 output tokens t (the streaming figure, which
the caller passes in) and a target utilization U:
  ingress per request  i = m + max(0, n - n0) x t / 1000: the ingress relays every token.
  busy vCPUs        R x (p + i) / 1000. The ingress replicas are pinned to the head
                    (serving/spec/serving.py: the ingress's label_selector); Serve runs a proxy on
                    every node that holds a replica (proxy_location EveryNode), so counting
                    all proxy work on the head is an upper bound.
  head vCPUs        ceil(HEAD_BASE_VCPUS + busy / U).
  ingress replicas  ceil(R x i / 1000 / U): one replica is one Python process, whose
                    request handling runs on one event loop, at most one core's worth.
Pure arithmetic: no Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from infra import catalog


@dataclass(frozen=True)
class FrontDoorCpu:
    """A measured input: what the front door costs per request in CPU, per serving mode.

    proxy_ms / ingress_ms: CPU-ms per request of Serve's HTTP proxy and of the ingress
    replicas, by serving mode ("disaggregated", "aggregated"). `kind` says what the figure
    is (a CPU measurement, or a bound derived from wall times) and how to replace it.
    """

    proxy_ms: Mapping[str, float]
    ingress_ms: Mapping[str, float]
    measured: str  # when the run was taken
    machine: str  # what it ran on
    source: str  # the file and table it comes from
    kind: str

    def per_request_ms(self, mode: str) -> tuple[float, float]:
        return self.proxy_ms[mode], self.ingress_ms[mode]


# THE figures the head sizing uses, in one place, per data plane (serving.ingress.dataPlane:
# how requests reach the ingress; the stack's own value picks the figure): `make bench`'s CPU
# sampler (bench/cpu.py), the front door's CPU per request over the whole request, the
# stream's way back included. Replace a figure from the bench JSON's
# cpu.<mode>.all.classes.serve_proxy (+ haproxy) / .ingress cpu_ms_per_request (docs/capacity.md).
_BENCH_SOURCE = (
    "build/bench/serving.json cpu.<mode>.all.classes: user + system CPU of the processes over "
    "every batch of levels 1, 4 and 16 (bench/cpu.py), tiny model, streamed chat with about 56 "
    "output tokens per request"
)
FRONT_DOOR_CPU: Mapping[str, FrontDoorCpu] = {
    # Serve's Python proxy actor takes each request and calls the ingress replica (Ray's default).
    "ray-proxy": FrontDoorCpu(
        proxy_ms={"disaggregated": 21.96, "aggregated": 21.56},
        ingress_ms={"disaggregated": 35.04, "aggregated": 34.06},
        measured="2026-12-01 18:14 UTC",
        machine="the project's 2-core, 24 GiB CPU machine, with unit tests running beside the bench (loaded)",
        source=f"make bench with serving.ingress.dataPlane ray-proxy, {_BENCH_SOURCE}",
        kind="measured CPU per request (proxy and ingress processes, the whole request both ways)",
    ),
    # HAProxy forwards to the ingress replica's own HTTP server; the proxy actor only manages
    # HAProxy (and reads its per-request log lines for Serve's HTTP metrics).
    "haproxy": FrontDoorCpu(
        proxy_ms={"disaggregated": 4.37, "aggregated": 3.98},  # proxy actor + HAProxy
        ingress_ms={"disaggregated": 14.02, "aggregated": 13.93},
        measured="2026-12-02 00:17 UTC",
        machine="the project's 2-core, 24 GiB CPU machine, nothing else running",
        source=f"make bench with serving.ingress.dataPlane haproxy, {_BENCH_SOURCE}",
        kind="measured CPU per request (proxy actor + HAProxy, and ingress processes, the whole request both ways)",
    ),
    # Serve's proxy, gRPC between replicas: measured by make bench-data-plane only.
    "grpc": FrontDoorCpu(
        proxy_ms={"disaggregated": 32.3, "aggregated": 34.1},
        ingress_ms={"disaggregated": 41.8, "aggregated": 43.6},
        measured="2026-12-01 23:58 UTC - 2026-12-02 00:17 UTC",
        machine="the project's 2-core, 24 GiB CPU machine, a helper's unit tests beside the first round",
        source=(
            "make bench-data-plane (bench/data_plane.py), build/bench/data-plane.json: the grpc runs' "
            "proxy and ingress CPU-ms per request, medians over rounds, levels 1 and 16"
        ),
        kind="measured CPU per request (proxy and ingress processes, the whole request both ways)",
    ),
}


def front_door_cpu(data_plane: str) -> FrontDoorCpu:
    """The measured figure for a stack's serving.ingress.dataPlane value."""
    return FRONT_DOOR_CPU[data_plane]


# The head's own work with no requests (GCS, Serve controller, dashboard, autoscaler, its
# raylet): the head pod's CPU request (infra/k8s/rayservice.py takes it from here).
HEAD_BASE_VCPUS = 2
# The share of a core the sizing lets the front door use: headroom for bursts, garbage
# collection and what the figure leaves out. The project's choice, not an upstream rule.
TARGET_UTILIZATION = 0.7

# EC2's size names: `large` has 2 vCPUs, each `<n>xlarge` 4 x n and `metal-<n>xl` as many as
# `<n>xlarge` (AWS "Amazon EC2 instance type specifications", general purpose, compute and
# memory optimized families).
_SIZE = re.compile(r"^[a-z0-9-]+\.(?:(large)|(\d*)xlarge|metal-(\d+)xl)$")


def vcpus_of(instance_type: str) -> int | None:
    """vCPUs of a CPU instance type from its size name; None for sizes the rule does not cover
    (metal, medium, ...)."""
    m = _SIZE.match(instance_type)
    if not m:
        return None
    if m.group(1):
        return 2
    return 4 * int(m.group(3) or m.group(2) or 1)


@dataclass(frozen=True)
class HeadSizing:
    """What the planned rate asks of the head, and what the system nodes give it."""

    planned_rps: float
    bounded_by: str  # the engine role whose maxReplicas roofline sets the planned rate
    proxy_ms: float
    ingress_ms: float
    busy_vcpus: float  # vCPUs the proxy and ingress keep busy at the planned rate
    head_vcpus: int  # the head pod's need, with HEAD_BASE_VCPUS and TARGET_UTILIZATION
    ingress_replicas: int  # needed at the planned rate
    ingress_max_replicas: int  # serving.ingress.maxReplicas
    system_instance: str
    head_pod_vcpus: int | None  # what one system node can give the head pod; None: unknown size
    figure: FrontDoorCpu
    measured_ingress_ms: float = 0.0  # the figure's, at FIGURE_OUTPUT_TOKENS
    streamed_tokens: int = 0  # output tokens per planned request past the figure's
    stream_ms_per_1k: float = 0.0  # the ingress's CPU-ms per 1,000 of them


# The serving mode of a head sized for several models (their figures weighted by rate).
MIXED = "mixed"
# The mean output tokens of the requests the per-request figures were measured with
# (bench/serving_bench.py OUTPUT_LEN: uniform 16..96). The ingress relays every token of a
# stream, so a planned request with more of them costs the ingress the per-token figure
# (infra/sizing/streaming.py STREAMING_CPU.ingress_ms_per_1k) for each token past these.
FIGURE_OUTPUT_TOKENS = 56


def size_head(
    planned_rps: float,
    bounded_by: str,
    mode: str,
    system_instance: str,
    ingress_max_replicas: int,
    figure: FrontDoorCpu,
    *,
    output_tokens: int = FIGURE_OUTPUT_TOKENS,
    stream_ms_per_1k: Mapping[str, float] | None = None,
) -> HeadSizing:
    """The head's vCPUs and the ingress replicas for `planned_rps` requests/s of
    `output_tokens` each (`stream_ms_per_1k`: the ingress's CPU per output token, by mode;
    None: the per-request figure alone)."""
    proxy, measured = figure.per_request_ms(mode)
    streamed = max(0, output_tokens - FIGURE_OUTPUT_TOKENS) if stream_ms_per_1k else 0
    stream_ms = stream_ms_per_1k[mode] if stream_ms_per_1k else 0.0
    # Fewer tokens than the figure's take nothing off: the figure stays the floor.
    ingress = measured + streamed * stream_ms / 1000
    busy = planned_rps * (proxy + ingress) / 1000
    node = vcpus_of(system_instance)
    return HeadSizing(
        planned_rps=planned_rps,
        bounded_by=bounded_by,
        proxy_ms=proxy,
        ingress_ms=ingress,
        busy_vcpus=busy,
        head_vcpus=math.ceil(HEAD_BASE_VCPUS + busy / TARGET_UTILIZATION),
        ingress_replicas=max(1, math.ceil(planned_rps * ingress / 1000 / TARGET_UTILIZATION)),
        ingress_max_replicas=ingress_max_replicas,
        system_instance=system_instance,
        # The same head-room rule as the GPU workers' pods (kubelet, CNI, DaemonSets).
        head_pod_vcpus=None if node is None else catalog.pod_cpus(node),
        figure=figure,
        measured_ingress_ms=measured,
        streamed_tokens=streamed,
        stream_ms_per_1k=stream_ms,
    )


def size_head_many(
    parts: list[tuple[float, str, str]],
    system_instance: str,
    ingress_max_replicas: int,
    figure: FrontDoorCpu,
    *,
    output_tokens: int = FIGURE_OUTPUT_TOKENS,
    stream_ms_per_1k: Mapping[str, float] | None = None,
) -> HeadSizing:
    """The head for several models behind one front door: `parts` are (planned req/s, what
    bounds it, serving mode) per model; the rates add up, and the CPU per request (and per
    streamed token) is each model's mode's, weighted by its rate."""
    total = sum(rps for rps, _, _ in parts)

    def weighted(by_mode: Mapping[str, float]) -> dict[str, float]:
        mixed = round(sum(rps * by_mode[mode] for rps, _, mode in parts) / total, 2) if total else 0.0
        return {**by_mode, MIXED: mixed}

    mixed = dataclasses.replace(figure, proxy_ms=weighted(figure.proxy_ms), ingress_ms=weighted(figure.ingress_ms))
    bounded_by = " + ".join(b for _, b, _ in parts)
    return size_head(
        total,
        bounded_by,
        MIXED,
        system_instance,
        ingress_max_replicas,
        mixed,
        output_tokens=output_tokens,
        stream_ms_per_1k=None if stream_ms_per_1k is None else weighted(stream_ms_per_1k),
    )


def head_errors(h: HeadSizing) -> list[tuple[str, str]]:
    """The system node and the ingress must carry the planned rate; (key, message) each."""
    rate = f"the planned {h.planned_rps:,.1f} req/s ({h.bounded_by} roofline at maxReplicas, make plan)"
    errors = []
    if h.head_pod_vcpus is None:
        errors.append(
            (
                "systemNodes.instanceType",
                f"{h.system_instance!r}: the head sizing reads vCPUs from EC2 size names "
                "(large, xlarge, <n>xlarge, metal-<n>xl); use one of those sizes",
            )
        )
    elif h.head_vcpus > h.head_pod_vcpus:
        errors.append(
            (
                "systemNodes.instanceType",
                f"{h.system_instance} gives the Ray head pod {h.head_pod_vcpus} vCPUs; {rate} needs "
                f"{h.head_vcpus} ({h.proxy_ms + h.ingress_ms:.2f} front-door CPU-ms per request, docs/capacity.md)",
            )
        )
    if h.ingress_replicas > h.ingress_max_replicas:
        errors.append(
            (
                "serving.ingress.maxReplicas",
                f"{h.ingress_max_replicas} ingress replicas cannot carry {rate}: it needs {h.ingress_replicas} "
                f"({h.ingress_ms:.2f} CPU-ms per request each, one core per replica at "
                f"{TARGET_UTILIZATION:.0%})",
            )
        )
    return errors


def format_head(h: HeadSizing | None) -> list[str]:
    """The plan's lines on the head (none when the planned rate is unknown)."""
    if h is None:
        return ["Head     not sized (no roofline rate: model shape unknown)"]
    pod = "an unknown size" if h.head_pod_vcpus is None else f"{h.head_pod_vcpus} vCPUs"
    ok = "ok" if not head_errors(h) else "FAILS"
    streamed = (
        f" ({h.measured_ingress_ms:g} measured + {h.streamed_tokens} more output tokens x {h.stream_ms_per_1k:g} "
        "CPU-ms per 1,000)"
        if h.streamed_tokens
        else ""
    )
    return [
        f"Head     planned rate {h.planned_rps:,.1f} req/s ({h.bounded_by} roofline at maxReplicas); front door "
        f"{h.proxy_ms:g} + {h.ingress_ms:.2f} CPU-ms per request (proxy + ingress{streamed}) -> "
        f"{h.busy_vcpus:,.2f} busy vCPUs",
        f"         head pod needs {h.head_vcpus} vCPUs ({HEAD_BASE_VCPUS} for Ray's own + busy at "
        f"{TARGET_UTILIZATION:.0%}); {h.system_instance} gives it {pod}; ingress replicas needed "
        f"{h.ingress_replicas} (maxReplicas {h.ingress_max_replicas}): {ok}",
        f"         CPU figure: {h.figure.kind}; {h.figure.measured}, {h.figure.machine} (docs/capacity.md)",
    ]
