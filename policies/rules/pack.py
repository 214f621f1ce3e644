"""The pack: every rule with its name, description and enforcement level, in the pack's order.

What flows through here: each module's checks -> a `Rule` (name, description, level, check,
config schema) -> `RULES` in the order the pack lists them -> `POLICIES`, the
ResourceValidationPolicies `policies/__main__.py` hands to PolicyPack (each check wrapped by
`inputs.validator`); `BY_NAME` for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from pulumi_policy import EnforcementLevel, PolicyConfigSchema, ResourceValidationPolicy

from .control_plane import (
    check_control_plane_logging,
    check_endpoint_allow_list,
    check_public_endpoint,
    check_secrets_encryption,
)
from .inputs import Check, validator
from .network import check_fallback_https, check_no_open_ingress
from .nodes import check_efa_single_zone, check_gpu_taint, check_imdsv2, check_spot_in_prod
from .secrets import check_secrets_by_reference
from .workloads import check_helm_pinned, check_images_pinned, check_nixl_backend, check_ray_head_no_gpu


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    level: EnforcementLevel
    check: Check
    config_schema: PolicyConfigSchema | None = None

    def policy(self) -> ResourceValidationPolicy:
        return ResourceValidationPolicy(
            name=self.name,
            description=self.description,
            enforcement_level=self.level,
            validate=validator(self.check),
            config_schema=self.config_schema,
        )


MANDATORY = EnforcementLevel.MANDATORY
ADVISORY = EnforcementLevel.ADVISORY
_STACK_SCHEMA = PolicyConfigSchema(
    properties={
        "prodStacks": {"type": "array", "items": {"type": "string"}, "default": ["prod"]},
        "stack": {"type": "string", "description": "the stack name, when the URN does not say it"},
    }
)

RULES: list[Rule] = [
    Rule(
        "eks-endpoint-allow-list",
        "The EKS API endpoint is private, or public only to a CIDR allow-list.",
        MANDATORY,
        check_endpoint_allow_list,
    ),
    Rule(
        "eks-secrets-encryption",
        "Kubernetes Secrets are envelope-encrypted with a KMS key.",
        MANDATORY,
        check_secrets_encryption,
    ),
    Rule(
        "eks-control-plane-logging",
        "The api, audit and authenticator control-plane logs are on.",
        MANDATORY,
        check_control_plane_logging,
    ),
    Rule(
        "nodes-imdsv2-required",
        "Nodes require IMDSv2 with a hop limit of 1 (node groups and their launch templates).",
        MANDATORY,
        check_imdsv2,
    ),
    Rule("gpu-nodes-tainted", "GPU node groups carry the nvidia.com/gpu NoSchedule taint.", MANDATORY, check_gpu_taint),
    Rule(
        "efa-single-zone",
        "EFA node groups sit in one subnet (one zone) with a placement group or capacity block.",
        MANDATORY,
        check_efa_single_zone,
    ),
    Rule("helm-charts-pinned", "Helm charts are pinned to an exact version.", MANDATORY, check_helm_pinned),
    Rule(
        "images-pinned",
        "Container images carry a release tag or a digest, never latest/nightly or none.",
        MANDATORY,
        check_images_pinned,
    ),
    Rule(
        "ray-head-no-gpu",
        "The Ray head asks for no GPU (num-gpus 0, no nvidia.com/gpu).",
        MANDATORY,
        check_ray_head_no_gpu,
    ),
    Rule(
        "nixl-backend-matches-fabric",
        "NIXL moves the KV cache with LIBFABRIC on EFA worker groups and UCX elsewhere.",
        MANDATORY,
        check_nixl_backend,
    ),
    Rule(
        "secrets-by-reference",
        "Tokens, keys and passwords reach pods only by Secret reference.",
        MANDATORY,
        check_secrets_by_reference,
    ),
    Rule(
        "no-open-ingress",
        "Nothing admits 0.0.0.0/0 or ::/0 (Services, NetworkPolicies, security groups).",
        MANDATORY,
        check_no_open_ingress,
    ),
    Rule(
        "fallback-https-outside-dev",
        "The external fallback (serving.fallback.baseUrl) is https outside dev stacks.",
        MANDATORY,
        check_fallback_https,
        PolicyConfigSchema(
            properties={
                "devStacks": {"type": "array", "items": {"type": "string"}, "default": ["dev"]},
                "stack": {"type": "string", "description": "the stack name, when the URN does not say it"},
            }
        ),
    ),
    Rule(
        "no-spot-in-prod", "Prod node groups do not run on spot capacity.", ADVISORY, check_spot_in_prod, _STACK_SCHEMA
    ),
    Rule("eks-endpoint-private", "The EKS API endpoint is private (any stack).", ADVISORY, check_public_endpoint),
]

POLICIES: list[ResourceValidationPolicy] = [r.policy() for r in RULES]
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
