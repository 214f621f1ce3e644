"""The Pulumi program and the offline tools run in the light environment, proven by building it.

What flows through here:
- `make light-env` (a prerequisite of make test; the test asks make, so a bare pytest run builds
  it too) -> a virtualenv made from `requirements.lock` alone, the way `.venv-pulumi` and every
  workflow job that runs the program make theirs (tests/ci/test_workflows.py holds the
  workflows to the same command), cached under .cache/light-env/<lock hash> -> in it, as
  subprocesses: `tools.render --stand-in-secrets` of every shipped stack (one interpreter for
  all of them; a failure names the stack), `tools.plan`, `tools.diff`, `tools.efa_check
  --dry-run` and `tools.model` on one stack, the render job's `tools.diff --rendered` and the
  deploy job's `tools.affected`, and `tools.newstack` -> each must exit 0 and write its files.
- `__main__.py`'s import closure, read statically (tests/tools/import_closure.py states which
  code counts) -> the distributions its third-party imports come from (importlib.metadata in
  the full .venv) -> each must be pinned by `requirements.lock`, or `pulumi up` in CI fails at
  program load (the deploy workflow installs only the lock).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from infra.paths import ROOT
from tests.tools import import_closure
from tools import stackfile

LOCK = ROOT / "requirements.lock"


def _lock_pins() -> dict[str, str]:
    """canonical distribution name -> pinned version, from requirements.lock."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line):
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


# --- the environment, built --------------------------------------------------------------------
@pytest.fixture(scope="module")
def light_python() -> Path:
    """The light environment's interpreter, built (or found up to date) by `make light-env`."""
    r = subprocess.run(["make", "-s", "--no-print-directory", "light-env"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"make light-env failed:\n{r.stderr[-3000:]}"
    env_dir = ROOT / r.stdout.strip().splitlines()[-1]
    python = env_dir / "bin" / "python"
    assert python.is_file(), f"make light-env printed {env_dir}, which has no bin/python"
    return python


def _env() -> dict[str, str]:
    """The caller's environment without anything that could hand the light interpreter the
    full .venv's packages."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PD_STACKS_DIR", "VIRTUAL_ENV"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONNOUSERSITE": "1"}


def test_the_light_environment_is_the_lock_and_nothing_else(light_python: Path) -> None:
    """Keyed by the lock's content, and holding exactly the lock's pins (pip's own tools aside):
    a package that slipped in from elsewhere would let a missing pin pass."""
    key = LOCK.read_bytes() + (ROOT / "requirements-pip.lock").read_bytes()
    assert light_python.parent.parent.name == hashlib.sha256(key).hexdigest()[:12]
    r = subprocess.run(
        [
            str(light_python),
            "-c",
            "import importlib.metadata as m, json, sys;"
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}));"
            "print(sys.prefix, sys.flags.no_user_site)",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    installed = {canonicalize_name(k): v for k, v in json.loads(r.stdout.splitlines()[0]).items()}
    # The installer is the pinned one, not the interpreter's bundled pip (requirements-pip.txt).
    pip_pin = re.search(r"^pip==(\S+)", (ROOT / "requirements-pip.lock").read_text(), re.M)
    assert pip_pin and installed.get("pip") == pip_pin.group(1), installed.get("pip")
    installed = {k: v for k, v in installed.items() if k not in ("pip", "setuptools", "wheel")}
    assert installed == _lock_pins()


# One interpreter runs every command, each as `python -m <module> <args>` would (runpy, as
# __main__), and reports per command: exit status, stdout, stderr (a traceback if it raised).
_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
results = []
for module, argv in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"module": module, "argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def _run_in_light_env(python: Path, commands: list[tuple[str, list[str]]], **kw) -> list[dict]:
    r = subprocess.run(
        [str(python), "-c", _RUNNER, json.dumps(commands)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env() | kw.get("env", {}),
    )
    assert r.returncode == 0, f"the runner itself failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.splitlines()[-1])


def _failures(results: list[dict]) -> str:
    return "\n\n".join(
        f"python -m {r['module']} {' '.join(r['argv'])} exited {r['code']}:\n{(r['err'] or r['out'])[-2000:]}"
        for r in results
        if r["code"] != 0
    )


@pytest.mark.timeout(900)
def test_every_stack_renders_and_the_offline_tools_run_in_the_light_environment(
    light_python: Path, tmp_path: Path
) -> None:
    stacks = stackfile.stacks()
    assert {"dev", "staging", "prod", "platform"} <= set(stacks)
    renders = [("tools.render", ["--stack", s, "--stand-in-secrets", "--out", str(tmp_path / s)]) for s in stacks]
    tools = [
        ("tools.plan", ["--stack", "prod"]),
        ("tools.diff", ["dev", "staging"]),
        ("tools.efa_check", ["--stack", "prod", "--dry-run", "--out", str(tmp_path / "efa")]),
        # What the pull-request render job runs on two rendered stacks, and the deploy job's tiers.
        ("tools.diff", ["--rendered", "--markdown", str(tmp_path / "dev"), str(tmp_path / "staging")]),
        ("tools.affected", ["--environment", "prod"]),
        # Without --write: validates, renders before and after, prints; changes no file.
        (
            "tools.model",
            ["--stack", "platform", "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--pool", "decode=general"],
        ),
    ]
    results = _run_in_light_env(light_python, renders + tools)
    assert not _failures(results), _failures(results)
    for s in stacks:
        assert (tmp_path / s / "resources.json").is_file(), f"{s}: rendered no resources.json"
    assert sorted((tmp_path / "efa").glob("*.yaml")), "efa_check --dry-run wrote no objects"
    assert any(r["stack"] == "prod" for r in json.loads(results[len(renders) + 4]["out"]))


def test_make_stack_runs_in_the_light_environment(light_python: Path, tmp_path: Path) -> None:
    # Its own interpreter: the stacks folder (PD_STACKS_DIR) is read once, at import.
    (result,) = _run_in_light_env(
        light_python, [("tools.newstack", ["--", "team-light"])], env={"PD_STACKS_DIR": str(tmp_path)}
    )
    assert result["code"] == 0, _failures([result])
    assert (tmp_path / "Pulumi.team-light.yaml").is_file()


# --- the program's import closure, read statically -----------------------------------------------
def unpinned(closure: import_closure.Closure) -> list[str]:
    """One line per third-party import of the closure whose distribution requirements.lock does
    not pin, naming the import, the module and the chain from __main__ that reaches it."""
    pins, dists = _lock_pins(), packages_distributions()
    problems = []
    for top, (module, line) in sorted(closure.third_party.items()):
        provided = {canonicalize_name(d) for d in dists.get(top, [])}
        if provided & set(pins):
            continue
        what = f"distribution {', '.join(sorted(provided))}" if provided else "no installed distribution"
        chain = " -> ".join(closure.chain(module))
        problems.append(f"{module}:{line} imports {top} ({what}), which requirements.lock does not pin; via {chain}")
    return problems


def test_the_programs_import_closure_needs_only_what_the_lock_pins() -> None:
    closure = import_closure.walk(ROOT)
    assert not closure.unreadable, closure.unreadable
    # The walk reaches what it must: the program's parts and the serving facts it reads.
    assert {"infra.components.llm_service", "infra.k8s.serving_metrics", "serving.core.metrics"} <= set(closure.modules)
    assert {"pulumi", "pulumi_aws", "pydantic", "yaml"} <= set(closure.third_party)
    assert unpinned(closure) == []


def _with_line(module: str, line: str):
    """A `source_of` for the walker: `module`'s real source with one line added at the end."""

    def source_of(name: str, path: Path) -> str:
        text = path.read_text()
        return text + "\n" + line + "\n" if name == module else text

    return source_of


def test_a_module_level_starlette_import_in_a_serving_module_the_program_reads_fails() -> None:
    """The regression that broke every deploy: serving code the program imports for its facts
    gained a module-level web-framework import."""
    closure = import_closure.walk(
        ROOT, source_of=_with_line("serving.core.failures", "from starlette.responses import Response")
    )
    (problem,) = unpinned(closure)
    assert problem.startswith("serving.core.failures:") and " imports starlette " in problem
    assert "__main__ -> " in problem and problem.endswith("serving.core.failures")


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FACTS = {
    "pkg/__init__.py": "from pkg.facts import runtime_only\n",
    "pkg/facts.py": (
        "from typing import TYPE_CHECKING\n"
        "from .more import helper\n"
        "if TYPE_CHECKING:\n    import starlette\n"
        "LIMIT = 1\n"
        "def runtime_only():\n    import ray\n"
        "def calls_helper():\n    return helper()\n"
        "class Engine:\n    def start(self):\n        import vllm\n"
    ),
    "pkg/more.py": "def helper():\n    import torch\n",
}


@pytest.mark.parametrize(
    "main, flagged",
    [
        ("from pkg import facts\nX = facts.LIMIT\n", []),  # constants only: the runtime's imports stay out
        ("from pkg import facts\nfacts.runtime_only()\n", ["ray"]),
        ("from pkg import runtime_only\nHANDLERS = {'x': runtime_only}\n", ["ray"]),  # a re-export, in a table
        ("import pkg.facts\npkg.facts.calls_helper()\n", ["torch"]),  # through a relative import
        ("from pkg.facts import Engine\nEngine()\n", ["vllm"]),  # a class counts whole
        ("from pkg.facts import runtime_only\n", []),  # imported, never used
        ("import importlib\nimportlib.import_module('pkg.more').helper\n", []),  # by string: not followed
    ],
)
def test_function_level_imports_count_once_the_program_refers_to_the_function(
    tmp_path: Path, main: str, flagged: list[str]
) -> None:
    """The walker's rule on a throwaway tree: ray, torch and vllm are installed in .venv and
    pinned by no lock entry of the light environment; starlette sits under TYPE_CHECKING."""
    closure = import_closure.walk(_tree(tmp_path, {**FACTS, "__main__.py": main}))
    assert [p.split(" imports ")[1].split(" ")[0] for p in unpinned(closure)] == flagged


def test_a_computed_dynamic_import_is_reported(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"__main__.py": "import importlib\nname = 'x'\nimportlib.import_module(name)\n"})
    assert import_closure.walk(tree).unreadable == ["__main__:3: import_module of a computed name"]
