"""What EFA memory registration needs in a pod, checked on every rendered EFA pod (issue 24 item 6).

Upstream rules (reproduced in tests/upstream.py, each with the ref it was read at):
- torvalds/linux `drivers/infiniband/core/umem.c` `ib_umem_get` (+ `mm/mlock.c` `can_do_mlock`):
  pinning host memory for a registration fails with EPERM when RLIMIT_MEMLOCK is 0 and with
  ENOMEM past the limit, unless the process has CAP_IPC_LOCK. With an unlimited limit no
  capability is needed: the pods keep `drop: [ALL]` and run as uid 1000.
  (`tests.upstream.ib_umem_get`)
- awslabs/amazon-eks-ami (nodeadm base runtime spec) + our containerd drop-in: the containers'
  RLIMIT_MEMLOCK is unlimited on EFA pools (`tests.upstream.container_memlock`).
- ofiwg/libfabric `prov/efa/src/efa_fork_support.c`: FI_EFA_FORK_SAFE=1 turns the provider's
  huge-page buffers off (and FI_EFA_USE_HUGE_PAGE=1 with it aborts); without it the provider
  uses huge pages, which a pod gets only by requesting `hugepages-2Mi` (Kubernetes "Manage
  HugePages"; awsdocs/amazon-eks-user-guide `latest/ug/ml/node-efa.adoc`: EFA nodes
  pre-allocate 5128 2 MiB pages, its NCCL example requests 5120Mi). (`tests.upstream.efa_uses_huge_pages`)
- aws/eks-charts `stable/aws-efa-k8s-device-plugin` v0.5.30: the plugin (privileged, hostPath
  /dev/infiniband) hands a pod its `/dev/infiniband/uverbs*` files for `vpc.amazonaws.com/efa`;
  the workload pod needs no hostPath and no privilege for them.

Dynamo's EKS EFA guide runs its pods `privileged: true` ("IPC_LOCK alone was not enough"): with
the limit unlimited neither is needed by the kernel's rule above; `make efa-check` proves it on
a real cluster (infra/k8s/efa_check.py: memlock, uverbs files, fi_mr_reg).
"""

from __future__ import annotations

from typing import Any

import yaml

from infra import catalog
from tests.infra.components.test_efa_node_template_contract import (
    _efa_groups,
    _run_scripts,
    _templates,
    _user_data_parts,
)
from tests.upstream import LibfabricAbort, container_memlock, efa_uses_huge_pages, ib_umem_get
from tools import efa_check as efa_check_tool

GIB = 1 << 30


def _memlock_per_pool(rendered_stacks, tmp_path) -> dict[tuple[str, str], str | None]:
    out = {}
    for stack, rendered, role, group in _efa_groups(rendered_stacks):
        lt = _templates(rendered.result)[group.inputs["launchTemplate"]["id"]]
        parts = _user_data_parts(lt)
        node_configs = [yaml.safe_load(b) for ctype, b in parts if ctype == "application/node.eks.aws"]
        root = tmp_path / f"{stack}-{role}"
        root.mkdir()
        drop_ins, reloaded = _run_scripts(parts, root)
        out[(stack, role)] = container_memlock(node_configs, drop_ins, reloaded)
    return out


def _engine_envs(rayservice: dict[str, Any]) -> list[dict[str, str]]:
    """Every engine deployment's runtime_env env_vars in serveConfigV2 (the libfabric settings)."""
    found: list[dict[str, str]] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            env = (o.get("runtime_env") or {}).get("env_vars") if isinstance(o.get("runtime_env"), dict) else None
            if env and "FI_PROVIDER" in env:
                found.append(env)
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    return found


def _pod_problems(
    spec: dict[str, Any], inst: catalog.InstanceType, memlock: str | None, env: dict[str, str]
) -> list[str]:
    problems = []
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            problems.append(f"hostPath volume {v['name']}")
    c = spec["containers"][0]
    sc = c.get("securityContext") or {}
    if sc.get("privileged"):
        problems.append("privileged")
    caps = set((sc.get("capabilities") or {}).get("add") or [])
    limits = (c.get("resources") or {}).get("limits") or {}
    if limits.get("vpc.amazonaws.com/efa") != str(inst.efa_interfaces):
        problems.append(f"asks for {limits.get('vpc.amazonaws.com/efa')} EFA interfaces, not all {inst.efa_interfaces}")
    memory = int(str(limits.get("memory", "0Gi")).removesuffix("Gi")) * GIB
    # Whatever host memory the process may hold must be registrable (NCCL/NIXL bounce buffers, KV offload).
    if (res := ib_umem_get(memlock, caps, memory)) != "ok":
        problems.append(f"registering {memory // GIB} GiB of host memory fails with {res} (memlock {memlock})")
    try:
        huge = efa_uses_huge_pages(env)
    except LibfabricAbort as e:
        problems.append(str(e))
        huge = False
    if huge and not limits.get("hugepages-2Mi"):
        problems.append("libfabric uses huge pages but the pod requests no hugepages-2Mi")
    return problems


def test_engine_pods_can_register_memory_with_least_privilege(rendered_stacks, tmp_path) -> None:
    memlock = _memlock_per_pool(rendered_stacks, tmp_path)
    assert memlock, "no EFA stack rendered"
    for (stack, role), limit in memlock.items():
        rendered = rendered_stacks[stack]
        rs = next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")
        group = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == role)
        inst = (
            rendered.config.node_pools.prefill.instance
            if role == "prefill"
            else rendered.config.node_pools.decode.instance
        )
        envs = _engine_envs(rs)
        assert envs, f"{stack}: no engine libfabric environment in serveConfigV2"
        for env in envs:
            problems = _pod_problems(group["template"]["spec"], inst, limit, env)
            assert problems == [], (stack, role, problems)
        sc = group["template"]["spec"]["containers"][0]["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] == 1000  # least privilege kept


def test_check_pods_can_register_memory_as_the_engines_do(rendered_stacks, tmp_path) -> None:
    memlock = _memlock_per_pool(rendered_stacks, tmp_path)
    for stack in {s for s, _ in memlock}:
        cfg = rendered_stacks[stack].config
        image = "example.com/ray-llm-efa:1"
        checks = efa_check_tool.inputs_for(cfg, stack, image, 0.5)
        objects = efa_check_tool.objects_for(cfg, checks, image)
        assert checks and any(o["kind"] == "Job" for o in objects.values()), stack
        for name, obj in objects.items():
            if obj["kind"] != "Job":
                continue
            spec = obj["spec"]["template"]["spec"]
            pool = spec["nodeSelector"]["pd-inference/role"]  # the role label holds the pool's name
            inst = cfg.node_pools[pool].instance
            env = {e["name"]: e["value"] for e in spec["containers"][0]["env"] if "value" in e}
            assert _pod_problems(spec, inst, memlock[(stack, pool)], env) == [], (stack, name)


def test_the_rules_bite() -> None:
    p5 = catalog.lookup("p5.48xlarge")
    engine_env = {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
    spec = {
        "containers": [
            {
                "securityContext": {"capabilities": {"drop": ["ALL"]}},
                "resources": {"limits": {"vpc.amazonaws.com/efa": "32", "memory": "1800Gi"}},
            }
        ]
    }
    assert _pod_problems(spec, p5, "infinity", engine_env) == []
    # systemd's default limit (no drop-in): pinning fails without CAP_IPC_LOCK; IPC_LOCK would lift it.
    assert any("ENOMEM" in p for p in _pod_problems(spec, p5, None, engine_env))
    assert ib_umem_get(None, {"IPC_LOCK"}, 1800 * GIB) == "ok"
    assert ib_umem_get("0", set(), 4096) == "EPERM"
    # Without fork safety libfabric takes huge pages, which the pod must request.
    assert any("hugepages-2Mi" in p for p in _pod_problems(spec, p5, "infinity", {"FI_PROVIDER": "efa"}))
    assert any("aborts" in p for p in _pod_problems(spec, p5, "infinity", {**engine_env, "FI_EFA_USE_HUGE_PAGE": "1"}))
    # Fewer EFA interfaces than the node has, or a hostPath to /dev/infiniband, are flagged.
    spec["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] = "1"
    spec["volumes"] = [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}]
    assert len(_pod_problems(spec, p5, "infinity", engine_env)) == 2
