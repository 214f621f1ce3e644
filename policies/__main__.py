"""The policy pack's entry point: Pulumi runs this file; it only assembles the rules of policies/rules/.

What flows through here: `pulumi preview --policy-pack policies` starts this program in the
pack's own virtualenv -> `PolicyPack(...)` serves the rules over gRPC to the engine, which
sends it every resource of the preview. PolicyPack() never returns: nothing imports this file
(the tests import the policies.rules package).
"""

import sys
from pathlib import Path

from pulumi_policy import EnforcementLevel, PolicyPack

# Pulumi runs this file by path; make its sibling package importable however it is launched.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rules import POLICIES

PolicyPack(
    name="pd-inference-guardrails",
    # Each rule sets its own level; this is only the default for a rule that does not.
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=POLICIES,
    description="Guardrails for the pd-inference stacks: EKS control plane, GPU/EFA node pools, charts, images, "
    "the Ray head, secrets and ingress to the serving endpoint.",
)
