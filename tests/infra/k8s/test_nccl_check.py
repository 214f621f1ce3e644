"""The two-node NCCL check: its manifests (strict Kubernetes schemas) and its script, run on CPU.

Upstream rules encoded: nccl-tests' bus bandwidth for all-reduce is algbw x 2(n-1)/n
(NVIDIA/nccl-tests doc/PERFORMANCE.md); NCCL prints "Using network <name>" at init and the
aws-ofi-nccl plugin's network is named "Libfabric" ("AWS Libfabric" in older releases); an
Indexed Job's pods get JOB_COMPLETION_INDEX and, with `subdomain`, DNS names
<job>-<index>.<subdomain> (Kubernetes Job docs, completionMode Indexed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import kubernetes_validate
import pytest

from infra import versions
from infra.catalog import lookup
from infra.k8s import nccl_check
from infra.k8s.labels import ROLE_LABEL

SCRIPT = nccl_check.SCRIPT


def _objects(**kw):
    args = {"name": "nccl-check", "namespace": "llm", "image": "example.com/ray-llm-efa:2.60.0", "role": "prefill"}
    instance = lookup(kw.pop("instance", "p5.48xlarge"))
    args.update(kw)
    return nccl_check.nccl_check_manifests(instance=instance, **args)


def test_manifests_validate_strictly():
    for obj in _objects():
        kubernetes_validate.validate(obj, versions.DEFAULT_KUBERNETES_VERSION, strict=True)


def test_two_pods_on_two_nodes_of_one_pool_with_every_gpu_and_efa_interface():
    _, svc, job = _objects(instance="p5.48xlarge")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"][ROLE_LABEL] == "prefill"
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    limits = pod["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == ("8", "32")
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    cmd = pod["containers"][0]["command"][2]
    assert "--nnodes=2 --nproc-per-node=8 --node-rank=$JOB_COMPLETION_INDEX" in cmd
    assert "--master-addr=nccl-check-0.nccl-check.llm.svc" in cmd
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["NCCL_NET_PLUGIN"] == "ofi" and env["NCCL_DEBUG_FILE"].startswith("/tmp/")


def test_p5en_has_16_efa_interfaces():
    pod = _objects(instance="p5en.48xlarge")[2]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == "16"


def test_a_pool_without_efa_is_refused():
    with pytest.raises(ValueError, match=r"g5\.12xlarge has no EFA interfaces"):
        _objects(instance="g5.12xlarge")


def test_bus_bandwidth_by_hand():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import nccl_allreduce
    finally:
        sys.path.pop(0)
    # 1 GiB in 10 ms over 16 ranks: algbw 107.37 GB/s, busbw x 2 x 15 / 16
    alg, bus = nccl_allreduce.bus_bandwidth(2**30, 0.01, 16)
    assert alg == pytest.approx(2**30 / 0.01 / 1e9)
    assert bus == pytest.approx(alg * 30 / 16)


def test_net_check_reads_nccls_own_log(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import nccl_allreduce
    finally:
        sys.path.pop(0)
    (tmp_path / "nccl.a.1.log").write_text("x NCCL INFO NET/Plugin: Loaded\nx NCCL INFO Using network Socket\n")
    assert nccl_allreduce._net_used(str(tmp_path / "nccl.*.log")) == "Socket"
    (tmp_path / "nccl.a.1.log").write_text("x NCCL INFO Using network Libfabric\n")
    assert nccl_allreduce._net_used(str(tmp_path / "nccl.*.log")) == "Libfabric"


def test_script_runs_an_all_reduce_across_two_processes_on_cpu(tmp_path):
    """The same script, torchrun'd with 2 CPU processes (gloo): it sums correctly and reports."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(SCRIPT),
        "--backend=gloo",
        "--sizes-mib=1,4",
        "--iters=3",
    ]
    # its own process group: on a timeout the workers go too, not only torchrun
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "busbw_GB/s" in r.stdout and "(world 2)" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().endswith(tuple("0123456789"))]
    assert [row[0] for row in rows[-2:]] == ["1Mi", "4Mi"]
