"""The EFA fabric check's objects and scripts (infra/k8s/efa_check.py), offline.

Upstream rules encoded here:
- The EFA device plugin hands a pod EFA interfaces only as `vpc.amazonaws.com/efa` (aws/eks-charts
  aws-efa-k8s-device-plugin); a pod that wants the node's whole fabric asks for all of them.
- `fi_info -p efa -t FI_EP_RDM` lists one RDM domain per EFA device; `fi_pingpong` (libfabric
  util/pingpong.c) takes -p provider, -e rdm, -d domain, -S size (at most 6 MiB,
  PP_MAX_DATA_MSG), -I iterations, -B/-P control ports (default 47592), and prints
  `bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec` rows.
The scripts are executed here with stand-ins for fi_info, fi_pingpong and getent that print
what the real tools print, so their shell and their parsing are tested, not only their text.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest

from infra import catalog
from infra.k8s import efa_check
from infra.k8s.labels import INSTANCE_TYPE_LABEL, ROLE_LABEL

P5, P4DE, G5 = (catalog.lookup(n) for n in ("p5.48xlarge", "p4de.24xlarge", "g5.xlarge"))


def _inp(prefill=P5, decode=P5, **kw) -> efa_check.EfaCheckInputs:
    return efa_check.EfaCheckInputs(
        namespace="llm",
        image="rayproject/ray-llm:2.60.0-py312-cu130",
        instances={"prefill": prefill, "decode": decode},
        **kw,
    )


@pytest.mark.parametrize(("prefill", "decode"), [(P5, P5), (P4DE, P4DE), (P5, P4DE)])
def test_objects_validate_strictly(prefill, decode) -> None:
    for obj in efa_check.manifests(_inp(prefill, decode)).values():
        kubernetes_validate.validate(obj, "1.35", strict=True)


def test_refuses_pools_without_efa_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no EFA"):
        _inp(P5, G5)
    with pytest.raises(ValueError, match="6 MiB"):
        _inp(message_bytes=8 << 20)
    with pytest.raises(ValueError, match="min_fraction"):
        _inp(min_fraction=0)


def test_one_pod_per_role_with_all_its_nodes_efa_devices_and_no_gpu() -> None:
    objs = efa_check.manifests(_inp(P5, P4DE))
    jobs = {o["metadata"]["name"]: o for o in objs.values() if o["kind"] == "Job"}
    for job, role, inst in (("efa-check-server", "prefill", P5), ("efa-check-client", "decode", P4DE)):
        pod = jobs[job]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {ROLE_LABEL: role, INSTANCE_TYPE_LABEL: inst.name}
        (c,) = pod["containers"]
        limits = c["resources"]["limits"]
        assert limits[efa_check.EFA_RESOURCE] == str(inst.efa_interfaces)
        assert "nvidia.com/gpu" not in limits and c["resources"]["requests"] == limits
        assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["capabilities"] == {
            "drop": ["ALL"]
        }
        assert jobs[job]["spec"]["backoffLimit"] == 0
    svc = next(o for o in objs.values() if o["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in svc["spec"]["ports"]] == [efa_check.BASE_PORT + i for i in range(4)]
    assert svc["spec"]["selector"] == jobs["efa-check-server"]["spec"]["template"]["metadata"]["labels"]


def test_line_rate_is_the_slower_side() -> None:
    assert efa_check.line_rate_gbps(_inp(P5, P4DE)) == 400
    assert efa_check.devices_expected(_inp(P5, P4DE)) == 4
    assert efa_check.line_rate_gbps(_inp(P5, P5)) == 3200


ROW = "{size:<8}{n:<8}={n:<8}{total:<8}{t:8.2f}s{mbps:10.2f}{usec:11.2f}{mx:11.2f}"


def _stub(dir_: Path, name: str, body: str) -> None:
    f = dir_ / name
    f.write_text("#!/bin/bash\n" + body)
    f.chmod(f.stat().st_mode | stat.S_IEXEC)


# What fi_pingpong prints when fi_mr_reg fails (libfabric util/pingpong.c PP_PRINTERR, -FI_ENOMEM).
MR_FAILURE = "fi_mr_reg(): util/pingpong.c:1388, ret=-12 (Cannot allocate memory)"


def _run(
    script: str,
    tmp: Path,
    devices: int,
    mbps: float,
    *,
    memlock: str = "unlimited",
    uverbs: int | None = None,
    uverbs_mode: int = 0o666,
    pingpong_fails: bool = False,
) -> subprocess.CompletedProcess:
    """Run a check script with stand-ins: `memlock` is what `ulimit -l` says (a function shadows
    the builtin), `uverbs` device files (default: one per device) sit in a scratch /dev/infiniband."""
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    dev = tmp / "dev-infiniband"
    dev.mkdir(exist_ok=True)
    for i in range(devices if uverbs is None else uverbs):
        f = dev / f"uverbs{i}"
        f.touch()
        f.chmod(uverbs_mode)
    domains = "".join(f"    domain: rdmap{i}s0-rdm\\n" for i in range(devices))
    _stub(bin_, "fi_info", f'[ "$1" = --version ] && {{ echo "fi_info: 2.4.0amzn5.0"; exit 0; }}\nprintf "{domains}"\n')
    row = ROW.format(size="4m", n=200, total="1.5g", t=0.07, mbps=mbps, usec=350.0, mx=0.0)
    header = "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec"
    if pingpong_fails:
        _stub(bin_, "fi_pingpong", f'echo "{MR_FAILURE}"\nexit 1\n')
    else:
        _stub(bin_, "fi_pingpong", f'echo "{header}"\necho "{row}"\n')
    _stub(bin_, "getent", 'echo "10.0.0.7 $2"\n')
    _stub(bin_, "sleep", "exit 0\n")
    env = {
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "NODE_NAME": "node-1",
        "TMPDIR": str(tmp),
        "EFA_CHECK_DEV_DIR": str(dev),
        "MEMLOCK": memlock,
    }
    prelude = 'ulimit() { echo "$MEMLOCK"; }\n'
    return subprocess.run(["bash", "-c", prelude + script], capture_output=True, text=True, env=env, timeout=60)


def test_scripts_run_and_the_client_log_parses_into_a_pass(tmp_path: Path) -> None:
    inp = _inp(P4DE, P4DE)
    server = _run(efa_check.server_script(inp), tmp_path, devices=4, mbps=12000)
    assert server.returncode == 0, server.stderr
    client = _run(efa_check.client_script(inp), tmp_path, devices=4, mbps=12000)
    assert client.returncode == 0, client.stderr
    report = efa_check.parse_report(client.stdout, inp)
    assert len(report.devices) == 4 and report.ok, report.text()
    assert report.total_gbps == pytest.approx(4 * 12000 * 8 / 1000)  # 384 of 400 Gbps
    assert "PASS" in report.text()


def test_tcp_speeds_fail(tmp_path: Path) -> None:
    inp = _inp(P4DE, P4DE)
    client = _run(efa_check.client_script(inp), tmp_path, devices=4, mbps=300)
    report = efa_check.parse_report(client.stdout, inp)
    assert not report.ok and "FAIL" in report.text()


def test_missing_devices_fail(tmp_path: Path) -> None:
    inp = _inp(P4DE, P4DE)
    client = _run(efa_check.client_script(inp), tmp_path, devices=2, mbps=12000, uverbs=4)
    assert client.returncode != 0
    report = efa_check.parse_report(client.stdout, inp)
    assert not report.ok and any("4 EFA devices expected" in f for f in report.failures)


def test_an_empty_log_fails() -> None:
    report = efa_check.parse_report("", _inp())
    assert not report.ok and report.failures


# --- issue 24 item 6: what memory registration needs, checked in the pods ---------------------
def test_a_finite_memlock_fails_loudly(tmp_path: Path) -> None:
    """ib_umem_get (linux drivers/infiniband/core/umem.c) refuses to pin past RLIMIT_MEMLOCK
    without CAP_IPC_LOCK, which the pods drop: a finite limit is a failed check, not a slow one."""
    inp = _inp(P4DE, P4DE)
    for script in (efa_check.server_script(inp), efa_check.client_script(inp)):
        out = _run(script, tmp_path, devices=4, mbps=12000, memlock="8192")
        assert out.returncode != 0
        assert "memlock is 8192 KiB, not unlimited" in out.stdout
    report = efa_check.parse_report(out.stdout, inp)
    assert not report.ok and any("memlock" in f for f in report.failures)


def test_missing_or_unwritable_device_files_fail(tmp_path: Path) -> None:
    inp = _inp(P4DE, P4DE)
    (tmp_path / "few").mkdir()
    few = _run(efa_check.client_script(inp), tmp_path / "few", devices=4, mbps=12000, uverbs=2)
    assert few.returncode != 0 and "2 uverbs device files" in few.stdout
    (tmp_path / "ro").mkdir()
    ro = _run(efa_check.client_script(inp), tmp_path / "ro", devices=4, mbps=12000, uverbs_mode=0o444)
    if os.geteuid() != 0:  # root writes anything; the pods run as uid 1000
        assert ro.returncode != 0 and "is not read-write for uid" in ro.stdout


def test_a_registration_error_fails_both_sides_by_name(tmp_path: Path) -> None:
    inp = _inp(P4DE, P4DE)
    for script in (efa_check.server_script(inp), efa_check.client_script(inp)):
        out = _run(script, tmp_path, devices=4, mbps=12000, pingpong_fails=True)
        assert out.returncode != 0
        report = efa_check.parse_report(out.stdout, inp)
        assert not report.ok
        assert any("memory registration on rdmap0s0-rdm: fi_mr_reg()" in f for f in report.failures), report.failures


def test_the_check_pods_run_with_the_engines_libfabric_settings() -> None:
    """The check proves the engines' set-up, so it uses their libfabric environment
    (infra.k8s.ray_env.efa_engine_env) and their security context."""
    from infra.k8s.ray_env import efa_engine_env

    for obj in efa_check.manifests(_inp()).values():
        if obj["kind"] != "Job":
            continue
        c = obj["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert efa_engine_env([P5, P5]).items() <= env.items()
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert not c["securityContext"].get("privileged")


# --- issue 26: one check per pool pair, named after its pools -------------------------------
# A Job's name is its pods' `job-name` label value and a Service's name a DNS-1035 label:
# at most 63 characters, lowercase alphanumerics and '-', a letter first, alphanumeric last
# (Kubernetes "Object Names and IDs", "Labels and Selectors").
DNS_1035 = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
LONGEST = "a" + "b" * 22 + "c"  # a pool name has 2-24 characters (serving/spec/models.py POOL_NAME)


def test_pools_prefill_and_decode_keep_the_name_efa_check_other_pairs_are_named_after_theirs() -> None:
    assert efa_check.check_names([("prefill", "decode"), ("h100-a", "h100-b")]) == {
        ("prefill", "decode"): "efa-check",
        ("h100-a", "h100-b"): "efa-check-h100-a-h100-b",
    }


def test_check_names_are_distinct_kubernetes_names_for_any_pool_names() -> None:
    pairs = [
        ("prefill", "decode"),
        (LONGEST, LONGEST[::-1]),
        (LONGEST, "decode"),
        ("a-b", "c1"),  # efa-check-a-b-c1 ...
        ("a", "b-c1"),  # ... twice, but for the pools' SHA-256
        ("decode", "prefill"),
    ]
    names = efa_check.check_names(pairs)
    assert len(set(names.values())) == len(pairs)
    assert names[("a-b", "c1")] != names[("a", "b-c1")]
    for pair, name in names.items():
        for obj in efa_check.manifests(_inp(pools={"prefill": pair[0], "decode": pair[1]}, name=name)).values():
            assert re.match(DNS_1035, obj["metadata"]["name"]), obj["metadata"]["name"]
            for value in obj["metadata"]["labels"].values():
                assert len(value) <= 63


def test_a_pairs_pods_run_on_its_pools_and_its_service_selects_its_own_server() -> None:
    default = efa_check.manifests(_inp())
    other = efa_check.manifests(_inp(P5, P4DE, pools={"prefill": "h100-a", "decode": "a100"}, name="efa-check-x"))
    jobs = {o["metadata"]["name"]: o["spec"]["template"] for o in other.values() if o["kind"] == "Job"}
    assert jobs["efa-check-x-server"]["spec"]["nodeSelector"] == {ROLE_LABEL: "h100-a", INSTANCE_TYPE_LABEL: P5.name}
    assert jobs["efa-check-x-client"]["spec"]["nodeSelector"] == {ROLE_LABEL: "a100", INSTANCE_TYPE_LABEL: P4DE.name}
    service = other["service-efa-check-x-server.yaml"]
    default_server = default["job-efa-check-server.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == jobs["efa-check-x-server"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= default_server.items()
    assert "efa-check-x-server.llm.svc.cluster.local" in efa_check.client_script(
        _inp(pools={"prefill": "h100-a", "decode": "a100"}, name="efa-check-x")
    )


def test_refuses_one_pool_on_both_sides_and_a_name_kubernetes_would_refuse() -> None:
    with pytest.raises(ValueError, match="share the pool"):
        _inp(pools={"prefill": "h100-a", "decode": "h100-a"})
    with pytest.raises(ValueError, match="not a check name"):
        _inp(name="efa-check-" + "x" * 50)
    with pytest.raises(ValueError, match="not a check name"):
        _inp(name="EFA_check")
