"""The rendered Kubernetes objects of every stack, checked against the real schemas.

What flows through here: each stack's `Rendered.manifests()` ->
- every built-in object against the Kubernetes OpenAPI schema of the stack's version
  (kubernetes-validate, strict: unknown fields fail);
- the RayService against the KubeRay v1.7.0 CRD schema (from $KUBERAY_CRD_DIR, default
  ../shared/schemas/kuberay-1.7.0);
- its serveConfigV2 against Ray Serve's own schema and Ray Serve LLM's config validators;
- the arithmetic: devices per pod equal the pool's instance, selectors and tolerations match
  the pools' labels and taints, TP x PP is consistent with GPUs per node;
- serving.ingress.dataPlane: Ray's switches in every Ray pod, and what Ray 2.60 makes of them.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra import catalog
from infra.k8s import upgrades
from infra.k8s.labels import ROLE_LABEL
from infra.k8s.rayservice import EFA_RESOURCE, GPU_RESOURCE, pods_for
from infra.paths import ROOT
from serving.spec import MODEL_APP_PREFIX, DataPlane, IngressSpec, pool_label
from tests.conftest import STACKS
from tests.upstream import async_engine_kwargs
from tools import render, stackfile

CRD_DIR = Path(os.environ.get("KUBERAY_CRD_DIR", ROOT.parent / "shared" / "schemas" / "kuberay-1.7.0"))


def _crd_schema(kind_file: str) -> dict:
    path = CRD_DIR / kind_file
    assert path.is_file(), f"KubeRay CRD not found at {path}: set KUBERAY_CRD_DIR (see README)"
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _rayservice(stack) -> dict:
    found = [o for o in stack.manifests().values() if o.get("kind") == "RayService"]
    assert len(found) == 1
    return found[0]


def _groups(rs: dict) -> dict:
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _serve_service(stack) -> dict:
    """spec.serveService as the v1 Service KubeRay creates from it (selector and name aside)."""
    rs = _rayservice(stack)
    svc = rs["spec"]["serveService"]
    meta = {**svc["metadata"], "namespace": rs["metadata"]["namespace"]}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": svc["spec"]}


def test_builtin_objects_validate_strictly_against_kubernetes_openapi(stack):
    # Custom resources have their own schema tests (KubeRay below, Prometheus Operator in test_monitoring.py).
    custom = ("ray.io/", "monitoring.coreos.com/")
    objects = [o for o in stack.manifests().values() if "apiVersion" in o and not o["apiVersion"].startswith(custom)]
    objects.append(_serve_service(stack))
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "Secret", "Service", "ServiceAccount", "NetworkPolicy"} <= kinds
    for obj in objects:
        kubernetes_validate.validate(obj, stack.config.kubernetes_version, strict=True)


def test_strict_validation_can_fail(stack):
    svc = _serve_service(stack)
    bad = {**svc, "spec": {**svc["spec"], "selectr": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, stack.config.kubernetes_version, strict=True)


def test_rayservice_validates_against_kuberay_crd(stack):
    schema = _crd_schema("ray.io_rayservices.yaml")
    jsonschema.validate(_rayservice(stack), schema)


def test_crd_validation_can_fail(stack):
    schema = _crd_schema("ray.io_rayservices.yaml")
    rs = _rayservice(stack)
    bad = {
        **rs,
        "spec": {
            **rs["spec"],
            "rayClusterConfig": {**rs["spec"]["rayClusterConfig"], "workerGroupSpecs": [{"groupName": "x"}]},
        },
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_worker_groups_ask_for_every_gpu_and_efa_interface_of_their_pool(stack):
    cfg, rs = stack.config, _rayservice(stack)
    pools = dict(cfg.node_pools)
    mngs = {r.inputs["labels"][ROLE_LABEL]: r.inputs for r in stack.result.of_type("eks:index:ManagedNodeGroup")}
    groups = _groups(rs)
    # One group per pool a model's role runs on (one-model stacks: its roles' pools).
    assert set(groups) == {m.pool_of(r) for m in cfg.serving.served for r in m.engine_roles()}
    for role, group in groups.items():
        inst = catalog.lookup(pools[role].instance_type)
        pod = group["template"]["spec"]
        res = pod["containers"][0]["resources"]
        assert res["limits"][GPU_RESOURCE] == str(inst.gpus) == res["requests"][GPU_RESOURCE]
        if inst.efa:
            assert res["limits"][EFA_RESOURCE] == str(inst.efa_interfaces)
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            engine_env = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"][f"{role}_config"][
                "runtime_env"
            ]["env_vars"]
            assert engine_env["FI_PROVIDER"] == "efa" and engine_env["FI_EFA_USE_DEVICE_RDMA"] == "1"
            assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in env
        else:
            assert EFA_RESOURCE not in res["limits"]
        # The pod lands on its pool: its role label and instance type (any other selector key
        # is the pool's too), toleration = its taint.
        mng = mngs[role]
        assert pod["nodeSelector"][ROLE_LABEL] == mng["labels"][ROLE_LABEL] == role
        for k, v in pod["nodeSelector"].items():
            assert k == "node.kubernetes.io/instance-type" or mng["labels"][k] == v, k
        assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == inst.name
        for taint in mng["taints"]:
            assert any(
                t["key"] == taint["key"] and t["effect"] == "NoSchedule" and t["operator"] == "Exists"
                for t in pod["tolerations"]
            )
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        # A KV offload tier's CPU share lives in /dev/shm too (vLLM's mmap file there).
        off = cfg.node_pools[role].kv_offload
        tier = off.cpu_gib if off is not None else 0
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{inst.shm_gib + tier}Gi"}
        assert inst.shm_gib + tier <= inst.pod_memory_gib
        assert group["labels"] == {cfg.serving.placement.label_key: pool_label(cfg.serving.placement, role)}


def test_replica_counts_follow_the_spec(stack):
    cfg = stack.config
    if cfg.serving.many:
        # Several models: a group follows its pool's node bounds (adding a model leaves it
        # alone); the stack check made maxSize hold every model on the pool.
        for name, group in _groups(_rayservice(stack)).items():
            pool = cfg.node_pools[name]
            got = (group["minReplicas"], group["replicas"], group["maxReplicas"])
            assert got == (pool.min_size, pool.desired_size, pool.max_size)
        return
    for role, group in _groups(_rayservice(stack)).items():
        spec = cfg.serving.engine_roles()[role]
        inst = catalog.lookup(getattr(cfg.node_pools, role).instance_type)
        assert spec.gpus_per_replica <= inst.gpus or spec.gpus_per_replica % inst.gpus == 0
        assert group["minReplicas"] == pods_for(spec, inst, spec.min_replicas)
        assert group["maxReplicas"] == pods_for(spec, inst, spec.max_replicas)
        assert group["maxReplicas"] <= getattr(cfg.node_pools, role).max_size


def test_pods_for_spans_nodes_and_packs_small_replicas():
    from serving.spec import RoleSpec

    p5 = catalog.lookup("p5.48xlarge")
    assert pods_for(RoleSpec(tensor_parallel_size=8, pipeline_parallel_size=2), p5, 3) == 6
    assert pods_for(RoleSpec(tensor_parallel_size=2), p5, 5) == 2
    assert pods_for(RoleSpec(tensor_parallel_size=8), p5, 1) == 1


def test_head_does_no_model_work_and_sits_on_system_nodes(stack):
    head = _rayservice(stack)["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["num-cpus"] == "0"
    pod = head["template"]["spec"]
    assert pod["nodeSelector"] == {"pd-inference/role": "system"}
    assert GPU_RESOURCE not in pod["containers"][0]["resources"]["limits"]
    assert head["labels"] == {stack.config.serving.placement.label_key: stack.config.serving.placement.head}


def test_secrets_reach_pods_only_by_reference(stack):
    rs = _rayservice(stack)
    text = yaml.safe_dump(rs)
    assert "placeholder-secret" not in text, "a secret value leaked into the RayService"
    head_env = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    keys = next(e for e in head_env if e["name"] == "PD_API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"]["name"] == "llm-api-keys"
    secret = next(
        o for o in stack.manifests().values() if o.get("kind") == "Secret" and o["metadata"]["name"] == "llm-api-keys"
    )
    assert secret["stringData"] == {"api-keys": "placeholder-secret-apiKeys"}


def test_no_stack_turns_on_the_ingress_test_hooks(stack):
    """The relay's forced stream cut (serving/ingress/relay.py CUT_AFTER_HEADER) is honoured
    only where TEST_HOOKS_ENV is "1": the conformance harness sets it on its local stack; no
    rendered object (pod env, Serve runtime_env) may carry the name at all."""
    from serving.spec import TEST_HOOKS_ENV

    for name, obj in stack.manifests().items():
        assert TEST_HOOKS_ENV not in yaml.safe_dump(obj), f"{name} sets {TEST_HOOKS_ENV}"


def test_serve_config_is_the_spec_rendering_and_passes_ray_validators(stack):
    from infra.k8s.rayservice import RayServiceInputs, serve_config_yaml
    from infra.k8s.tracing import export_for
    from infra.plan.costs import token_prices
    from infra.plan.stack import stack_replica_cpus

    rs = _rayservice(stack)
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    app = serve["applications"][0]
    assert app["import_path"] == "serving.app:build_app"
    assert app["runtime_env"]["working_dir"].startswith("s3://") and app["runtime_env"]["working_dir"].endswith(".zip")
    # One source of truth: re-rendering the spec gives the same config.
    cfg = stack.config
    again = serve_config_yaml(
        RayServiceInputs(
            name="llm",
            namespace=cfg.namespace,
            image=cfg.ray_image,
            serving=cfg.serving,
            instances={
                m.pool_of(r): cfg.node_pools[m.pool_of(r)].instance
                for m in cfg.serving.served
                for r in m.engine_roles()
            },
            working_dir=app["runtime_env"]["working_dir"],
            head_service_account="",
            worker_service_account="",
            api_keys=None,
            tracing=export_for(cfg.observability.tracing, cfg.environment.value),
            # The decode replica's API-side CPUs, from the plan (infra/sizing/streaming.py).
            replica_cpus=stack_replica_cpus(cfg),
            kv_offload={name: p.kv_offload for name, p in cfg.node_pools if p.kv_offload is not None},
            # What a token costs per model and phase (make plan's figures, infra/plan/costs.py).
            token_prices=token_prices(cfg),
        )
    )
    assert yaml.safe_load(again) == serve

    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve)
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    # The engines: the one application's, or each model's own application's.
    apps = {a["name"]: a for a in serve["applications"]}
    for model in cfg.serving.served:
        args = apps[MODEL_APP_PREFIX + model.model.id]["args"] if cfg.serving.many else app["args"]
        roles = (
            {"decode": args["llm_configs"][0]}
            if "llm_configs" in args
            else {
                "prefill": args["prefill_config"],
                "decode": args["decode_config"],
            }
        )
        for role, llm in roles.items():
            parsed = LLMConfig.model_validate(llm)
            inst = cfg.node_pools[model.pool_of(role)].instance
            assert parsed.accelerator_type == inst.ray_accelerator
        if "prefill_config" in args:
            PDServingArgs.model_validate({k: args[k] for k in ("prefill_config", "decode_config")})


def test_code_hash_changes_with_serving_code(tmp_path, monkeypatch):
    from infra import package

    data, sha = package.serving_zip()
    assert package.serving_zip() == (data, sha), "the zip must be deterministic"
    copy = tmp_path / "serving"
    copy.mkdir()
    for f in package.serving_files():
        dest = copy / f.relative_to(package.SERVING)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    monkeypatch.setattr(package, "SERVING", copy)
    monkeypatch.setattr(package, "ROOT", tmp_path)
    assert package.serving_zip()[1] == sha
    (copy / "app.py").write_text((copy / "app.py").read_text() + "\n# changed\n")
    assert package.serving_zip()[1] != sha


def test_the_zip_holds_only_what_the_cluster_runs():
    """serving/ ships whole (spec and app included); local/ (make serve, the tiny model) never."""
    import io
    import zipfile

    from infra import package

    names = zipfile.ZipFile(io.BytesIO(package.serving_zip()[0])).namelist()
    assert "app/serving/spec/serving.py" in names and "app/serving/app.py" in names
    assert not [n for n in names if not n.startswith("app/serving/")], names
    shipped = {n.removeprefix("app/") for n in names}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "serving").rglob("*.py") if "__pycache__" not in p.parts}
    assert shipped == on_disk


def test_working_dir_names_the_current_code(stack):
    from infra import package

    serve = yaml.safe_load(_rayservice(stack)["spec"]["serveConfigV2"])
    assert serve["applications"][0]["runtime_env"]["working_dir"].endswith(f"/serving/{package.serving_zip()[1]}.zip")
    obj = stack.result.one("aws:s3/bucketObjectv2:BucketObjectv2").inputs
    assert obj["key"] == f"serving/{package.serving_zip()[1]}.zip"


def test_pod_identity_role_reads_only_code_and_model(stack):
    import json

    policy = json.loads(
        next(r for r in stack.result.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "llm-pods-read").inputs[
            "policy"
        ]
    )
    actions = {a for s in policy["Statement"] for a in s["Action"]}
    assert actions <= {"s3:GetObject", "s3:ListBucket"}
    resources = [r for s in policy["Statement"] for r in s["Resource"]]
    assert any(r.endswith("/serving/*") for r in resources)
    bucket = stack.config.model_bucket
    assert all(("serving/*" in r) or (bucket and bucket in r) for r in resources)
    source = stack.config.serving.model.source
    if source.startswith("s3://"):
        # The model's prefix only (issue 29): its objects, and listings under it (AWS IAM
        # condition key s3:prefix on ListBucket).
        prefix = source[len(f"s3://{bucket}/") :].strip("/")
        read = next(s for s in policy["Statement"] if s["Sid"] == "ModelRead")
        assert read["Resource"] == [f"arn:aws:s3:::{bucket}/{prefix}/*"]
        listing = next(s for s in policy["Statement"] if s["Sid"] == "ModelList")
        assert listing["Condition"] == {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
    assocs = stack.result.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
    ns = stack.config.namespace
    assert {a.inputs["serviceAccount"] for a in assocs if a.inputs["namespace"] == ns} == {"llm-head", "llm-worker"}


@pytest.mark.parametrize("stack_name", STACKS)
def test_render_cli_writes_resources_and_manifests(stack_name, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.render", "--stack", stack_name, "--out", str(out), "--stand-in-secrets"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # The shipped files hold no secret: the render says which one to set before `pulumi up`.
    assert f"pulumi config set --secret apiKeys <value> --stack {stack_name}" in proc.stdout
    strict = subprocess.run(
        [sys.executable, "-m", "tools.render", "--stack", stack_name, "--out", str(tmp_path / "strict")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert strict.returncode == 1 and strict.stdout == ""
    assert strict.stderr.count("\n") == 1 and "(pulumi config set --secret apiKeys" in strict.stderr
    resources = json.loads((out / "resources.json").read_text())
    assert all(set(r) == {"type", "name", "parent", "inputs"} for r in resources)
    assert any(r["type"] == "kubernetes:ray.io/v1:RayService" for r in resources)
    files = {p.name for p in (out / "manifests").iterdir()}
    assert "rayservice-llm-llm.yaml" in files and "helm-kuberay-chart.yaml" in files
    helm = yaml.safe_load((out / "manifests" / "helm-kuberay-chart.yaml").read_text())
    assert helm["chart"] == "kuberay-operator" and helm["version"] == "1.7.0"
    assert "GPU pools" in proc.stdout and "GPUs" in proc.stdout


def test_ingress_fits_on_a_head_that_offers_no_cpus(stack):
    rs = _rayservice(stack)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    ingress = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["ingress_deployment_config"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert ingress["ray_actor_options"]["num_cpus"] == 0
    assert ingress["ray_actor_options"]["label_selector"] == {"pd-inference/node-group": "head"}


def test_s3_model_source_uses_ray_mirror_config(rendered_stacks):
    serve = yaml.safe_load(_rayservice(rendered_stacks["prod"])["spec"]["serveConfigV2"])
    source = serve["applications"][0]["args"]["decode_config"]["model_loading_config"]["model_source"]
    assert source == {"bucket_uri": rendered_stacks["prod"].config.serving.model.source}


def test_the_serve_controller_can_read_the_stacks_prometheus(stack):
    """Issue 29: the per-role autoscaling policies run in the Serve controller on the head and
    read the engines' metrics through Ray's PrometheusQueryMixin, which takes its address from
    RAY_PROMETHEUS_HOST (ray/serve/autoscaling_policy.py, Ray 2.60): the head carries the
    address of the Prometheus the stack deploys (its prometheusUrl output), and every engine
    role's policy selects that role's series by the label the scrape gives them."""
    rs = _rayservice(stack)
    head_env = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    host = next(e for e in head_env if e["name"] == "RAY_PROMETHEUS_HOST")
    assert host["value"] == stack.result.outputs["prometheusUrl"]
    serving = stack.config.serving
    apps = {a["name"]: a for a in yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]}
    for model in serving.served:
        args = apps[MODEL_APP_PREFIX + model.model.id]["args"] if serving.many else apps["llm"]["args"]
        configs = {r: args[f"{r}_config"] for r in ("prefill", "decode") if f"{r}_config" in args}
        configs = configs or {"decode": args["llm_configs"][0]}
        for role, cfg in configs.items():
            policy = cfg["deployment_config"]["autoscaling_config"]["policy"]
            # The scrape labels series by worker group (= pool); on a shared pool vLLM's
            # model_name label tells the models apart.
            want = f'role="{model.pool_of(role)}"'
            if serving.many:
                want += f',model_name="{model.model.id}"'
            assert policy["policy_kwargs"]["metrics_selector"] == want


def test_prod_streams_its_s3_weights_with_the_runai_streamer(rendered_stacks):
    """Issue 29: prod's s3:// weights are loaded by vLLM's `runai_streamer` (vLLM 0.32
    vllm/model_executor/model_loader/__init__.py maps it to RunaiModelStreamerLoader; the
    image's vLLM 0.29 has `load_format` and `model_loader_extra_config` too,
    infra/vllm/0.29.0.json), and Ray Serve LLM skips its own download for it
    (ray/llm/_internal/common/utils/download_utils.py STREAMING_LOAD_FORMATS, Ray 2.60)."""
    from ray.llm._internal.common.utils.download_utils import STREAMING_LOAD_FORMATS
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

    prod = rendered_stacks["prod"]
    args = yaml.safe_load(_rayservice(prod)["spec"]["serveConfigV2"])["applications"][0]["args"]
    for side in ("prefill_config", "decode_config"):
        kwargs = async_engine_kwargs(dict(args[side]["engine_kwargs"]))
        assert kwargs["load_format"] in STREAMING_LOAD_FORMATS
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        engine = AsyncEngineArgs(model=prod.config.serving.model.source, **kwargs)
        assert isinstance(get_model_loader(engine.create_load_config()), RunaiModelStreamerLoader)


# --- serving.ingress.dataPlane ----------------------------------------------------------------
# Ray 2.60 reads the data plane's switches once, at import, in every Ray process
# (ray/serve/_private/constants.py): a pod without them runs Ray's defaults while the head's
# controller runs HAProxy, so they must be in every Ray container's environment.
def _ray_containers(rs: dict) -> dict[str, dict]:
    """Group -> its Ray container (KubeRay's container index 0), the head's included."""
    cluster = rs["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"]["containers"][0]}
    out.update({g["groupName"]: g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]})
    return out


def _literal_env(container: dict) -> dict[str, str]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"{container['name']}: a variable is set twice"
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_every_ray_pod_carries_the_data_plane_switches(stack):
    want = stack.config.serving.ray_env()  # the switches, and HAProxy's hard stop in that mode
    assert want
    for group, container in _ray_containers(_rayservice(stack)).items():
        env = _literal_env(container)
        assert {k: env.get(k) for k in want} == want, group


SWITCH_STACK = "prod"


@cache
def _rendered_with(plane: DataPlane) -> dict:
    """The RayService of SWITCH_STACK with serving.ingress.dataPlane set in its stack file
    (rendered once per value; read only), and the ingress replicas the dearer planes need at its
    planned rate (the head sizing refuses fewer)."""
    values, secrets, others = copy.deepcopy(stackfile.read(SWITCH_STACK))
    values["serving"]["ingress"] = {**(values["serving"].get("ingress") or {}), "dataPlane": plane.value}
    values["serving"]["ingress"]["maxReplicas"] = 8
    return _rayservice(render.render_parsed(SWITCH_STACK, (values, secrets, others), stand_in_secrets=True))


# What each mode must be inside Ray 2.60 (ray/serve/_private/constants.py): HAProxy replaces
# the proxy actor (controller.py) and forces direct ingress on; the throughput mode sends
# calls between replicas over gRPC (RAY_SERVE_USE_GRPC_BY_DEFAULT -> handle_options.py
# `_by_reference`), but not the proxy's call of the ingress (RAY_SERVE_PROXY_USE_GRPC is read
# before the throughput block; default_impl.py), as docs/architecture.md says; ray-proxy is
# Ray's defaults.
RAY_MODES = {
    DataPlane.HAPROXY: {
        "RAY_SERVE_ENABLE_HA_PROXY": True,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": True,
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": True,
        "RAY_SERVE_PROXY_USE_GRPC": False,
    },
    DataPlane.GRPC: {
        "RAY_SERVE_ENABLE_HA_PROXY": False,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": False,
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": True,
        "RAY_SERVE_PROXY_USE_GRPC": False,
    },
    DataPlane.RAY_PROXY: {
        "RAY_SERVE_ENABLE_HA_PROXY": False,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": False,
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": False,
        "RAY_SERVE_PROXY_USE_GRPC": False,
    },
}


def _ray_reads(env: dict[str, str]) -> dict[str, bool]:
    """What Ray's Serve constants become in a fresh interpreter whose environment is `env` (and
    no other RAY_SERVE_* variable): the constants module only, no Ray is started."""
    flags = sorted(next(iter(RAY_MODES.values())))
    code = (
        "import json; from ray.serve._private import constants as c; "
        f"print(json.dumps({{k: getattr(c, k) for k in {flags!r}}}))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("plane", list(DataPlane), ids=lambda p: p.value)
def test_the_data_plane_switch_sets_rays_mode_in_every_pod(plane):
    rs = _rendered_with(plane)
    jsonschema.validate(rs, _crd_schema("ray.io_rayservices.yaml"))
    switches = {
        g: {k: v for k, v in _literal_env(c).items() if k in plane.ray_env} for g, c in _ray_containers(rs).items()
    }
    assert all(s == plane.ray_env for s in switches.values()), switches
    assert _ray_reads(switches["head"]) == RAY_MODES[plane]


def test_changing_the_data_plane_starts_a_new_cluster():
    """The switches are pod environment, so a change is a new RayCluster for KubeRay 1.7 (not
    a Serve update in place): docs/configuration.md says so."""
    default = IngressSpec().data_plane
    other = next(p for p in DataPlane if p is not default)
    assert upgrades.classify(_rendered_with(default), _rendered_with(other)).kind == "new-cluster"


def test_ray_worker_ports_stay_clear_of_the_direct_ingress_ports(stack):
    """An ingress replica's own HTTP and gRPC servers take ports from the direct-ingress ranges
    (Ray 2.60 ray/serve/_private/constants.py RAY_SERVE_DIRECT_INGRESS_MIN/MAX_*_PORT;
    replica.py `allocate_and_start_server` fails when Ray's workers hold them). Ray's worker
    ports are `ray start`'s --min/--max-worker-port (ray/scripts/scripts.py defaults) unless a
    group's rayStartParams set them; no pod moves the direct-ingress ranges, so Ray's defaults."""
    from ray.scripts.scripts import start
    from ray.serve._private import constants as c

    defaults = {p.name: p.default for p in start.params}
    direct = [
        (c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, c.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT),
        (c.RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT, c.RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT),
    ]
    rs = _rayservice(stack)
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        params = group["rayStartParams"]
        assert "worker-port-list" not in params
        lo = int(params.get("min-worker-port", defaults["min_worker_port"]))
        hi = int(params.get("max-worker-port", defaults["max_worker_port"]))
        for a, b in direct:
            assert hi < a or lo > b, (group.get("groupName", "head"), (lo, hi), (a, b))
    for group, container in _ray_containers(rs).items():
        assert not [k for k in _literal_env(container) if k.startswith("RAY_SERVE_DIRECT_INGRESS_")], group


def _haproxy_dir_problems(container: dict) -> list[str]:
    """HAProxy's folders that the Ray user could not write in this container: none while the
    root filesystem is writable; with a read-only one, those no volume covers."""
    from ray.serve._private import constants as c

    if not (container.get("securityContext") or {}).get("readOnlyRootFilesystem"):
        return []
    dirs = {
        os.path.dirname(c.RAY_SERVE_HAPROXY_CONFIG_FILE_LOC),
        os.path.dirname(c.RAY_SERVE_HAPROXY_SOCKET_PATH),
        c.RAY_SERVE_HAPROXY_SERVER_STATE_BASE,
        os.path.dirname(c.RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH),
    }
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts") or []]
    return sorted(d for d in dirs if not any((d + "/").startswith(m) for m in mounts))


def test_haproxy_can_write_its_files_in_every_ray_pod(stack):
    """HAProxy's config, admin socket, server state and metrics socket live under
    /tmp/haproxy-serve (Ray 2.60 ray/serve/_private/constants.py RAY_SERVE_HAPROXY_*;
    haproxy.py `_initialize_directories_and_error_files` creates the folders as the Ray user,
    in every Ray pod that runs a proxy). Only /tmp/ray is a volume in the Ray pods."""
    problems = {g: p for g, c in _ray_containers(_rayservice(stack)).items() if (p := _haproxy_dir_problems(c))}
    assert problems == {}


def test_the_haproxy_folder_check_catches_a_read_only_root(rendered_stacks):
    head = _ray_containers(_rayservice(rendered_stacks["prod"]))["head"]
    bad = {**head, "securityContext": {**head["securityContext"], "readOnlyRootFilesystem": True}}
    assert _haproxy_dir_problems(bad) == ["/tmp/haproxy-serve"]
    fixed = {**bad, "volumeMounts": [*bad["volumeMounts"], {"name": "haproxy", "mountPath": "/tmp/haproxy-serve"}]}
    assert _haproxy_dir_problems(fixed) == []


def test_a_kv_routed_prefill_pool_declares_the_ports_its_engines_bind_and_others_do_not():
    """Ray 2.60 binds each KV-routed engine's KV-event PUB socket at the base + its node-local
    rank, its replay socket 1000 above and its prompt-token PULL socket at the token base + the
    rank (routing_policies/kv_aware/vllm/kv_events.py); the prefill pool's pods declare exactly
    those for the replicas a pod holds (prod: TP 8 on p5.48xlarge, one replica a pod), the
    decode pool and a plain prefill pool none (every rank: test_kv_router_ports_contract.py)."""
    from ray.llm._internal.serve.routing_policies.kv_aware import constants

    values, secrets, others = copy.deepcopy(stackfile.read(SWITCH_STACK))
    values["serving"]["prefill"] = {**values["serving"]["prefill"], "router": "kv-aware"}
    groups = _groups(_rayservice(render.render_parsed(SWITCH_STACK, (values, secrets, others), stand_in_secrets=True)))

    def kv(group: str) -> list[tuple[str, int]]:
        ports = groups[group]["template"]["spec"]["containers"][0].get("ports", [])
        return [(p["name"], p["containerPort"]) for p in ports if p["name"].startswith("kv")]

    base = constants.DEFAULT_KV_EVENTS_PORT_BASE
    assert kv("prefill") == [
        ("kv0-ev0", base),
        ("kv0-rp0", base + constants.DEFAULT_KV_EVENTS_REPLAY_PORT_OFFSET),
        ("kv0-tk0", constants.DEFAULT_KV_TOKEN_PORT_BASE),
    ]
    assert kv("decode") == []
    plain = _groups(_rendered_with(DataPlane.HAPROXY))
    assert not [
        p
        for g in plain.values()
        for p in g["template"]["spec"]["containers"][0].get("ports", [])
        if p["name"].startswith("kv")
    ]
