"""The stack model composed from its parts (`infra/model/stack/`): no key and no check lost.

What flows through here: the part models `StackConfig` inherits from -> their fields and
validators, compared with what `StackConfig` runs. pydantic keys validators by function name
across bases, so two parts with a same-named validator would silently drop one check (a
`publicAccessCidrs` of 0.0.0.0/0 would pass); the refusals themselves are asserted in
test_config.py and test_hostile_configs.py.
"""

from __future__ import annotations

from infra import config
from infra.config.errors import ConfigError

PARTS = [b for b in config.StackConfig.__mro__[1:] if b.__name__.endswith("Keys")]


def test_every_key_comes_from_exactly_one_part():
    owners: dict[str, list[str]] = {}
    for part in PARTS:
        for name in part.model_fields:
            owners.setdefault(name, []).append(part.__name__)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    assert set(owners) == set(config.StackConfig.model_fields)


def test_every_validator_of_every_part_runs_in_the_stack_model():
    composed = config.StackConfig.__pydantic_decorators__
    for part in PARTS:
        own = part.__pydantic_decorators__
        for kind in ("field_validators", "model_validators"):
            for name, dec in getattr(own, kind).items():
                if name not in vars(part):
                    continue  # inherited from SpecModel, not the part's own
                kept = getattr(composed, kind).get(name)
                assert kept is not None and _plain(kept.func) is _plain(dec.func), f"{part.__name__}.{name} is shadowed"


def _plain(func):
    return getattr(func, "__func__", func)  # classmethod validators come bound to their class


def test_both_allow_lists_refuse_the_whole_internet():
    # The two CIDR allow-lists live in different parts and once shared a validator name.
    values = {
        "environment": "dev",
        "amiReleaseVersion": "1.35.6-20260714",
        "availabilityZones": ["us-east-2a", "us-east-2b"],
        "nodePools": {"prefill": {"instanceType": "g5.xlarge"}, "decode": {"instanceType": "g5.xlarge"}},
        "serving": {"model": {"id": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}, "auth": "disabled"},
    }
    for key in ("publicAccessCidrs", "serviceAllowedCidrs"):
        try:
            config.load({**values, key: ["0.0.0.0/0"]}, source="stacks/Pulumi.x.yaml")
        except ConfigError as e:
            assert str(e) == (
                f"stacks/Pulumi.x.yaml: {key}: '0.0.0.0/0' opens the endpoint to the whole internet; list your networks"
            )
        else:
            raise AssertionError(f"{key}: 0.0.0.0/0 was accepted")
