"""EFA pools boot from the stack's own launch template: encrypted root volume, every EFA
interface, a cluster placement group, and containers with unlimited locked memory.

Contracts:
- pulumi/pulumi-eks v4 `nodejs/eks/nodes/nodegroup.ts` (`createManagedNodeGroup`,
  `createMNGCustomLaunchTemplate`): with `enableEfaSupport` pulumi-eks builds the node launch
  template, and its block device mapping carries only `volumeSize` (diskSize), never
  `encrypted`; `nodejs/eks/nodes/instances.ts` (`getEfaNetworkInterfaces`): one interface per
  network card, card 0 "efa" at device index 0, the rest "efa-only" at device index 1.
  Reproduced in `tests.upstream.mng_root_volume` and `tests.upstream.efa_network_interfaces`.
- awslabs/amazon-eks-ami v20260724: `nodeadm/internal/containerd/base-runtime-spec.json` (the
  containers' rlimits: RLIMIT_NOFILE only, so RLIMIT_MEMLOCK is containerd's),
  `templates/al2023/runtime/rootfs/etc/systemd/system/nodeadm-run.service`
  (After=cloud-final.service: user-data scripts run before nodeadm restarts containerd),
  `nodeadm/internal/containerd/daemon.go` (EnsureRunning restarts containerd through systemd).
  Reproduced in `tests.upstream.container_memlock`. EFA memory registration needs the limit
  (libfabric fi_efa(7); the AWS EFA installer's own `--skip-limit-conf` step sets it on hosts).
"""

from __future__ import annotations

import base64
import email
import os
import subprocess
from pathlib import Path

import yaml

from infra import catalog
from infra.components.gpu_node_pool import CONTAINERD_MEMLOCK_DROP_IN, MEMLOCK_SCRIPT, RAID0_NODECONFIG
from tests.upstream import (
    CONTAINERD_DROP_IN_DIR,
    container_memlock,
    efa_network_interfaces,
    mng_root_volume,
)

MNG = "eks:index:ManagedNodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"


def _gpu_groups(result):
    return {
        r.inputs["labels"]["pd-inference/role"]: r
        for r in result.of_type(MNG)
        if r.inputs["labels"]["pd-inference/role"] in ("prefill", "decode")
    }


def _templates(result) -> dict[str, dict]:
    return {f"{r.name}-id": r.inputs for r in result.of_type(LAUNCH_TEMPLATE)}


def _efa_groups(rendered_stacks):
    for stack, rendered in rendered_stacks.items():
        for role, group in _gpu_groups(rendered.result).items():
            if catalog.lookup(group.inputs["instanceTypes"][0]).efa:
                yield stack, rendered, role, group


def test_efa_pools_boot_from_an_encrypted_root_volume(rendered_stacks):
    seen = 0
    for stack, rendered, role, group in _efa_groups(rendered_stacks):
        volume = mng_root_volume(group.inputs, _templates(rendered.result))
        assert volume == {"source": "own-template", "encrypted": True}, (stack, role, volume)
        seen += 1
    assert seen >= 4, "prod, staging and the deepseek stacks have EFA pools"


def test_the_rule_bites_on_yesterdays_inputs():
    """pulumi-eks's EFA path (enableEfaSupport + diskSize): the template has no `encrypted`."""
    old = {
        "enableEfaSupport": True,
        "placementGroupAvailabilityZone": "us-east-1a",
        "diskSize": 500,
        "enableIMDSv2": True,
        "amiId": "ami-0123",
    }
    assert mng_root_volume(old, {}) == {"source": "pulumi-eks-template", "encrypted": False, "volumeSize": 500}


def test_the_template_carries_what_pulumi_eks_would_have(rendered_stacks):
    """Same EFA interfaces as getEfaNetworkInterfaces for the type's network cards, one subnet,
    a cluster placement group: nothing of pulumi-eks's EFA support is lost by building our own."""
    for stack, rendered, role, group in _efa_groups(rendered_stacks):
        inst = catalog.lookup(group.inputs["instanceTypes"][0])
        lt = _templates(rendered.result)[group.inputs["launchTemplate"]["id"]]
        nics = lt["networkInterfaces"]
        sgs = nics[0]["securityGroups"]
        assert len(sgs) == 2, "the EKS cluster security group and the pool's EFA security group"
        assert nics == efa_network_interfaces(inst.efa_interfaces, sgs), (stack, role)
        assert len(group.inputs["subnetIds"]) == 1, (stack, role)
        pg = next(r for r in rendered.result.of_type(PLACEMENT_GROUP) if r.name == f"gpu-{role}-pg")
        assert pg.inputs["strategy"] == "cluster"
        assert lt["placement"] == {"groupName": pg.inputs.get("name", pg.name)}
        assert group.inputs["releaseVersion"] == rendered.config.ami_release_version
        assert not group.inputs.get("amiId"), "EKS picks the pinned release's AMI (no image in the template)"


def _user_data_parts(lt: dict) -> list[tuple[str, str]]:
    msg = email.message_from_string(base64.b64decode(lt["userData"]).decode())
    assert msg.is_multipart(), "EKS merges only MIME multi-part user data with its own"
    return [(p.get_content_type(), p.get_payload()) for p in msg.get_payload()]


def _run_scripts(parts: list[tuple[str, str]], root: Path) -> tuple[dict[str, str], bool]:
    """Run the user data's shell scripts with bash in a scratch root (paths under /etc moved
    there, systemctl recorded): the drop-ins they leave and whether systemd was reloaded."""
    log = root / "systemctl.log"
    for i, (ctype, body) in enumerate(parts):
        if ctype != "text/x-shellscript":
            continue
        script = root / f"part-{i}.sh"
        script.write_text(body.replace("/etc/", f"{root}/etc/"))
        subprocess.run(
            ["bash", "-c", 'systemctl() { printf "%s\\n" "$*" >> "$LOG"; }; export -f systemctl; bash "$0"', script],
            check=True,
            env={**os.environ, "LOG": str(log)},
            timeout=30,
        )
    drop_in_dir = root / CONTAINERD_DROP_IN_DIR.lstrip("/")
    drop_ins = {str(p): p.read_text() for p in drop_in_dir.glob("*.conf")} if drop_in_dir.exists() else {}
    reloaded = log.exists() and "daemon-reload" in log.read_text().split("\n")
    return drop_ins, reloaded


def test_efa_containers_get_unlimited_locked_memory(rendered_stacks, tmp_path):
    for stack, rendered, role, group in _efa_groups(rendered_stacks):
        lt = _templates(rendered.result)[group.inputs["launchTemplate"]["id"]]
        parts = _user_data_parts(lt)
        node_configs = [yaml.safe_load(body) for ctype, body in parts if ctype == "application/node.eks.aws"]
        root = tmp_path / f"{stack}-{role}"
        root.mkdir()
        drop_ins, reloaded = _run_scripts(parts, root)
        assert container_memlock(node_configs, drop_ins, reloaded) == "infinity", (stack, role)
        inst = catalog.lookup(group.inputs["instanceTypes"][0])
        if inst.nvme_disks:
            assert RAID0_NODECONFIG.strip() in [b.strip() for _, b in parts], "the RAID0 NodeConfig stays"


def test_the_memlock_rule_bites():
    # No drop-in: containerd's (systemd's default) limit reaches the containers.
    assert container_memlock([], {}, reloaded=False) is None
    # A drop-in that systemd never reloaded does not reach the restarted containerd.
    drop_in = {CONTAINERD_MEMLOCK_DROP_IN: "[Service]\nLimitMEMLOCK=infinity\n"}
    assert container_memlock([], drop_in, reloaded=False) is None
    assert container_memlock([], drop_in, reloaded=True) == "infinity"
    # A baseRuntimeSpec rlimits list replaces the default one whole; its MEMLOCK entry wins.
    spec = {
        "spec": {
            "containerd": {"baseRuntimeSpec": {"process": {"rlimits": [{"type": "RLIMIT_MEMLOCK", "hard": 65536}]}}}
        }
    }
    assert container_memlock([spec], drop_in, reloaded=True) == "65536"
    assert "daemon-reload" in MEMLOCK_SCRIPT and CONTAINERD_MEMLOCK_DROP_IN.startswith(CONTAINERD_DROP_IN_DIR + "/")


def test_non_efa_pools_boot_from_the_stacks_own_template_too(rendered_stacks):
    """g5/g6e pools (dev, platform): the stack's template (pulumi-eks's would leave the root
    volume unencrypted and the metadata hop limit at 2), with no EFA interface, no placement
    group and no memlock drop-in."""
    seen = 0
    for rendered in rendered_stacks.values():
        templates = _templates(rendered.result)
        for group in _gpu_groups(rendered.result).values():
            if catalog.lookup(group.inputs["instanceTypes"][0]).efa:
                continue
            seen += 1
            assert not group.inputs.get("enableIMDSv2") and not group.inputs.get("enableEfaSupport")
            assert mng_root_volume(group.inputs, templates) == {"source": "own-template", "encrypted": True}
            lt = templates[group.inputs["launchTemplate"]["id"]]
            assert not lt.get("placement")
            assert all("interfaceType" not in n for n in lt.get("networkInterfaces") or [])
            user_data = base64.b64decode(lt["userData"]).decode() if lt.get("userData") else ""
            assert "LimitMEMLOCK" not in user_data
    assert seen
