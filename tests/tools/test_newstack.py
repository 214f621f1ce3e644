"""`make stack NAME=...` (`python -m tools.newstack`): the new stack file loads, renders, is safe.

What flows through here: a NAME (and choices) -> `tools.newstack` -> a stack file in a stacks/
folder of the test's own (the shipped stacks/ is never written) -> read back through
`tools.stackfile` and `infra.config.load`, and rendered; bad input -> exit 1 and one line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from infra import catalog
from infra.config import CapacityType, ConfigError, EndpointAccess, Environment, load
from infra.paths import ROOT
from infra.plan.stack import load as stack_load
from serving.spec import AuthMode
from tools import mock_runtime, newstack, stackfile


@pytest.fixture
def stacks_dir(tmp_path, monkeypatch):
    """A stacks/ folder of the test's own, holding a copy of the shipped dev stack."""
    d = tmp_path / "stacks"
    d.mkdir()
    (d / "Pulumi.dev.yaml").write_text(stackfile.path_of("dev").read_text())
    monkeypatch.setattr(stackfile, "STACKS_DIR", d)
    return d


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.newstack", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_new_stack_is_dev_sized_safe_and_renders(stacks_dir, capsys):
    assert newstack.main(["team-search", "--owner", "search-team"]) == 0
    out = capsys.readouterr().out
    path = stacks_dir / "Pulumi.team-search.yaml"
    assert path.is_file()

    _, file_secrets, _ = stackfile.read("team-search")
    assert file_secrets == set()  # no fake ciphertext: Pulumi would fail to decrypt it
    assert "secure:" not in path.read_text()
    values, secrets, others = stackfile.read_as_deployed("team-search")
    cfg = load(values, secret_keys=secrets, source="stacks/Pulumi.team-search.yaml")
    assert cfg.environment is Environment.DEV
    assert cfg.endpoint_access is EndpointAccess.PRIVATE
    assert cfg.public_access_cidrs == []
    assert cfg.serving.auth is AuthMode.API_KEY
    assert secrets == {"apiKeys"}  # the one secret its owner must set before `pulumi up`
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


def test_a_model_whose_decode_replica_cannot_stream_the_default_target_gets_the_largest_that_fits(stacks_dir, capsys):
    # Qwen2.5-0.5B on g5.xlarge: the decode roofline at the spec's default target plans more
    # tokens/s than the replica's 2 CPUs stream (infra/sizing/streaming.py); the stack is written
    # with a lower target, and says why in the file.
    assert newstack.main(["team-small", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    path = stacks_dir / "Pulumi.team-small.yaml"
    target = stackfile.load_config("team-small").serving.decode.target_ongoing_requests
    assert 1 <= target < newstack.DEFAULT_DECODE_TARGET
    assert "make plan's Stream line" in path.read_text()
    assert (
        f"decode targetOngoingRequests {target:g} (default {newstack.DEFAULT_DECODE_TARGET})" in capsys.readouterr().out
    )
    # The largest that loads: one more is refused, naming the key and this target as the fix.
    values, secrets, _ = stackfile.read_as_deployed("team-small")
    values["serving"]["decode"]["targetOngoingRequests"] = target + 1
    with pytest.raises(ConfigError) as e:
        stack_load(values, secret_keys=secrets, source="stacks/Pulumi.team-small.yaml")
    assert "serving.decode.targetOngoingRequests:" in str(e.value)
    assert str(e.value).endswith(f"set targetOngoingRequests to {target:g} or less")
    # A model whose roofline at the default target the replica streams keeps the default.
    _, larger = newstack.create("team-larger", model="Qwen/Qwen2.5-3B-Instruct")
    assert larger.config.serving.decode.target_ongoing_requests == newstack.DEFAULT_DECODE_TARGET


def test_choices_reach_the_file(stacks_dir):
    path, rendered = newstack.create(
        "team-qa", model="Qwen/Qwen2.5-0.5B-Instruct", region="eu-west-1", environment="staging"
    )
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
    assert not (ROOT / "stacks" / f"Pulumi.{name}.yaml").exists(), "nothing may be written"


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


@pytest.mark.parametrize(
    "args, starts",
    [
        (["team-r", "--region", "mars-1"], "--region 'mars-1'"),
        (["team-o", "--owner", "a: b"], "--owner 'a: b'"),
    ],
)
def test_bad_choices_fail_with_one_line(stacks_dir, capsys, args, starts):
    assert newstack.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(starts) and err.count("\n") == 1
    assert not (stacks_dir / f"Pulumi.{args[0]}.yaml").exists()


# --- the Pulumi project template (`pulumi new .../templates/pd-inference`) -----------------
TEMPLATE_DIR = ROOT / "templates" / "pd-inference"


def _template_stack() -> tuple[dict, set, dict]:
    """The stack config `pulumi new` writes from the template's defaults (values as strings)."""
    project = yaml.safe_load((TEMPLATE_DIR / "Pulumi.yaml").read_text())
    values, secrets, others = {}, set(), {}
    for key, spec in project["template"]["config"].items():
        ns, _, bare = key.partition(":")
        if spec.get("secret"):
            assert "default" not in spec, f"{key}: a secret has no default"
            secrets.add(bare)
            values[bare] = stackfile.secret_placeholder(bare)
        elif ns == "pd-inference":
            values[bare] = spec["default"]
        else:
            others[key] = spec["default"]
    return values, secrets, others


def test_pulumi_template_is_documented():
    project = yaml.safe_load((TEMPLATE_DIR / "Pulumi.yaml").read_text())
    assert project["name"] == "pd-inference"  # the program's config namespace
    assert project["runtime"]["name"] == "python" and project["stackConfigDir"] == "stacks"
    template = project["template"]
    assert template["description"] and template["displayName"]
    for key, spec in template["config"].items():
        assert spec.get("description"), f"{key} needs a description"
        assert "default" in spec or spec.get("secret"), f"{key} needs a default"
    assert (TEMPLATE_DIR / "requirements.txt").read_text().splitlines()[-1] == "-r platform/requirements.txt"


def test_pulumi_template_defaults_equal_make_stack():
    values, secrets, others = _template_stack()
    from_template = load(values, secret_keys=secrets, source="templates/pd-inference")
    new_values, new_secrets, new_others = stackfile.parse(newstack.planned_text("team-t", "new"), "new")
    # `pulumi new` prompts for the apiKeys secret; `make stack` leaves it to the owner.
    made = stackfile.load_offline(new_values, new_secrets, new_others, "new")
    assert new_secrets == set() and made.stand_ins == ("apiKeys",)
    assert from_template.model_dump() == made.config.model_dump()
    assert secrets == made.secrets and others == new_others


def test_pulumi_template_program_runs_the_platform_program(tmp_path, monkeypatch):
    project = tmp_path / "my-inference"
    shutil.copytree(TEMPLATE_DIR, project)
    (project / "platform").symlink_to(ROOT)  # the submodule checkout
    monkeypatch.setattr(mock_runtime, "PROGRAM", project / "__main__.py")
    values, secrets, others = _template_stack()
    result = mock_runtime.run("team-t", values, secrets, others)
    types = sorted(r.type for r in result.resources)
    assert "eks:index:Cluster" in types and "kubernetes:ray.io/v1:RayService" in types
    assert len(_gpu_pools(result)) == 2
    assert {p.inputs["instanceTypes"][0] for p in _gpu_pools(result)} == {"g5.xlarge"}
    assert result.outputs["clusterName"] == "pd-inference-team-t"


def _gpu_pools(result):
    return [
        r
        for r in result.resources
        if r.type == "eks:index:ManagedNodeGroup" and r.inputs["labels"]["pd-inference/role"] in ("prefill", "decode")
    ]
