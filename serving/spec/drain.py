"""Graceful drain: how long each part may take to stop, derived from the longest stream allowed.

What flows through here: the serving spec's deadlines (`serving.resilience`) -> a `DrainPlan`
whose values the Serve config (`graceful_shutdown_*` per deployment, serving/spec/serving.py) and the
RayService (`rayClusterDeletionDelaySeconds`, the pods' `terminationGracePeriodSeconds` and
Ray's SIGTERM drain, infra/k8s/rayservice.py) render. One derivation, so the Serve drain, the
node drain and the old cluster's life after a NewCluster switch cannot disagree.
The standard library and the spec's models only (the Pulumi program imports it).
docs/resilience.md, "Graceful drain".

The upstream behaviour each value answers, read in the sources named:
- Ray Serve 2.60 stops a replica (scale-in, a config update that restarts it, a replica on a
  draining node) by calling its `perform_graceful_shutdown`: the replica waits, polling every
  `graceful_shutdown_wait_loop_s`, until it has no ongoing request, and the controller kills it
  `graceful_shutdown_timeout_s` after the stop whatever is left (python/ray/serve/_private/
  replica.py `_drain_ongoing_requests`, deployment_state.py `DeploymentReplica.stop` and
  `check_stopped`). A streamed response is an ongoing request until its last chunk
  (replica.py `handle_request_streaming` holds `_start_request` around the whole stream).
- Ray 2.60's `ray start --block` (the Ray container's main process under KubeRay) answers
  SIGTERM by marking its node draining for `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` (default
  30 s) before killing its processes (python/ray/_private/node.py `_drain_node_before_shutdown`,
  ray_constants.py). Serve then stops the node's replicas gracefully and its proxy drains its
  ongoing requests (deployment_state.py `migrate_replicas_on_draining_nodes`: a replica is
  stopped once the node's deadline minus its graceful_shutdown_timeout_s has come).
- KubeRay 1.7 deletes the old RayCluster of a NewCluster switch a fixed delay after the switch
  (rayservice_controller.go `cleanUpRayClusterInstance`), waiting for nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serving.spec.roles import ResilienceSpec

# Ray Serve 2.60's defaults (python/ray/serve/_private/constants.py
# DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S, DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S): a replica is
# killed 20 s after it was asked to stop, which cuts any stream longer than that.
RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 20.0
RAY_DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 2.0
# How often a stopping replica checks for ongoing requests: Ray's own period, stated so that a
# change of Ray's default cannot move the bounds below. The last stream may end just after a
# check, so each bound adds one period.
DRAIN_POLL_S = RAY_DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S

# Ray 2.60's SIGTERM drain of a node (python/ray/_private/ray_constants.py; default 30 s,
# "cluster managers (e.g. KubeRay) tune it, typically to just under the pod termination grace
# period"). KubeRay 1.7 does not set it (no mention in ray-operator/).
NODE_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# Kubernetes' default terminationGracePeriodSeconds (k8s.io/api core/v1 types.go
# DefaultTerminationGracePeriodSeconds): what the pods had before this, kept on top of the node
# drain for the teardown after it (Ray 2.60 node.py `kill_all_processes`: SIGTERM, then up to
# 1 s per process before SIGKILL).
K8S_DEFAULT_TERMINATION_GRACE_S = 30
# KubeRay 1.7's default rayClusterDeletionDelaySeconds (rayservice_controller.go
# RayClusterDeletionDelayDuration = 60 s): its own allowance for traffic to leave the old
# cluster once the serve Service's selector has switched. Kept, and the longest stream added.
KUBERAY_DEFAULT_DELETION_DELAY_S = 60
# rayClusterDeletionDelaySeconds is an int32 (ray-operator/apis/ray/v1/rayservice_types.go;
# the CRD: format int32, minimum 0).
INT32_MAX = 2**31 - 1
# Pod-level values (grace period, node drain) are part of the RayCluster's spec hash: any
# change to them makes KubeRay build a new cluster (rayservice_controller.go
# shouldPrepareNewCluster). They are rounded up to this step so that tuning totalTimeoutS
# within it stays an in-place Serve update (infra/k8s/upgrades.py says which).
POD_DRAIN_STEP_S = 300


@dataclass(frozen=True)
class DrainPlan:
    """Seconds each part may take to stop without cutting what it serves.

    ingress_s: the ingress deployment. Its longest request is capped by Serve's proxy
      (`request_timeout_s` = totalTimeoutS + the proxy margin, serving/spec/serving.py), one poll more.
    engine_s: the decode (or aggregated) engine. Its stream ends when the ingress's total
      deadline ends it (the ingress cancels the call): totalTimeoutS, one poll more.
    prefill_s: the prefill engine. Decode cancels a prefill call after prefillQueueTimeoutS
      waiting for a replica plus prefillTimeoutS once one took it, so no call lasts longer; one
      poll more.
    proxy_request_s: the longest HTTP request a Serve proxy holds (its request_timeout_s).
    """

    ingress_s: float
    engine_s: float
    prefill_s: float
    proxy_request_s: float

    @classmethod
    def for_deadlines(cls, deadlines: ResilienceSpec, proxy_margin_s: float) -> DrainPlan:
        proxy = deadlines.total_timeout_s + proxy_margin_s
        return cls(
            ingress_s=proxy + DRAIN_POLL_S,
            engine_s=deadlines.total_timeout_s + DRAIN_POLL_S,
            prefill_s=deadlines.prefill_queue_timeout_s + deadlines.prefill_timeout_s + DRAIN_POLL_S,
            proxy_request_s=proxy,
        )

    def deployment_options(self, part: str) -> dict[str, Any]:
        """Serve deployment options of `part` (ingress, engine, prefill)."""
        timeout = {"ingress": self.ingress_s, "engine": self.engine_s, "prefill": self.prefill_s}[part]
        return {"graceful_shutdown_timeout_s": timeout, "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}

    @property
    def node_drain_s(self) -> int:
        """RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S of every Ray pod: each runs a Serve proxy that
        may hold a client's stream (the pods that declare the serve port are the API's endpoints,
        infra/k8s/rayservice.py), and the head runs the ingress, so every pod waits for the ingress's bound; rounded up to
        POD_DRAIN_STEP_S. A node whose replicas and proxy finish earlier exits earlier."""
        return POD_DRAIN_STEP_S * math.ceil(self.ingress_s / POD_DRAIN_STEP_S)

    @property
    def termination_grace_s(self) -> int:
        """terminationGracePeriodSeconds of every Ray pod: the node drain plus the teardown."""
        return self.node_drain_s + K8S_DEFAULT_TERMINATION_GRACE_S

    @property
    def cluster_deletion_delay_s(self) -> int:
        """rayClusterDeletionDelaySeconds: KubeRay's own allowance for the switch, plus the
        longest stream an old-cluster proxy may still be serving when the selector moves."""
        delay = math.ceil(self.ingress_s) + KUBERAY_DEFAULT_DELETION_DELAY_S
        if delay > INT32_MAX:
            raise ValueError(
                f"serving.resilience.totalTimeoutS: the old cluster would have to live {delay} s after a "
                f"switch, more than KubeRay's rayClusterDeletionDelaySeconds can hold (int32, {INT32_MAX})"
            )
        return delay
