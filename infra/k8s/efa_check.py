"""The EFA fabric check, as plain data: one pod on a prefill node, one on a decode node.

What flows through here: a P/D model's two pools (their names and catalog entries), the
namespace, the worker image and the role label/taint -> a headless Service and two Jobs
(`<name>-server` on a node of the prefill pool, `<name>-client` on a node of the decode pool;
`check_names` gives each pool pair of a stack its own name, `efa-check` for the pools named
prefill and decode). Each pod asks for all of its node's EFA
interfaces (and no GPUs) and runs as the engines do (uid 1000, every capability dropped, the
engines' libfabric environment from `infra.k8s.ray_env.efa_engine_env`). Each checks what
memory registration needs in such a pod (docs/efa.md, "Memory registration in the pods"):
an unlimited RLIMIT_MEMLOCK, one readable and writable `/dev/infiniband/uverbs*` file per
interface; then `fi_info -p efa` must see every interface, and one `fi_pingpong` (libfabric's
own test, which registers its buffers with `fi_mr_reg` under FI_MR_LOCAL) runs per EFA device
pair in parallel. A registration error in any pingpong fails the check by name. The client
prints one `EFA_CHECK` line per device and a total; `parse_report` turns both pods' logs into
bandwidth against the catalog's line rate. `tools.efa_check` renders, applies and reads it.

No Pulumi here: the deploy workflow runs it with kubectl after `pulumi up`; the tests validate
the objects against the Kubernetes OpenAPI schema.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infra import catalog
from infra.k8s.labels import EFA_RESOURCE, GPU_TOLERATION, INSTANCE_TYPE_LABEL, ROLE_LABEL
from infra.k8s.ray_env import efa_engine_env

NAME = "efa-check"
# fi_pingpong's control (out-of-band TCP) port; one per EFA device pair, counting up.
BASE_PORT = 47592
# 4 MiB: large enough that one ping-pong is bandwidth-bound, under fi_pingpong's 6 MiB cap
# (PP_MAX_DATA_MSG in libfabric util/pingpong.c).
MESSAGE_BYTES = 4 << 20
ITERATIONS = 200
RAY_UID = 1000  # the worker image's user (same security context as the Ray workers)
# The longest name of one pair's objects: its Jobs and Service add "-server" / "-client", and a
# Job's name is also its pods' `job-name` label value, at most 63 characters (Kubernetes,
# "Labels and Selectors": a label value is at most 63 characters).
MAX_NAME = 63 - len("-server")
DEFAULT_POOLS = ("prefill", "decode")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_names(pairs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """(prefill pool, decode pool) -> the name of that pair's objects, distinct within a stack.

    The pools named prefill and decode keep `efa-check` (what a one-model stack has always
    rendered); any other pair is `efa-check-<prefill pool>-<decode pool>`. Where that is longer
    than MAX_NAME (pool names have up to 24 characters) or two pairs would share it (pool names
    hold '-': `a-b` with `c`, `a` with `b-c`), it is cut short and ends in 8 hex digits of the
    pair's SHA-256 instead.
    """
    readable = {p: NAME if tuple(p) == DEFAULT_POOLS else f"{NAME}-{p[0]}-{p[1]}" for p in pairs}
    shared = Counter(readable.values())
    names = {}
    for pair, name in readable.items():
        if len(name) > MAX_NAME or shared[name] > 1:
            digest = hashlib.sha256(f"{pair[0]}/{pair[1]}".encode()).hexdigest()[:8]
            name = f"{name[: MAX_NAME - 9].rstrip('-')}-{digest}"
        names[pair] = name
    if len(set(names.values())) < len(names):
        raise ValueError(f"two EFA pool pairs would share one check name: {sorted(names.items())}")
    return names


@dataclass(frozen=True)
class EfaCheckInputs:
    """What the check of one pool pair needs from a stack.

    namespace: where the Jobs run (the LLM namespace: its NetworkPolicy admits pod-to-pod traffic).
    image: the worker image (it carries fi_info and fi_pingpong from the EFA installer).
    instances: the catalog entries of the two sides, by role: `prefill` (the server's pool) and
        `decode` (the client's).
    pools: the node pool of each side, by role (its nodes' role label value); by default the
        pools named prefill and decode.
    name: what the Service and Jobs are called (`<name>-server`, `<name>-client`) and their
        `app.kubernetes.io/name` label, distinct per pool pair (`check_names`).
    min_fraction: the share of the catalog's line rate below which the check fails.
    """

    namespace: str
    image: str
    instances: dict[str, catalog.InstanceType]
    min_fraction: float = 0.5
    message_bytes: int = MESSAGE_BYTES
    iterations: int = ITERATIONS
    timeout_s: int = 900
    pools: dict[str, str] = field(default_factory=lambda: {"prefill": "prefill", "decode": "decode"})
    name: str = NAME

    def __post_init__(self) -> None:
        if set(self.instances) != {"prefill", "decode"} or set(self.pools) != {"prefill", "decode"}:
            raise ValueError("the EFA check needs a prefill and a decode pool")
        if self.pools["prefill"] == self.pools["decode"]:
            raise ValueError(f"prefill and decode share the pool {self.pools['decode']}: nothing between pools")
        for role, inst in self.instances.items():
            if not inst.efa:
                raise ValueError(
                    f"{role} pool {self.pools[role]} ({inst.name}) has no EFA: there is no fabric to check"
                )
        if len(self.name) > MAX_NAME or not _DNS_LABEL.match(self.name):
            raise ValueError(f"{self.name!r} is not a check name (a DNS label of at most {MAX_NAME} characters)")
        if not 0 < self.min_fraction <= 1:
            raise ValueError("min_fraction must be in (0, 1]")
        if not 0 < self.message_bytes <= 6 << 20:
            raise ValueError("message_bytes must be in (0, 6 MiB] (fi_pingpong's largest message)")


def devices_expected(inp: EfaCheckInputs) -> int:
    """Device pairs: one per interface of the smaller side."""
    return min(i.efa_interfaces for i in inp.instances.values())


def server_host(inp: EfaCheckInputs) -> str:
    return f"{inp.name}-server.{inp.namespace}.svc.cluster.local"


# What libfabric prints when registration fails (util/pingpong.c PP_PRINTERR("fi_mr_reg", ret);
# the EFA provider's ibv_reg_mr/efa_mr_reg warnings; -FI_ENOMEM/-FI_EPERM as strerror text).
REGISTRATION_ERRORS = r"fi_mr_reg|ibv_reg_mr|efa_mr_reg|Cannot allocate memory|Operation not permitted"
DEVICE_DIR = "/dev/infiniband"


def _common_script(role: str, inst: catalog.InstanceType) -> list[str]:
    return [
        "set -euo pipefail",
        f'echo "EFA_CHECK role={role} node=${{NODE_NAME}} instance={inst.name} memlock=$(ulimit -l) uid=$(id -u)"',
        # Pinning host memory needs RLIMIT_MEMLOCK above what is pinned, or CAP_IPC_LOCK, which
        # the pods drop (linux drivers/infiniband/core/umem.c ib_umem_get): unlimited is what
        # the node's containerd drop-in gives every container (infra/components/gpu_node_pool.py).
        f'[ "$(ulimit -l)" = unlimited ] || {{ echo "EFA_CHECK FAIL {role}: memlock is $(ulimit -l) KiB, '
        'not unlimited: memory registration will fail (containerd LimitMEMLOCK drop-in missing?)"; exit 1; }',
        # The device plugin hands the pod one uverbs file per interface; uid 1000 must open them.
        f'DEV_DIR="${{EFA_CHECK_DEV_DIR:-{DEVICE_DIR}}}"',
        'UVERBS=( "$DEV_DIR"/uverbs* )',
        '[ -e "${UVERBS[0]}" ] || UVERBS=()',
        f'echo "EFA_CHECK role={role} uverbs=${{#UVERBS[@]}} expected={inst.efa_interfaces}"',
        f'[ "${{#UVERBS[@]}}" -ge {inst.efa_interfaces} ] || {{ echo "EFA_CHECK FAIL {role}: '
        f'${{#UVERBS[@]}} uverbs device files in $DEV_DIR, {inst.efa_interfaces} expected"; exit 1; }}',
        'for d in "${UVERBS[@]}"; do [ -r "$d" ] && [ -w "$d" ] || { echo "EFA_CHECK FAIL '
        f'{role}: $d is not read-write for uid $(id -u) ($(stat -c %A "$d"))"; exit 1; }}; done',
        "fi_info --version",
        # Every EFA device the pod was given, as libfabric's RDM domains.
        "fi_info -p efa -t FI_EP_RDM > /tmp/fi_info.txt || { cat /tmp/fi_info.txt; echo 'EFA_CHECK FAIL fi_info -p efa found no EFA provider'; exit 1; }",
        "mapfile -t DOMAINS < <(awk '/domain:/ {print $2}' /tmp/fi_info.txt | sort -u)",
        f'echo "EFA_CHECK role={role} devices=${{#DOMAINS[@]}} expected={inst.efa_interfaces}"',
        f'[ "${{#DOMAINS[@]}}" -ge {inst.efa_interfaces} ] || {{ echo "EFA_CHECK FAIL {role}: {inst.efa_interfaces} EFA devices expected"; exit 1; }}',
        "PIDS=()",
    ]


def server_script(inp: EfaCheckInputs) -> str:
    inst = inp.instances["prefill"]
    n = devices_expected(inp)
    lines = [
        *_common_script("prefill", inst),
        f"for i in $(seq 0 {n - 1}); do",
        f'  fi_pingpong -p efa -e rdm -d "${{DOMAINS[$i]}}" -S {inp.message_bytes} -I {inp.iterations} '
        f"-B $(({BASE_PORT} + i)) > /tmp/pp.$i 2>&1 &",
        "  PIDS+=($!)",
        "done",
        'rc=0; for pid in "${PIDS[@]}"; do wait "$pid" || rc=1; done',
        *_registration_lines("prefill", n),
        'echo "EFA_CHECK role=prefill done rc=$rc"',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def _registration_lines(role: str, n: int) -> list[str]:
    """Fail by name when a pingpong could not register memory (its log says so)."""
    return [
        f"for i in $(seq 0 {n - 1}); do",
        f"  if err=$(grep -m1 -E '{REGISTRATION_ERRORS}' /tmp/pp.$i); then",
        f'    echo "EFA_CHECK FAIL {role}: memory registration on ${{DOMAINS[$i]}}: $err"; rc=1',
        "  fi",
        "done",
    ]


def client_script(inp: EfaCheckInputs) -> str:
    inst = inp.instances["decode"]
    n = devices_expected(inp)
    host = server_host(inp)
    lines = [
        *_common_script("decode", inst),
        # The server's pod may still be starting: wait until its name resolves.
        f"for t in $(seq 1 120); do getent hosts {host} >/dev/null && break; sleep 5; done",
        f"SERVER=$(getent hosts {host} | awk '{{print $1}}')",
        "sleep 10",
        f"for i in $(seq 0 {n - 1}); do",
        f'  fi_pingpong -p efa -e rdm -d "${{DOMAINS[$i]}}" -S {inp.message_bytes} -I {inp.iterations} '
        f'-P $(({BASE_PORT} + i)) "$SERVER" > /tmp/pp.$i 2>&1 &',
        "  PIDS+=($!)",
        "done",
        'rc=0; for pid in "${PIDS[@]}"; do wait "$pid" || rc=1; done',
        f"for i in $(seq 0 {n - 1}); do",
        "  mbps=$(awk '$1 ~ /^[0-9.]+[kmg]?$/ && NF >= 8 {print $6}' /tmp/pp.$i | tail -1)",
        '  echo "EFA_CHECK device=${DOMAINS[$i]} MBps=${mbps:-none}"',
        '  [ -n "$mbps" ] || { cat /tmp/pp.$i; rc=1; }',
        "done",
        *_registration_lines("decode", n),
        'echo "EFA_CHECK role=decode done rc=$rc"',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def _labels(inp: EfaCheckInputs, component: str) -> dict[str, str]:
    # The name differs per pool pair, so each pair's Service selects its own server only.
    return {"app.kubernetes.io/name": inp.name, "app.kubernetes.io/component": component}


def _pod(inp: EfaCheckInputs, role: str, component: str, script: str) -> dict[str, Any]:
    inst = inp.instances[role]
    resources = {"cpu": "2", "memory": "4Gi", EFA_RESOURCE: str(inst.efa_interfaces)}
    return {
        "metadata": {"labels": _labels(inp, component)},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            # A node of this side's pool only (the role label holds the pool's name); the two
            # sides are different pools.
            "nodeSelector": {ROLE_LABEL: inp.pools[role], INSTANCE_TYPE_LABEL: inst.name},
            "tolerations": [GPU_TOLERATION],
            # The Ray workers' security context: the check proves the fabric works for them.
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RAY_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": component,
                    "image": inp.image,
                    "command": ["/bin/bash", "-c", script],
                    "env": [
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        # The engines' libfabric settings, so the check proves their set-up: with
                        # FI_EFA_FORK_SAFE=1 the EFA provider uses no huge pages (libfabric
                        # prov/efa/src/efa_fork_support.c), so no hugepages-2Mi is requested.
                        *({"name": k, "value": v} for k, v in efa_engine_env(list(inp.instances.values())).items()),
                    ],
                    "resources": {"requests": dict(resources), "limits": dict(resources)},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True,
                        "runAsUser": RAY_UID,
                    },
                }
            ],
        },
    }


def _job(inp: EfaCheckInputs, role: str, component: str, script: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{inp.name}-{component}", "namespace": inp.namespace, "labels": _labels(inp, component)},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": inp.timeout_s,
            "ttlSecondsAfterFinished": 3600,
            "template": _pod(inp, role, component, script),
        },
    }


def manifests(inp: EfaCheckInputs) -> dict[str, dict[str, Any]]:
    """File name -> object: the server's Service, the server Job (prefill), the client Job (decode)."""
    n = devices_expected(inp)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{inp.name}-server", "namespace": inp.namespace, "labels": _labels(inp, "server")},
        "spec": {
            # Headless: the name resolves to the server pod's IP, as fi_pingpong's control
            # connection needs (the EFA traffic itself never crosses the Service).
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(inp, "server"),
            "ports": [
                {"name": f"ctrl-{i}", "port": BASE_PORT + i, "targetPort": BASE_PORT + i, "protocol": "TCP"}
                for i in range(n)
            ],
        },
    }
    return {
        f"service-{inp.name}-server.yaml": service,
        f"job-{inp.name}-server.yaml": _job(inp, "prefill", "server", server_script(inp)),
        f"job-{inp.name}-client.yaml": _job(inp, "decode", "client", client_script(inp)),
    }


# --- the client's log -> the report ------------------------------------------------------------
_DEVICE = re.compile(r"^EFA_CHECK device=(\S+) MBps=(\S+)$")
_COUNT = re.compile(r"^EFA_CHECK role=(\w+) devices=(\d+) expected=(\d+)$")


@dataclass(frozen=True)
class Report:
    devices: dict[str, float | None]  # device -> MB/s (10^6 bytes/s), None when the pair failed
    line_rate_gbps: float  # the slower pool's catalog line rate
    expected_devices: int
    min_fraction: float
    failures: list[str]

    @property
    def total_gbps(self) -> float:
        return sum(v for v in self.devices.values() if v) * 8 / 1000

    @property
    def fraction(self) -> float:
        return self.total_gbps / self.line_rate_gbps if self.line_rate_gbps else 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.failures
            and len(self.devices) >= self.expected_devices
            and all(self.devices.values())
            and self.fraction >= self.min_fraction
        )

    def text(self) -> str:
        lines = [f"  {d}: {v:,.0f} MB/s" if v else f"  {d}: FAILED" for d, v in sorted(self.devices.items())]
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(
            f"EFA check {verdict}: {len(self.devices)}/{self.expected_devices} device pairs, "
            f"{self.total_gbps:,.1f} Gbps in total = {self.fraction:.0%} of the catalog's "
            f"{self.line_rate_gbps:,.0f} Gbps line rate (pass at >= {self.min_fraction:.0%})"
        )
        lines += [f"  problem: {f}" for f in self.failures]
        return "\n".join(lines)


def line_rate_gbps(inp: EfaCheckInputs) -> float:
    """What the catalog promises between the two pools: the slower side's line rate."""
    return float(min(i.network_gbps for i in inp.instances.values()))


def parse_report(log: str, inp: EfaCheckInputs) -> Report:
    """The client's log -> per-device bandwidth against the catalog's line rate."""
    devices: dict[str, float | None] = {}
    failures = []
    for line in log.splitlines():
        line = line.strip()
        if m := _DEVICE.match(line):
            try:
                devices[m.group(1)] = float(m.group(2))
            except ValueError:
                devices[m.group(1)] = None
        elif m := _COUNT.match(line):
            if int(m.group(2)) < int(m.group(3)):
                failures.append(f"{m.group(1)} saw {m.group(2)} EFA devices, expected {m.group(3)}")
        elif line.startswith("EFA_CHECK FAIL"):
            failures.append(line.removeprefix("EFA_CHECK FAIL").strip())
    if not devices and not failures:
        failures.append("no fi_pingpong results in the client's log")
    return Report(devices, line_rate_gbps(inp), devices_expected(inp), inp.min_fraction, failures)
