"""Nodes and replicas: the one place that turns GPUs per replica into nodes and pods.

What flows through here: an engine replica's GPU count (TP x PP) and its instance type's GPUs
per node -> nodes one replica spans, replicas one node holds, and the nodes (= Ray worker
pods) that a number of replicas needs. The config's checks, the capacity plan and the
RayService's worker-group sizes all take their figures from here.
"""

from __future__ import annotations


def nodes_per_replica(gpus_per_replica: int, gpus_per_node: int) -> int:
    """Nodes one replica spans: 1 when it fits one node, else whole nodes (ceil)."""
    return -(-gpus_per_replica // gpus_per_node)


def replicas_per_node(gpus_per_replica: int, gpus_per_node: int) -> int:
    """Replicas that share one node (at least 1; a multi-node replica owns its nodes)."""
    return max(1, gpus_per_node // gpus_per_replica)


def nodes_for(replicas: int, gpus_per_replica: int, gpus_per_node: int) -> int:
    """Nodes (one Ray worker pod each) that hold `replicas` replicas."""
    per_node = replicas_per_node(gpus_per_replica, gpus_per_node)
    return -(-replicas // per_node) * nodes_per_replica(gpus_per_replica, gpus_per_node)


def upgrade_peak_nodes(
    strategy: str,
    min_replicas: int,
    max_replicas: int,
    initial_replicas: int | None,
    gpus_per_replica: int,
    gpus_per_node: int,
) -> int:
    """Nodes a role needs at the peak of a RayService upgrade that replaces the Ray cluster.

    NewCluster (KubeRay rayservice_controller.go): the new cluster starts next to the old one
    and takes the traffic once ready, so the worst case is the old cluster at maxReplicas
    plus the new one at its starting replicas (initialReplicas, else minReplicas; Serve's
    autoscaling starts there). None never builds a second cluster.
    """
    running = nodes_for(max_replicas, gpus_per_replica, gpus_per_node)
    if strategy == "None":
        return running
    start = initial_replicas or min_replicas
    return running + nodes_for(start, gpus_per_replica, gpus_per_node)
