"""The Ray node labels our RayService gives each group are Ray's to accept, and leave Ray's own.

Contracts:
- ray-project/ray 2.60.0 `python/ray/_private/label_utils.py` `validate_node_labels` and
  `ray_constants.RAY_DEFAULT_LABEL_KEYS_PREFIX`: custom node labels under `ray.io/` are refused
  (Ray sets `ray.io/node-group`, `ray.io/market-type`, ... itself,
  `resource_and_label_spec.py` `_get_default_labels`).
- ray-project/kuberay v1.7.0 `ray-operator/controllers/ray/common/pod.go`
  `updateRayStartParamsLabels`: a group's `labels` become `ray start --labels`; the string path
  only checks syntax, so a `ray.io/` key got through by accident and, on the head, replaced
  Ray's own `ray.io/node-group: headgroup`.
Reproduced in tests.upstream.ray_custom_label_errors (checked against the installed Ray).
"""

from __future__ import annotations

import pytest

from serving.spec import DEFAULT_LABEL_KEY, PlacementSpec
from tests.conftest import STACKS
from tests.upstream import ray_custom_label_errors


def _groups(stack) -> list[dict]:
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("name", STACKS)
def test_every_groups_labels_are_custom_labels_ray_accepts(rendered_stacks, name):
    for group in _groups(rendered_stacks[name]):
        labels = group.get("labels") or {}
        assert labels, group.get("groupName", "head")
        assert ray_custom_label_errors(labels) == [], group.get("groupName", "head")


def test_the_rule_bites_on_yesterdays_key():
    assert ray_custom_label_errors({"ray.io/node-group": "head"}) != []


def test_a_ray_io_placement_key_is_refused():
    with pytest.raises(ValueError, match="reserved for Ray"):
        PlacementSpec(label_key="ray.io/node-group")
    assert not DEFAULT_LABEL_KEY.startswith("ray.io/")


@pytest.mark.parametrize("labels", [{"ray.io/node-group": "head"}, {DEFAULT_LABEL_KEY: "head"}])
def test_mirror_agrees_with_installed_ray(labels):
    """Sanity check of the mirror against the installed Ray (skipped where Ray is absent)."""
    label_utils = pytest.importorskip("ray._private.label_utils")
    try:
        label_utils.validate_node_labels(labels)
        refused = False
    except ValueError:
        refused = True
    assert refused == bool(ray_custom_label_errors(labels))
