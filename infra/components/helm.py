"""Helm releases as the components declare them.

What flows through here: a pinned chart from infra/versions.py, its namespace and values ->
a `kubernetes.helm.v4.Chart` through the cluster's provider, after whatever it depends on
(its namespace, at least, when the component creates one).
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_kubernetes as k8s

from infra.versions import HelmChart


def release(
    owner: pulumi.ComponentResource,
    name: str,
    chart: HelmChart,
    namespace: str,
    values: pulumi.Input[dict],
    provider: k8s.Provider,
    depends_on: Sequence[pulumi.Resource] = (),
    release_name: str | None = None,
) -> k8s.helm.v4.Chart:
    """release_name: the Helm release's name when other objects select on it (default: `name`).
    `values` may be an Output (values that name other resources carry them as dependencies)."""
    return k8s.helm.v4.Chart(
        name,
        name=release_name,
        chart=chart.chart,
        version=chart.version,
        repository_opts=k8s.helm.v4.RepositoryOptsArgs(repo=chart.repo),
        namespace=namespace,
        values=values,
        opts=pulumi.ResourceOptions(parent=owner, provider=provider, depends_on=list(depends_on)),
    )
