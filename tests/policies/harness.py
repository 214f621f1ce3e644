"""Running the policy pack's rules the way the Pulumi engine does, without the engine.

What flows through here: a registered resource (type, name, inputs as the mock runtime saw
them, secrets still wrapped) -> the analyzer's own steps: `deserialize_properties` (unwraps
secrets) and `unknown_checking_proxy` -> `pulumi_policy.ResourceValidationArgs` with a URN
naming the stack -> the policy's real `validate` -> the messages it reported.
"""

from __future__ import annotations

import copy
from typing import Any

from pulumi_policy import PolicyCustomTimeouts, PolicyResourceOptions, ResourceValidationArgs
from pulumi_policy.deserialize import deserialize_properties
from pulumi_policy.proxy import unknown_checking_proxy

from policies import rules
from policies.rules.inputs import PROJECT
from tools.mock_runtime import Registered


def args_for(
    type_: str, name: str, inputs: dict[str, Any], stack: str, config: dict[str, Any] | None = None
) -> ResourceValidationArgs:
    props = unknown_checking_proxy(deserialize_properties(copy.deepcopy(inputs)))
    opts = PolicyResourceOptions(
        protect=False,
        ignore_changes=[],
        delete_before_replace=None,
        aliases=[],
        custom_timeouts=PolicyCustomTimeouts(0, 0, 0),
        additional_secret_outputs=[],
        parent=None,
    )
    urn = f"urn:pulumi:{stack}::{PROJECT}::{type_}::{name}"
    return ResourceValidationArgs(type_, props, urn, name, opts, None, config, {})


def violations(
    rule: rules.Rule, type_: str, name: str, inputs: dict[str, Any], stack: str, config: dict[str, Any] | None = None
) -> list[str]:
    """Messages `rule` reports for one resource, through its real ResourceValidationPolicy."""
    found: list[str] = []
    policy = rule.policy()
    result = policy.validate(args_for(type_, name, inputs, stack, config), lambda msg, urn=None: found.append(msg))
    assert result is None  # the rules are synchronous
    return found


def scan(resources: list[Registered], stack: str) -> dict[str, list[tuple[str, str]]]:
    """rule name -> [(resource name, message)] for every rule over every resource."""
    out: dict[str, list[tuple[str, str]]] = {r.name: [] for r in rules.RULES}
    for res in resources:
        for rule in rules.RULES:
            for msg in violations(rule, res.type, res.name, res.inputs, stack):
                out[rule.name].append((res.name, msg))
    return out
