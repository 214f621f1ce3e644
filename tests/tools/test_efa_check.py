"""`make efa-check` offline: `python -m tools.efa_check --dry-run` renders and validates the Job."""

from __future__ import annotations

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
