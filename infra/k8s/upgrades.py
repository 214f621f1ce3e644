"""What KubeRay will do with a changed RayService: update Serve in place, or build a new cluster.

What flows through here: the RayService manifest before and after a change -> a `Verdict`:
- "none": nothing KubeRay acts on changed;
- "serve-in-place": only serveConfigV2 changed; KubeRay sends it to the running cluster's
  Serve (no new pods, no extra GPUs);
- "cluster-in-place": only what KubeRay leaves out of the cluster hash changed (worker-group
  replicas/minReplicas/maxReplicas, tolerations, scheduling gates), or worker groups were
  appended; the running RayCluster is updated;
- "new-cluster": the rest of rayClusterConfig changed; with upgradeStrategy NewCluster a second
  cluster starts next to the running one (extra GPU nodes until it takes over); with None
  KubeRay ignores the change.
The rule is KubeRay 1.7's (ray-operator/controllers/ray/rayservice_controller.go
`shouldPrepareNewCluster`, `isClusterSpecHashEqual`; utils/util.go
`GenerateHashWithoutReplicasAndWorkersToDelete`). Pure data, no Pulumi.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from infra import catalog
from infra.k8s.labels import INSTANCE_TYPE_LABEL


@dataclass(frozen=True)
class Verdict:
    kind: str  # none | serve-in-place | cluster-in-place | new-cluster
    strategy: str
    extra_gpu_nodes: int = 0  # during the upgrade window (new-cluster with NewCluster)
    extra_usd_per_hour: float = 0.0

    def line(self, name: str) -> str:
        if self.kind == "none":
            return f"RayService {name}: no change KubeRay acts on"
        if self.kind == "serve-in-place":
            return f"RayService {name}: in-place Serve update (only serveConfigV2 changed): no new pods, no extra GPUs"
        if self.kind == "cluster-in-place":
            return f"RayService {name}: the running Ray cluster is updated in place (replica bounds or appended groups)"
        if self.strategy == "None":
            return (
                f"RayService {name}: rayClusterConfig changed but upgradeStrategy is None: KubeRay will NOT apply it "
                "(replace the RayService by hand)"
            )
        return (
            f"RayService {name}: NEW Ray cluster ({self.strategy}; rayClusterConfig changed): +{self.extra_gpu_nodes} "
            f"GPU nodes, +${self.extra_usd_per_hour:,.2f}/h on demand while both clusters run"
        )


def _for_hash(cluster: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(cluster)
    spec.pop("upgradeStrategy", None)
    head = spec.get("headGroupSpec", {}).get("template", {}).get("spec", {})
    head.pop("tolerations", None)
    head.pop("schedulingGates", None)
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
        pod = group.get("template", {}).get("spec", {})
        pod.pop("tolerations", None)
        pod.pop("schedulingGates", None)
    return spec


def _new_cluster_cost(cluster: dict[str, Any]) -> tuple[int, float]:
    """GPU nodes (and their price) the new cluster starts with: each group's `replicas`."""
    nodes, usd = 0, 0.0
    for group in cluster.get("workerGroupSpecs", []):
        selector = group.get("template", {}).get("spec", {}).get("nodeSelector", {})
        inst = catalog.CATALOG.get(selector.get(INSTANCE_TYPE_LABEL, ""))
        if inst is None:
            continue
        count = int(group.get("replicas", group.get("minReplicas", 0))) * int(group.get("numOfHosts", 1))
        nodes += count
        usd += count * inst.usd_per_hour
    return nodes, usd


def classify(before: dict[str, Any], after: dict[str, Any]) -> Verdict:
    """What KubeRay does when the RayService `before` becomes `after` (manifests)."""
    a, b = before.get("spec", {}), after.get("spec", {})
    strategy = (b.get("upgradeStrategy") or {}).get("type", "NewCluster")
    ca, cb = a.get("rayClusterConfig", {}), b.get("rayClusterConfig", {})
    ha, hb = _for_hash(ca), _for_hash(cb)
    if ha == hb:
        if ca != cb:
            return Verdict("cluster-in-place", strategy)
        return Verdict("serve-in-place" if a.get("serveConfigV2") != b.get("serveConfigV2") else "none", strategy)
    groups_a, groups_b = ha.get("workerGroupSpecs", []), hb.get("workerGroupSpecs", [])
    appended = {**hb, "workerGroupSpecs": groups_b[: len(groups_a)]}
    if len(groups_b) > len(groups_a) and appended == ha:
        return Verdict("cluster-in-place", strategy)
    if strategy == "None":
        return Verdict("new-cluster", strategy)
    nodes, usd = _new_cluster_cost(cb)
    return Verdict("new-cluster", strategy, nodes, usd)
