"""The EFA device plugin's DaemonSet affinity, as the chart renders it from our values.

Contract: aws/eks-charts `stable/aws-efa-k8s-device-plugin` chart v0.5.30 (plugin v0.5.20),
`templates/daemonset.yaml`: `affinity.nodeAffinity.required...nodeSelectorTerms` is built ONLY
from `supportedInstanceLabels` (one term per `keys` entry: `<key> In <values>`, the last term
also `eks.amazonaws.com/compute-type NotIn [auto]`); a top-level `affinity` value is not read.
Helm merges our values over the chart's `values.yaml`: maps deep, lists replaced whole.
Reproduced in `tests.upstream.efa_daemonset_affinity`; the assertions are on its output.
"""

from __future__ import annotations

from infra import catalog, versions
from tests.upstream import efa_daemonset_affinity, node_matches

# Part of the chart's own default `supportedInstanceLabels.values` (v0.5.30 values.yaml): types
# the plugin would be scheduled on if our list did not replace it. g5.8xlarge-g6e.48xlarge are
# EFA-capable at those sizes, but not in this project's catalog as EFA pools.
CHART_DEFAULT_SAMPLE = ["g5.12xlarge", "g5.48xlarge", "g6e.12xlarge", "p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge"]


def _efa_values(rendered) -> dict:
    charts = {c.inputs["chart"]: c.inputs for c in rendered.result.of_type("kubernetes:helm.sh/v4:Chart")}
    return charts["aws-efa-k8s-device-plugin"]


def test_chart_version_is_current():
    assert versions.EFA_DEVICE_PLUGIN.version == "v0.5.30"


def test_daemonset_affinity_lists_exactly_the_catalogs_efa_types(rendered_stacks):
    efa_types = {t for t, i in catalog.CATALOG.items() if i.efa}
    for stack, rendered in rendered_stacks.items():
        values = _efa_values(rendered)["values"]
        affinity = efa_daemonset_affinity(values, CHART_DEFAULT_SAMPLE)
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert len(terms) == 1, stack
        listed = terms[0]["matchExpressions"][0]
        assert listed["key"] == "node.kubernetes.io/instance-type" and listed["operator"] == "In"
        assert set(listed["values"]) == efa_types, stack
        # Scheduled on every EFA type of the catalog, on no other GPU type of it.
        for name, inst in catalog.CATALOG.items():
            assert node_matches(affinity, {"node.kubernetes.io/instance-type": name}) is inst.efa, (stack, name)


def test_the_affinity_value_alone_would_have_been_ignored():
    """Yesterday's values: `affinity` only. The chart then falls back to its own list, which
    includes g5.12xlarge, a type this catalog runs without EFA: the plugin pod would land there."""
    old = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]}
                            ]
                        }
                    ]
                }
            }
        }
    }
    affinity = efa_daemonset_affinity(old, CHART_DEFAULT_SAMPLE)
    assert not catalog.lookup("g5.12xlarge").efa
    assert node_matches(affinity, {"node.kubernetes.io/instance-type": "g5.12xlarge"})


def test_auto_mode_nodes_stay_excluded(rendered_stacks):
    values = _efa_values(next(iter(rendered_stacks.values())))["values"]
    affinity = efa_daemonset_affinity(values, CHART_DEFAULT_SAMPLE)
    labels = {"node.kubernetes.io/instance-type": "p5.48xlarge", "eks.amazonaws.com/compute-type": "auto"}
    assert not node_matches(affinity, labels)
