"""`make efa-check` offline: `python -m tools.efa_check --dry-run` renders and validates the Job."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from infra import catalog, paths
from infra.config import StackConfig
from infra.config.pools import NodePools
from infra.k8s import efa_check as infra_efa
from serving.spec.models import RolePools
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


# --- the NCCL check rides along for stacks whose replicas span nodes ---------
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


# --- named pools, several models -------------------------------------------------
# What a user sees for a one-model stack on the pools named prefill and decode (docs/efa.md):
# a Service and two Jobs named efa-check-*, each pod pinned to its pool's nodes by the role
# label and the instance type, asking for every EFA interface of its node. Expected values
# come from the stack file (read as YAML) and the catalog, not from the code under test.
def _one_model_efa_stacks() -> dict[str, dict[str, str]]:
    found = {}
    for stack in stackfile.stacks():
        cfg = yaml.safe_load((paths.ROOT / paths.stack_file(stack)).read_text())["config"]
        serving, pools = cfg["pd-inference:serving"], cfg["pd-inference:nodePools"]
        types = {role: pools[role]["instanceType"] for role in ("prefill", "decode") if role in pools}
        one_pd = "models" not in serving and serving.get("mode", "disaggregated") == "disaggregated"
        if one_pd and len(types) == 2 and all(catalog.lookup(t).efa_interfaces for t in types.values()):
            found[stack] = types
    return found


def test_one_model_stacks_on_prefill_and_decode_pools_render_the_documented_check(tmp_path: Path) -> None:
    stacks = _one_model_efa_stacks()
    assert {"prod", "staging", "deepseek-p5", "deepseek-p5en"} <= set(stacks)
    for stack, types in stacks.items():
        out = tmp_path / stack
        assert _run("--stack", stack, "--dry-run", "--out", str(out)).returncode == 0, stack
        objs = {f.name: yaml.safe_load(f.read_text()) for f in out.glob("*efa-check*.yaml")}
        assert set(objs) == {"service-efa-check-server.yaml", "job-efa-check-server.yaml", "job-efa-check-client.yaml"}
        for side, role in (("server", "prefill"), ("client", "decode")):
            job = objs[f"job-efa-check-{side}.yaml"]
            assert job["metadata"]["name"] == f"efa-check-{side}"
            pod = job["spec"]["template"]
            assert pod["metadata"]["labels"] == {
                "app.kubernetes.io/name": "efa-check",
                "app.kubernetes.io/component": side,
            }
            assert pod["spec"]["nodeSelector"] == {
                "pd-inference/role": role,
                "node.kubernetes.io/instance-type": types[role],
            }
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits["vpc.amazonaws.com/efa"] == str(catalog.lookup(types[role]).efa_interfaces), (stack, side)
        service = objs["service-efa-check-server.yaml"]
        assert service["metadata"]["name"] == "efa-check-server"
        assert service["spec"]["selector"] == {
            "app.kubernetes.io/name": "efa-check",
            "app.kubernetes.io/component": "server",
        }
        pairs = min(catalog.lookup(t).efa_interfaces for t in types.values())
        assert len(service["spec"]["ports"]) == pairs, stack


def _config(stack: str, mutate) -> StackConfig:
    """The stack with `mutate` applied, through the config's own checks: the layouts these tests
    build (models moved onto p5) are about the fabric check, not about the capacity plan's
    (the head and the streaming replicas would need sizing for their rooflines)."""
    values, secrets, others = copy.deepcopy(stackfile.read(stack))
    mutate(values)
    return stackfile.load_offline(values, secrets, others, f"{stack} (changed in the test)", plan_checks=False).config


def _platform_on_p5(values) -> None:
    """stacks/Pulumi.platform.yaml with every pool on p5.48xlarge (EFA), the aggregated model's
    replica spanning two nodes (TP 4 x PP 4 = 16 GPUs)."""
    for pool in values["nodePools"].values():
        pool["instanceType"] = "p5.48xlarge"
    values["serving"]["models"][1]["decode"] = {"maxReplicas": 1, "tensorParallelSize": 4, "pipelineParallelSize": 4}


def test_the_platform_stack_has_no_efa_pool_and_says_so_naming_its_pools() -> None:
    out = _run("--stack", "platform", "--dry-run")
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    assert "nothing to check" in line
    assert all(f"{pool} g6e.xlarge (no EFA)" in line for pool in ("prefill", "decode", "general")), line


def test_two_models_the_pd_models_pools_get_the_fabric_check_and_a_spanning_aggregated_pool_nccl() -> None:
    cfg = _config("platform", _platform_on_p5)
    checks = efa_check.inputs_for(cfg, "platform", "example.com/ray-llm-efa:1", 0.5)
    objects = efa_check.objects_for(cfg, checks, "example.com/ray-llm-efa:1")
    jobs = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects.values() if o["kind"] == "Job"}
    # llama (P/D) on prefill -> decode; qwen (aggregated, 2 nodes per replica) on general.
    assert set(jobs) == {"efa-check-server", "efa-check-client", "nccl-check-general"}
    assert jobs["efa-check-server"]["nodeSelector"]["pd-inference/role"] == "prefill"
    assert jobs["efa-check-client"]["nodeSelector"]["pd-inference/role"] == "decode"
    assert jobs["nccl-check-general"]["nodeSelector"]["pd-inference/role"] == "general"
    for obj in objects.values():
        kubernetes_validate.validate(obj, cfg.kubernetes_version, strict=True)


def test_an_aggregated_model_on_one_node_per_replica_gets_no_check() -> None:
    def single_node(values) -> None:
        _platform_on_p5(values)
        values["serving"]["models"][1]["decode"] = {"maxReplicas": 1, "tensorParallelSize": 4}

    cfg = _config("platform", single_node)
    assert efa_check.spanning_pools(cfg) == []
    assert [(p.prefill, p.decode) for p in efa_check.efa_pairs(cfg)] == [("prefill", "decode")]


def test_replicas_spanning_nodes_without_efa_get_no_nccl_check() -> None:
    def two_g6e_nodes(values) -> None:  # the shipped pools (g6e.xlarge, 1 GPU, no EFA)
        values["serving"]["models"][1]["decode"] = {"maxReplicas": 1, "pipelineParallelSize": 2}

    cfg = _config("platform", two_g6e_nodes)
    assert efa_check.spanning_pools(cfg) == [] and efa_check.efa_pairs(cfg) == []


def test_a_pool_pair_shared_by_two_models_is_checked_once() -> None:
    def second_pd_model(values) -> None:
        _platform_on_p5(values)
        for pool in ("prefill", "decode"):  # room for both models and a NewCluster upgrade
            values["nodePools"][pool]["maxSize"] = 4
        values["serving"]["models"].append(
            {"model": {"id": "mistral-7b", "source": "mistralai/Mistral-7B-Instruct-v0.3", "maxModelLen": 8192}}
        )

    cfg = _config("platform", second_pd_model)
    (pair,) = efa_check.efa_pairs(cfg)
    assert (pair.prefill, pair.decode) == ("prefill", "decode")
    assert pair.models == ("llama-3.1-8b-instruct", "mistral-7b")


def test_a_pool_pair_used_in_both_directions_is_checked_once() -> None:
    """fi_pingpong's messages go both ways: prefill -> decode and decode -> prefill is one link."""

    def reversed_pd_model(values) -> None:
        _platform_on_p5(values)
        for pool in ("prefill", "decode"):
            values["nodePools"][pool]["maxSize"] = 4
        values["serving"]["models"].append(
            {
                "model": {"id": "mistral-7b", "source": "mistralai/Mistral-7B-Instruct-v0.3", "maxModelLen": 8192},
                "pools": {"prefill": "decode", "decode": "prefill"},
            }
        )

    cfg = _config("platform", reversed_pd_model)
    (pair,) = efa_check.efa_pairs(cfg)
    assert (pair.prefill, pair.decode, pair.models) == ("prefill", "decode", ("llama-3.1-8b-instruct", "mistral-7b"))


def _prod_on_pools_named_h100() -> StackConfig:
    """stacks/Pulumi.prod.yaml's config with its pools renamed h100-a (prefill) and h100-b
    (decode). Built by copying the validated config: validating such a one-model stack trips
    the offline planner, which still reads the pools named prefill and decode
    (infra/plan/planning.py), outside what this check owns."""
    cfg = stackfile.load_config("prod")
    pools = NodePools({"h100-a": cfg.node_pools["prefill"], "h100-b": cfg.node_pools["decode"]})
    serving = cfg.serving.model_copy(update={"pools": RolePools(prefill="h100-a", decode="h100-b")})
    return cfg.model_copy(update={"node_pools": pools, "serving": serving})


def test_pools_with_other_names_get_a_check_named_and_placed_after_them() -> None:
    cfg = _prod_on_pools_named_h100()
    assert cfg.node_pools.names() == ["h100-a", "h100-b"]
    (inp,) = efa_check.inputs_for(cfg, "prod", "example.com/ray-llm-efa:1", 0.5)
    objects = efa_check.objects_for(cfg, [inp], inp.image)
    assert set(objects) == {
        "service-efa-check-h100-a-h100-b-server.yaml",
        "job-efa-check-h100-a-h100-b-server.yaml",
        "job-efa-check-h100-a-h100-b-client.yaml",
    }
    server = objects["job-efa-check-h100-a-h100-b-server.yaml"]["spec"]["template"]
    client = objects["job-efa-check-h100-a-h100-b-client.yaml"]["spec"]["template"]
    assert server["spec"]["nodeSelector"]["pd-inference/role"] == "h100-a"
    assert client["spec"]["nodeSelector"]["pd-inference/role"] == "h100-b"
    service = objects["service-efa-check-h100-a-h100-b-server.yaml"]
    assert service["spec"]["selector"] == server["metadata"]["labels"] != client["metadata"]["labels"]
    # The client dials its own pair's server.
    script = client["spec"]["containers"][0]["command"][-1]
    assert "efa-check-h100-a-h100-b-server.llm.svc.cluster.local" in script.replace(cfg.namespace, "llm")
    for obj in objects.values():
        kubernetes_validate.validate(obj, cfg.kubernetes_version, strict=True)


def test_two_pd_models_on_different_pool_pairs_get_one_check_each_with_distinct_names() -> None:
    def another_pair(values) -> None:
        _platform_on_p5(values)
        values["nodePools"]["h100-a"] = copy.deepcopy(values["nodePools"]["prefill"])
        values["nodePools"]["h100-b"] = copy.deepcopy(values["nodePools"]["decode"])
        values["serving"]["models"].append(
            {
                "model": {"id": "mistral-7b", "source": "mistralai/Mistral-7B-Instruct-v0.3", "maxModelLen": 8192},
                "pools": {"prefill": "h100-a", "decode": "h100-b"},
            }
        )

    cfg = _config("platform", another_pair)
    checks = efa_check.inputs_for(cfg, "platform", "example.com/ray-llm-efa:1", 0.5)
    assert [(c.name, c.pools["prefill"], c.pools["decode"]) for c in checks] == [
        ("efa-check", "prefill", "decode"),
        ("efa-check-h100-a-h100-b", "h100-a", "h100-b"),
    ]
    objects = efa_check.objects_for(cfg, checks, "example.com/ray-llm-efa:1")
    services = [o for o in objects.values() if o["kind"] == "Service" and "efa-check" in o["metadata"]["name"]]
    servers = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects.values()
        if o["kind"] == "Job" and o["metadata"]["name"].endswith("-server")
    }
    # Each Service selects exactly one server pod template: its own pair's.
    for svc in services:
        chosen = [n for n, labels in servers.items() if svc["spec"]["selector"].items() <= labels.items()]
        assert chosen == [svc["metadata"]["name"]]


def test_a_stale_check_of_an_earlier_run_is_not_left_for_kubectl_apply(tmp_path: Path) -> None:
    (tmp_path / "job-efa-check-old-a-old-b-server.yaml").write_text("stale")
    (tmp_path / "job-nccl-check-gone.yaml").write_text("stale")
    (tmp_path / "notes.yaml").write_text("not ours")
    assert _run("--stack", "prod", "--dry-run", "--out", str(tmp_path)).returncode == 0
    assert sorted(f.name for f in tmp_path.glob("*.yaml")) == [
        "job-efa-check-client.yaml",
        "job-efa-check-server.yaml",
        "notes.yaml",
        "service-efa-check-server.yaml",
    ]


def _fake_kubectl_per_pair(bin_: Path, logs: dict[str, str]) -> None:
    """kubectl stand-in: apply/delete/wait succeed; `logs job/<name>` prints logs[<name>]."""
    bin_.mkdir()
    cases = "".join(f'  *"logs job/{job}")  printf "%s\\n" "{log}" ;;\n' for job, log in logs.items())
    (bin_ / "kubectl").write_text(f'#!/bin/bash\ncase "$*" in\n{cases}  *) exit 0 ;;\nesac\n')
    (bin_ / "kubectl").chmod(0o755)


def test_each_pairs_report_is_read_from_its_own_jobs(tmp_path: Path, monkeypatch, capsys) -> None:
    p5 = catalog.lookup("p5.48xlarge")
    checks = [
        infra_efa.EfaCheckInputs(
            namespace="llm",
            image="example.com/ray-llm-efa:1",
            instances={"prefill": p5, "decode": p5},
            pools={"prefill": pre, "decode": dec},
            name=name,
        )
        for (pre, dec), name in infra_efa.check_names([("prefill", "decode"), ("h100-a", "h100-b")]).items()
    ]
    bad = "EFA_CHECK FAIL prefill: memory registration on rdmap3s0-rdm: fi_mr_reg(): ret=-12"
    slow = GOOD_CLIENT.replace("MBps=12000", "MBps=300")  # 32 x 300 MB/s = 76.8 Gbps
    _fake_kubectl_per_pair(
        tmp_path / "bin",
        {
            "efa-check-client": GOOD_CLIENT,
            "efa-check-server": "",
            "efa-check-h100-a-h100-b-client": slow,
            "efa-check-h100-a-h100-b-server": bad,
        },
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert efa_check.run_on_cluster("llm", checks, tmp_path) == 1
    text = capsys.readouterr().out
    first, second = text.split("efa-check-h100-a-h100-b: pool h100-a -> pool h100-b")
    assert "efa-check: pool prefill -> pool decode" in first
    assert "EFA check PASS: 32/32 device pairs, 3,072.0 Gbps in total" in first
    assert "EFA check FAIL: 32/32 device pairs, 76.8 Gbps in total" in second
    assert "memory registration on rdmap3s0-rdm" in second
