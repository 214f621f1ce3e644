"""Scale to zero: which stacks may let an engine role go to 0 replicas, and what its cold start needs.

A role with `serving.<role>.minReplicas: 0` is rendered as Serve `min_replicas: 0` (with
`initial_replicas: 1`, serving/spec/serving.py `RoleSpec.starting_replicas`); Serve's policy wrapper
scales it 0 -> 1 at once when a request waits (ray/serve/autoscaling_policy.py
`_get_cold_start_scale_up_replicas`, Ray 2.60), then the KubeRay autoscaler adds a worker pod
and the Cluster Autoscaler a node when the pool is at zero. That takes the planner's time to
serve (`make plan`: "First request after idle"), minutes for large models.

Config-side checks (one line each, naming the key):
- prod may not scale an engine role to zero: the first request after idle would wait minutes;
- the first request after idle reaches decode (or the aggregated engine) first: with no decode
  replica running, the ingress answers from the fallback only when `serving.fallback.when`
  lists `unavailable`; a configured fallback without it is refused for a decode at zero. (A
  prefill at zero is bridged by decode itself, which prefills locally while prefill starts.)

No Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

from serving.spec import FallbackWhen, Mode, ServingSpec


def scale_to_zero_errors(environment: str, serving: ServingSpec) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    for role, spec in serving.engine_roles().items():
        if spec.min_replicas != 0:
            continue
        key = f"serving.{role}.minReplicas"
        if environment == "prod":
            errors.append(
                (
                    key,
                    "0 (scale to zero) is for dev and staging only: in prod the first request after idle would wait for a new engine",
                )
            )
        front = role == "decode" or serving.mode is Mode.AGGREGATED
        fb = serving.fallback
        if front and fb is not None and FallbackWhen.UNAVAILABLE not in fb.when:
            errors.append(
                (
                    "serving.fallback.when",
                    f"must list 'unavailable' while {key} is 0: the first request after idle finds no "
                    "decode replica and the fallback is what answers it while the engine starts",
                )
            )
    return errors
