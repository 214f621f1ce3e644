"""`make stack NAME=...` (`python -m infra.newstack`): the new stack file loads, renders, is safe.

What flows through here: a NAME (and choices) -> `infra.newstack` -> a stack file in a stacks/
folder of the test's own (the shipped stacks/ is never written) -> read back through
`infra.stackfile` and `infra.config.load`, and rendered; bad input -> exit 1 and one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from infra import catalog, newstack, stackfile
from infra.config import CapacityType, EndpointAccess, Environment, load
from serving.spec import AuthMode

ROOT = stackfile.ROOT


@pytest.fixture
def stacks_dir(tmp_path, monkeypatch):
    """A stacks/ folder of the test's own, holding a copy of the shipped dev stack."""
    d = tmp_path / "stacks"
    d.mkdir()
    (d / "Pulumi.dev.yaml").write_text(stackfile.path_of("dev").read_text())
    monkeypatch.setattr(stackfile, "STACKS_DIR", d)
    return d


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.newstack", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_new_stack_is_dev_sized_safe_and_renders(stacks_dir, capsys):
    assert newstack.main(["team-search", "--owner", "search-team"]) == 0
    out = capsys.readouterr().out
    path = stacks_dir / "Pulumi.team-search.yaml"
    assert path.is_file()

    values, secrets, others = stackfile.read("team-search")
    cfg = load(values, secret_keys=secrets, source="stacks/Pulumi.team-search.yaml")
    assert cfg.environment is Environment.DEV
    assert cfg.endpoint_access is EndpointAccess.PRIVATE
    assert cfg.public_access_cidrs == []
    assert cfg.serving.auth is AuthMode.API_KEY
    assert secrets == {"apiKeys"}  # a secret placeholder, as the shipped stacks carry
    assert "secure: v1:placeholder:" in path.read_text()
    for pool in (cfg.node_pools.prefill, cfg.node_pools.decode):
        assert pool.instance_type == "g5.xlarge"
        assert pool.capacity_type is CapacityType.SPOT
        assert pool.min_size == 0
    assert cfg.serving.model.source == newstack.DEFAULT_MODEL
    assert others == {"aws:region": "us-east-2"}
    assert "search-team" in path.read_text()

    # It rendered (the real program under mocks) and printed the cost of its GPU pools.
    price = catalog.lookup("g5.xlarge").usd_per_hour
    assert "wrote " in out and "Pulumi.team-search.yaml: valid, and renders" in out
    assert f"GPU node cost: ${2 * price:,.2f}/h at desired size" in out
    assert "pulumi config set --secret apiKeys" in out


def test_choices_reach_the_file(stacks_dir):
    path, rendered = newstack.create("team-qa", model="Qwen/Qwen2.5-0.5B-Instruct", region="eu-west-1",
                                     environment="staging")
    assert rendered.config.environment is Environment.STAGING
    assert rendered.config.availability_zones == ["eu-west-1a", "eu-west-1b"]
    assert rendered.config.serving.model.id == "qwen2.5-0.5b-instruct"
    assert "aws:region: eu-west-1" in path.read_text()


def test_refuses_to_overwrite(stacks_dir, capsys):
    dev = stacks_dir / "Pulumi.dev.yaml"
    before = dev.read_text()
    assert newstack.main(["dev"]) == 1
    err = capsys.readouterr().err
    assert err == "stacks/Pulumi.dev.yaml already exists; edit it, or choose another NAME\n"
    assert dev.read_text() == before

    assert newstack.main(["team-a"]) == 0
    first = (stacks_dir / "Pulumi.team-a.yaml").read_text()
    capsys.readouterr()
    assert newstack.main(["team-a", "--region", "us-west-2"]) == 1
    assert (stacks_dir / "Pulumi.team-a.yaml").read_text() == first


@pytest.mark.parametrize(
    "name", ["Team", "team_x", "x", "ab-", "-team", "team--x", "9team", "a" * 25, "team x", "../etc", ""]
)
def test_bad_name_fails_with_one_line(name):
    r = _cli("--", name)  # as `make stack NAME=...` passes it, so "-team" is a NAME, not an option
    assert r.returncode == 1, r.stdout
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"NAME {name!r}:")
    assert not list((ROOT / "stacks").glob("Pulumi.*team*")), "nothing may be written"


def test_shipped_stack_is_not_overwritten_by_the_cli():
    before = stackfile.path_of("prod").read_text()
    r = _cli("prod")
    assert r.returncode == 1
    assert r.stderr == "stacks/Pulumi.prod.yaml already exists; edit it, or choose another NAME\n"
    assert stackfile.path_of("prod").read_text() == before


def test_a_model_that_does_not_fit_leaves_no_file(stacks_dir, capsys):
    assert newstack.main(["team-big", "--model", "meta-llama/Llama-3.3-70B-Instruct"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("stacks/Pulumi.team-big.yaml: serving.prefill.tensorParallelSize:")
    assert not (stacks_dir / "Pulumi.team-big.yaml").exists()


@pytest.mark.parametrize("args, starts", [
    (["team-r", "--region", "mars-1"], "--region 'mars-1'"),
    (["team-o", "--owner", "a: b"], "--owner 'a: b'"),
])
def test_bad_choices_fail_with_one_line(stacks_dir, capsys, args, starts):
    assert newstack.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(starts) and err.count("\n") == 1
    assert not (stacks_dir / f"Pulumi.{args[0]}.yaml").exists()
