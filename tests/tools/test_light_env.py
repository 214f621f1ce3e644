"""The offline tools run in the light environment: requirements.txt only (issue 24 item 9).

What flows through here: `python -m tools.render|plan|diff|efa_check|newstack` in a subprocess
whose imports of every top-level package that only requirements-dev.txt or
requirements-serving.txt installs (Ray, vLLM, NIXL, torch, the schema validators, pytest, ...)
fail, as they do in `.venv-pulumi` -> each must still do its job. The Makefile gives those
targets that environment and never the full `.venv` (tests/ci/test_workflows.py checks the
targets and the workflows).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.paths import ROOT

# Import names of what requirements-dev.txt and requirements-serving.txt add to requirements.txt.
NOT_IN_THE_LIGHT_ENV = (
    "ray",
    "vllm",
    "nixl",
    "torch",
    "transformers",
    "tokenizers",
    "pyarrow",
    "matplotlib",
    "kubernetes_validate",
    "jsonschema",
    "openai",
    "httpx",
    "pytest",
    "promql_parser",
    "pulumi_policy",
    "elftools",
)

_RUNNER = """
import importlib.abc, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the light environment")
        return None
sys.meta_path.insert(0, Block())
module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _light(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, ",".join(NOT_IN_THE_LIGHT_ENV), module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def test_the_blocker_blocks() -> None:
    # Sanity of the harness: a module that imports Ray fails under it.
    out = _light("ray.scripts.scripts")
    assert out.returncode != 0 and "not in the light environment" in out.stderr


def test_render_of_an_efa_stack_needs_no_serving_or_test_packages(tmp_path: Path) -> None:
    out = _light("tools.render", "--stack", "prod", "--stand-in-secrets", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "resources.json").is_file()
    assert sorted(p.name for p in (tmp_path / "efa-check").glob("*.yaml"))  # the fabric check too


@pytest.mark.parametrize(
    "module,args",
    [
        ("tools.plan", ("--stack", "prod")),
        ("tools.diff", ("dev", "staging")),
        ("tools.efa_check", ("--stack", "prod", "--dry-run")),
        ("tools.plan", ("--stack", "platform")),
        # Without --write: validates, renders before and after, prints; changes no file.
        (
            "tools.model",
            ("--stack", "platform", "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--pool", "decode=general"),
        ),
    ],
)
def test_other_offline_tools_need_no_serving_or_test_packages(module: str, args: tuple[str, ...], tmp_path) -> None:
    extra = ("--out", str(tmp_path)) if module == "tools.efa_check" else ()
    out = _light(module, *args, *extra)
    assert out.returncode == 0, out.stderr[-2000:]


def test_make_stack_needs_no_serving_or_test_packages(tmp_path: Path) -> None:
    out = _light("tools.newstack", "--", "team-light", env={"PD_STACKS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "Pulumi.team-light.yaml").is_file()
