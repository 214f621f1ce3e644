"""`make model`: a model added to a stack, and the rollout KubeRay 1.7 does for it.

What flows through here: the shipped platform stack -> tools.model (a model appended to
serving.models, or a pool and a model) -> the real program under mocks before and after
(tools.render.render_parsed) -> infra.k8s.upgrades.classify on the two RayServices (KubeRay
1.7.0 ray-operator/controllers/ray/rayservice_controller.go: serveConfigV2 alone is applied to
the running cluster's Serve; worker groups appended at the end update the running cluster
(isClusterSpecHashEqual partial=true); any other change of rayClusterConfig starts a new one).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from infra import catalog
from infra.k8s import upgrades
from infra.k8s.labels import ROLE_LABEL
from tools import model, render, stackfile

STACK = "platform"
MISTRAL = {"model": {"id": "mistral-7b", "source": "mistralai/Mistral-7B-Instruct-v0.3"}, "mode": "aggregated"}


def _rayservice(rendered):
    (obj,) = [o for o in rendered.manifests().values() if o.get("kind") == "RayService"]
    return obj


@pytest.fixture(scope="module")
def before():
    parsed = stackfile.read(STACK)
    return parsed, render.render_parsed(STACK, parsed, stand_in_secrets=True)


def _after(parsed, entry, pools=None):
    changed = model.added(parsed, entry)
    if pools:
        changed[0]["nodePools"] = {**changed[0]["nodePools"], **pools}
    return render.render_parsed(STACK, changed, stand_in_secrets=True)


def test_adding_a_model_to_existing_pools_is_an_in_place_serve_update(before):
    parsed, rendered = before
    after = _after(parsed, {**MISTRAL, "pools": {"decode": "general"}})
    a, b = _rayservice(rendered), _rayservice(after)
    verdict = upgrades.classify(a, b)
    assert verdict.kind == "serve-in-place" and verdict.extra_gpu_nodes == 0
    # Every application that was there keeps its import path, runtime env and args, which
    # is what Serve's code version hashes (Ray 2.60 deploy_utils.get_app_code_version): Serve
    # keeps their replicas; the new model is an application of its own.
    old = {x["name"]: x for x in yaml.safe_load(a["spec"]["serveConfigV2"])["applications"]}
    new = {x["name"]: x for x in yaml.safe_load(b["spec"]["serveConfigV2"])["applications"]}
    assert set(new) - set(old) == {"llm-model-mistral-7b"}
    for name, app in old.items():
        kept = ("import_path", "runtime_env", "args")
        assert {k: app.get(k) for k in kept} == {k: new[name].get(k) for k in kept}, name


def test_adding_a_pool_at_the_end_adds_a_worker_group_to_the_running_cluster(before):
    parsed, rendered = before
    big = {"instanceType": "g6e.xlarge", "minSize": 0, "desiredSize": 1, "maxSize": 2}
    after = _after(parsed, {**MISTRAL, "pools": {"decode": "big"}}, pools={"big": big})
    a, b = _rayservice(rendered), _rayservice(after)
    groups = [g["groupName"] for g in b["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert groups[-1] == "big"
    verdict = upgrades.classify(a, b)
    assert verdict.kind == "cluster-in-place" and verdict.extra_gpu_nodes == 0
    # The pool itself is a new EKS node group labelled for its worker group.
    labels = {r.inputs["labels"].get(ROLE_LABEL) for r in after.result.of_type("eks:index:ManagedNodeGroup")}
    assert "big" in labels


def test_changing_a_pools_instance_type_starts_a_new_cluster_and_prices_the_switch(before):
    parsed, rendered = before
    values, secrets, others = copy.deepcopy(parsed)
    values["nodePools"]["general"]["instanceType"] = "g5.12xlarge"
    after = render.render_parsed(STACK, (values, secrets, others), stand_in_secrets=True)
    verdict = upgrades.classify(_rayservice(rendered), _rayservice(after))
    assert verdict.kind == "new-cluster"
    groups = _rayservice(after)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    want_nodes = sum(g["replicas"] for g in groups)
    want_usd = sum(
        g["replicas"]
        * catalog.lookup(g["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]).usd_per_hour
        for g in groups
    )
    assert verdict.extra_gpu_nodes == want_nodes and verdict.extra_usd_per_hour == pytest.approx(want_usd)


def test_make_model_prints_the_rollout_and_writes_only_the_serving_block(tmp_path, monkeypatch, capsys):
    src = stackfile.path_of(STACK).read_text()
    monkeypatch.setattr(stackfile, "STACKS_DIR", tmp_path)
    (tmp_path / f"Pulumi.{STACK}.yaml").write_text(src)
    rc = model.main(
        ["--stack", STACK, "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--pool", "decode=general", "--write"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "in-place Serve update" in out and "mistral-7b-instruct-v0.3" in out
    written = (tmp_path / f"Pulumi.{STACK}.yaml").read_text()
    # Everything above the serving block (its comments included) is kept byte for byte.
    head = src.split("  pd-inference:serving:")[0]
    assert written.startswith(head)
    values, _, _ = stackfile.parse(written, "x")
    assert [m["model"]["id"] for m in values["serving"]["models"]][-1] == "mistral-7b-instruct-v0.3"


def test_make_model_refuses_an_unknown_pool_in_one_line(capsys):
    rc = model.main(["--stack", STACK, "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--pool", "decode=nope"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err
    assert "serving.models[2] (mistral-7b-instruct-v0.3).pools.decode" in err and "'nope'" in err


def test_a_one_model_stack_moves_to_the_many_model_form_keeping_its_model_first():
    values, _, _ = stackfile.read("dev")
    many = model.as_many(values["serving"])
    assert many["models"][0]["model"] == values["serving"]["model"]
    assert "model" not in many


def test_the_pods_read_only_the_adapters_prefix_of_the_model_bucket(before):
    """The platform stack's models come from Hugging Face and its adapters from S3: the pods'
    role lists and reads the adapters' prefix of modelBucket and nothing else there."""
    import json

    _, rendered = before
    (policy,) = [r for r in rendered.result.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "llm-pods-read"]
    statements = {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}
    lora = next(m.lora for m in rendered.config.serving.served if m.lora is not None)
    bucket, prefix = lora.bucket, lora.prefix
    assert statements["ModelRead"]["Resource"] == [f"arn:aws:s3:::{bucket}/{prefix}/*"]
    assert statements["ModelList"]["Condition"]["StringLike"]["s3:prefix"] == [prefix, f"{prefix}/*"]
