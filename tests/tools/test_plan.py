"""`python -m tools.plan`: exit codes, one-line errors, and the figures in its table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from infra.config import load
from infra.paths import ROOT
from infra.plan import planning
from tools.stackfile import path_of
from tools.stackfile import read_as_deployed as read

# Runs the CLI against a stacks/ folder of the test's own, so no shared stack file is touched.
_WITH_STACKS_DIR = (
    "import pathlib, sys; import tools.stackfile as s; s.STACKS_DIR = pathlib.Path(sys.argv[1]); "
    "from tools.plan import main; sys.exit(main(sys.argv[2:]))"
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def _run_in(stacks_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WITH_STACKS_DIR, str(stacks_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_prod_plan_prints_the_figures():
    r = _run("--stack", "prod")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("Capacity plan: stacks/Pulumi.prod.yaml (prod)")
    assert "llama-3.3-70b (built-in catalog): 70.6B parameters, 80 layers" in out
    assert "16.4 GiB" in out  # weights per GPU: 70.6e9 x 2 / 8 B
    assert "327,680 B, 40,960 B" in out  # KV per token, replica and GPU
    assert "1,395,782" in out  # KV tokens per replica
    assert "EFA 3200 Gbps" in out
    assert "26.8 ms" in out  # 327,680 x 32,768 B / 400e9 B/s
    assert "176 tok/s" in out  # decode roofline at batch 1, 32k context
    assert "24 GPUs $165.12/h at desiredSize, 72 GPUs $495.36/h at maxSize" in out
    assert "Fit      ok" in out
    assert r.stderr == ""


def test_staging_plan_prints_the_figures():
    r = _run("--stack", "staging")
    assert r.returncode == 0, r.stderr
    assert "p4de.24xlarge" in r.stdout
    assert "1,404,099" in r.stdout
    assert "107.4 ms" in r.stdout  # 327,680 x 16,384 B / 50e9 B/s


def test_context_option_moves_the_decode_figures():
    r = _run("--stack", "prod", "--context", "4096")
    assert r.returncode == 0, r.stderr
    assert "Decode @ 4,096 ctx, batch 1" in r.stdout
    assert "  max batch (KV-bound)" in r.stdout and " 340\n" in r.stdout  # 1,395,782 // 4,096
    assert _run("--stack", "prod", "--context", "0").returncode == 2


def test_missing_stack_is_one_line_and_exit_1():
    r = _run("--stack", "no-such-stack")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith("stacks/Pulumi.no-such-stack.yaml: no such stack file (stacks: ")
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_missing_argument_is_a_usage_error():
    assert _run().returncode == 2


def test_model_that_does_not_fit_is_one_line_and_exit_1(tmp_path):
    doc = yaml.safe_load(path_of("staging").read_text())
    pools = doc["config"]["pd-inference:nodePools"]
    serving = doc["config"]["pd-inference:serving"]
    pools["decode"]["instanceType"] = "p4d.24xlarge"
    serving["prefill"]["tensorParallelSize"] = serving["decode"]["tensorParallelSize"] = 2
    (tmp_path / "Pulumi.x.yaml").write_text(yaml.safe_dump(doc))
    r = _run_in(tmp_path, "--stack", "x")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr == (
        "stacks/Pulumi.x.yaml: serving.decode.tensorParallelSize: llama-3.1-70b in bfloat16 needs "
        "65.8 GiB of weights per GPU at TP 2 x PP 1; an A100 40GB offers 36.0 GiB at "
        "gpuMemoryUtilization 0.9 (raise tensorParallelSize or use a larger GPU)\n"
    )


def test_broken_yaml_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "Pulumi.x.yaml").write_text("config:\n  pd-inference:environment: [dev\n")
    r = _run_in(tmp_path, "--stack", "x")
    assert r.returncode == 1
    assert r.stderr.startswith("stacks/Pulumi.x.yaml: not valid YAML")
    assert "Traceback" not in r.stderr


def test_unknown_model_plans_without_the_fit_check(tmp_path):
    doc = yaml.safe_load(path_of("dev").read_text())
    doc["config"]["pd-inference:serving"]["model"]["source"] = "acme/house-model-13b"
    (tmp_path / "Pulumi.x.yaml").write_text(yaml.safe_dump(doc))
    r = _run_in(tmp_path, "--stack", "x")
    assert r.returncode == 0, r.stderr
    assert "Shape    unknown: 'house-model-13b' is not in the planner's built-in catalog" in r.stdout
    assert "Fit check skipped" in r.stdout
    assert "ENA 10 Gbps" in r.stdout  # the hardware rows are still there
    assert "2 GPUs $2.01/h at desiredSize" in r.stdout


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
def test_format_plan_is_what_the_cli_prints(stack):
    values, secrets, _ = read(stack)
    text = planning.format_plan(planning.plan(load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")))
    r = _run("--stack", stack)
    assert r.stdout.split("\n", 1)[1] == text + "\n"


def test_aggregated_mode_plans_the_decode_pool_only():
    values, secrets, _ = read("staging")
    values = dict(values)
    values["serving"] = {**values["serving"], "mode": "aggregated"}
    p = planning.plan(load(values, secret_keys=secrets, source="stacks/Pulumi.x.yaml"))
    assert [r.role for r in p.roles] == ["decode"]
    assert p.gpus_max == 16  # decode pool: up to 2 nodes (room for a NewCluster upgrade)
