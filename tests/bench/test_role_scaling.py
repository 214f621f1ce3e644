"""bench/role_scaling.py dry: the `--signals` stack, built without Ray (tests/bench/dry_run.py):
each role autoscales 1 -> 2 on its own engine signals, in the app role_replicas reads."""

from __future__ import annotations

import inspect

from bench import role_scaling
from tests.bench import dry_run


def test_each_role_autoscales_on_its_own_signals_in_the_app_it_watches():
    stack = dry_run.plan(role_scaling.stack_options())
    built = dry_run.build(stack.config)
    app = inspect.signature(role_scaling.role_replicas).parameters["app"].default
    assert list(built) == [app]
    roles = {role: [d for d in built[app] if role in d.lower()] for role in ("prefill", "decode")}
    assert all(len(deps) == 1 for deps in roles.values()), roles
    for (dep,) in roles.values():
        assert built[app][dep] == dry_run.Replicas(1, 2)
    args = stack.config["applications"][0]["args"]
    policies = {r: args[f"{r}_config"]["deployment_config"]["autoscaling_config"]["policy"] for r in roles}
    assert all(p["policy_function"].startswith("serving.engines.autoscaling:") for p in policies.values())
    assert policies["prefill"] != policies["decode"]
