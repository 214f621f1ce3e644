"""The guardrails: CrossGuard rules that `pulumi preview --policy-pack policies` runs.

What flows through here: for every resource the program registers, Pulumi hands each rule
the resource's type and its inputs (for pulumi-eks's Cluster/ManagedNodeGroup and Helm v4
Charts, the component's own camelCase inputs; their children arrive as ordinary AWS and
Kubernetes resources) -> `inputs.plain()` turns them into plain data, with values that cannot
be known during a preview replaced by `UNKNOWN` -> a check yields one message per violation,
each saying how to fix it -> Pulumi prints it and, for mandatory rules, fails the preview.

A value that is unknown during a preview passes here: `pulumi up` runs the same rules again
on every resource with its inputs resolved, before it is created.

The modules, by what their rules guard (a reader who asks "what does the pack demand of the
nodes?" opens one file, and each file's rules read the same resource types):
- `inputs`: how a resource reaches a check (plain data, `UNKNOWN`, the stack's Context, the
  validator that reports each message) and the resource types, named once;
- `manifests`: where pods, containers and the Serve config sit in Kubernetes and KubeRay
  resources, shared by the rules that read them;
- `control_plane`: the EKS API endpoint, Secrets encryption and control-plane logs;
- `nodes`: IMDSv2, the GPU taint, EFA placement and spot capacity of the node groups;
- `workloads`: pinned images and charts, the Ray head without GPUs, NIXL on the right fabric;
- `secrets`: credentials only by Secret reference;
- `network`: no ingress from the whole internet, and the fallback only over https;
- `pack`: every rule with its name, level and description, in the pack's order.
Rule modules import only `inputs` and `manifests` (and `control_plane` takes `open_cidr` from
`network`, so "the whole internet" is defined once); `pack` imports them all.

This package needs only pulumi-policy, pulumi and PyYAML (the pack's own virtualenv): nothing
from infra/. Its modules import each other relatively, so the package loads both as `rules`
(`__main__.py`, run by path, only assembles `POLICIES` into a PolicyPack) and as
`policies.rules` (the tests).
"""

from .pack import ADVISORY, BY_NAME, MANDATORY, POLICIES, RULES, Rule

__all__ = ["ADVISORY", "BY_NAME", "MANDATORY", "POLICIES", "RULES", "Rule"]
