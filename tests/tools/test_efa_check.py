"""`make efa-check` offline: `python -m tools.efa_check --dry-run` renders and validates the Job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from infra import paths
from tools import efa_check, render, stackfile


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.efa_check", *args], cwd=paths.ROOT, capture_output=True, text=True, timeout=600
    )


def test_dry_run_writes_validated_objects_for_an_efa_stack(tmp_path: Path) -> None:
    out = _run("--stack", "prod", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "validated against Kubernetes" in out.stdout and "32 device pairs" in out.stdout
    kinds = sorted(yaml.safe_load(f.read_text())["kind"] for f in tmp_path.glob("*.yaml"))
    assert kinds == ["Job", "Job", "Service"]


def test_image_argument_reaches_the_pods(tmp_path: Path) -> None:
    ref = "123456789012.dkr.ecr.us-east-1.amazonaws.com/pd-inference-prod/ray-llm-efa:2.60.0-efa-0123456789abcdef"
    assert _run("--stack", "prod", "--dry-run", "--out", str(tmp_path), "--image", ref).returncode == 0
    for f in tmp_path.glob("job-*.yaml"):
        assert yaml.safe_load(f.read_text())["spec"]["template"]["spec"]["containers"][0]["image"] == ref


def test_default_image_is_the_stacks_worker_image() -> None:
    cfg = stackfile.load_config("prod")
    image = efa_check.offline_image(cfg, "prod")
    built = render.render("prod", stand_in_secrets=True).result.of_type("docker-build:index:Image")[0].inputs["tags"][0]
    assert image.rsplit(":", 1)[1] == built.rsplit(":", 1)[1]


def test_a_stack_without_efa_has_nothing_to_check() -> None:
    out = _run("--stack", "dev", "--dry-run")
    assert out.returncode == 0 and "nothing to check" in out.stdout


def test_a_bad_stack_is_one_line() -> None:
    out = _run("--stack", "no-such-stack", "--dry-run")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1


def test_make_render_writes_the_check_for_efa_stacks_only(tmp_path: Path) -> None:
    for stack, expect in (("staging", True), ("dev", False)):
        render.write(render.render(stack, stand_in_secrets=True), tmp_path / stack)
        assert (tmp_path / stack / "efa-check").is_dir() is expect


# --- issue 24 item 8: the NCCL check rides along for stacks whose replicas span nodes ---------
def test_multi_node_stacks_get_the_nccl_check_of_each_spanning_role(tmp_path: Path) -> None:
    out = _run("--stack", "deepseek-p5", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    jobs = {yaml.safe_load(f.read_text())["metadata"]["name"] for f in tmp_path.glob("job-*.yaml")}
    # stacks/Pulumi.deepseek-p5.yaml: prefill TP 8 x PP 2 and decode DP 16 x TP 1 on 8-GPU nodes.
    assert jobs == {"efa-check-server", "efa-check-client", "nccl-check-prefill", "nccl-check-decode"}
    assert "NCCL check across two nodes" in out.stdout


def test_single_node_replicas_get_no_nccl_check(tmp_path: Path) -> None:
    out = _run("--stack", "prod", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.glob("*nccl*"))


def _fake_kubectl(bin_: Path, *, client_log: str, server_log: str, nccl_ok: bool) -> None:
    """kubectl stand-in: apply/delete succeed; `wait` for an NCCL Job fails unless nccl_ok."""
    bin_.mkdir()
    script = bin_ / "kubectl"
    script.write_text(
        "#!/bin/bash\n"
        'args="$*"\n'
        'case "$args" in\n'
        f'  *"wait"*"job/nccl-check-"*) {"exit 0" if nccl_ok else "echo timed out >&2; exit 1"} ;;\n'
        '  *"wait"*) exit 0 ;;\n'
        f'  *"logs job/efa-check-client"*) printf "%s\\n" "{client_log}" ;;\n'
        f'  *"logs job/efa-check-server"*) printf "%s\\n" "{server_log}" ;;\n'
        '  *"logs -l job-name=nccl-check-"*) echo "[pod/nccl-check-prefill-0] FAIL: NCCL used network Socket" ;;\n'
        "  *) exit 0 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)


def _cluster_run(tmp_path: Path, stack: str, **kw) -> subprocess.CompletedProcess:
    bin_ = tmp_path / "bin"
    _fake_kubectl(bin_, **kw)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    return subprocess.run(
        [sys.executable, "-m", "tools.efa_check", "--stack", stack, "--out", str(tmp_path / "out")],
        cwd=paths.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


GOOD_CLIENT = "\n".join(
    ["EFA_CHECK role=decode devices=32 expected=32"]
    + [f"EFA_CHECK device=rdmap{i}s0-rdm MBps=12000" for i in range(32)]
)


def test_a_failed_nccl_job_fails_the_check_loudly(tmp_path: Path) -> None:
    out = _cluster_run(tmp_path, "deepseek-p5", client_log=GOOD_CLIENT, server_log="", nccl_ok=False)
    assert out.returncode == 1
    assert "NCCL check nccl-check-prefill failed" in out.stdout and "used network Socket" in out.stdout


def test_a_registration_failure_on_the_server_fails_the_check(tmp_path: Path) -> None:
    server = "EFA_CHECK FAIL prefill: memory registration on rdmap3s0-rdm: fi_mr_reg(): ret=-12"
    out = _cluster_run(tmp_path, "prod", client_log=GOOD_CLIENT, server_log=server, nccl_ok=True)
    assert out.returncode == 1
    assert "memory registration on rdmap3s0-rdm" in out.stdout


def test_a_clean_run_passes(tmp_path: Path) -> None:
    out = _cluster_run(tmp_path, "deepseek-p5", client_log=GOOD_CLIENT, server_log="", nccl_ok=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "EFA check PASS" in out.stdout and "NCCL check nccl-check-decode: PASS" in out.stdout
