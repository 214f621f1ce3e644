"""What `make serve` deploys: the cloud's Serve config rendered for this machine's CPUs.

What flows through here: a mode and the tiny model's folder -> a CPU `ServingSpec` (float32,
eager mode) -> `ServingSpec.serve_config(Target(...))`, the SAME function that renders the
RayService's serveConfigV2 -> the config dict, with only the local overrides: the HTTP host
(127.0.0.1 instead of 0.0.0.0), and with `both` a second application (the aggregated one)
under its own name and route prefix. Everything under `args` is exactly what the spec renders.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from serving.spec import APP_NAME, Mode, ServingSpec, Target

MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 1024
AGGREGATED_APP = f"{APP_NAME}-aggregated"
AGGREGATED_PREFIX = "/aggregated"
HOST = "127.0.0.1"
MODES = ("disaggregated", "aggregated", "both")

# Logical CPUs per node. Ray only counts them (the OS shares the real cores); each engine
# replica takes 2 (its actor plus the vLLM worker bundle). The head offers none, as in the
# cloud: the ingress, proxy and controller ask for no CPU.
HEAD_CPUS = 0
PREFILL_CPUS = 2
DECODE_CPUS = 4


# Engine replicas per role: `--prefill-replicas/--decode-replicas`, or PD_REPLICAS=N for
# both (`make serve REPLICAS=2`), so that the retry paths have a second replica to go to.
REPLICAS_ENV = "PD_REPLICAS"
MAX_LOCAL_REPLICAS = 2

# Deadlines for the tiny model on two shared cores: a prefill takes tens of ms here, and a
# restarted engine needs one to two minutes, which the fallbacks must bridge.
LOCAL_RESILIENCE = {
    "prefillTimeoutS": 1.0,
    "prefillAttempts": 2,
    "kvReadyTimeoutS": 5.0,
    "firstTokenTimeoutS": 20.0,
    "totalTimeoutS": 120.0,
    "failFastS": 2.0,
    "decodeAttempts": 2,
    "circuitOpenS": 3.0,
    "retryAfterS": 1,
}
# Bounded queues per role, small enough that `make chaos`'s 3x burst overflows them.
LOCAL_ROLE_LIMITS = {"maxOngoingRequests": 16, "maxQueuedRequests": 16}


# --- what gets deployed ------------------------------------------------------------------
def local_spec(
    mode: Mode,
    model_dir: Path,
    *,
    auth: bool = True,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
) -> ServingSpec:
    """The spec a stack file would hold, with CPU-friendly values."""

    def role(n: int) -> dict[str, Any]:
        return {"minReplicas": n, "maxReplicas": n, **LOCAL_ROLE_LIMITS}

    return ServingSpec.model_validate(
        {
            "model": {
                "id": MODEL_ID,
                "source": str(model_dir),
                "dtype": "float32",
                "maxModelLen": MAX_MODEL_LEN,
            },
            "mode": mode.value,
            "auth": "api-key" if auth else "disabled",
            # One ingress replica: a second would only compete for the same two cores.
            "ingress": {"minReplicas": 1, "maxReplicas": 1},
            # No CUDA graphs on CPU.
            "engineKwargs": {"enforce_eager": True},
            "prefill": role(prefill_replicas),
            "decode": role(decode_replicas),
            "resilience": LOCAL_RESILIENCE,
        }
    )


def local_target() -> Target:
    """CPU target: vLLM's CPU KV-cache size and thread binding, nothing else."""
    return Target(
        accelerator_type=None,
        engine_env={
            # GiB of KV cache per engine; the tiny model needs far less.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Several engines share these cores, and each NIXL worker keeps a UCX progress
            # thread busy: pinning ('auto', or a core list) stacks them onto the same
            # cores and made decode ~9x slower per token here. Let the OS place threads.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        },
    )


def render_local_config(
    mode: str,
    model_dir: Path,
    *,
    port: int,
    auth: bool = True,
    target: Target | None = None,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
) -> dict[str, Any]:
    """The Serve config to deploy locally: serve_config() plus the local overrides."""
    target = target or local_target()
    modes = [Mode.DISAGGREGATED, Mode.AGGREGATED] if mode == "both" else [Mode(mode)]
    configs = [
        local_spec(
            m, model_dir, auth=auth, prefill_replicas=prefill_replicas, decode_replicas=decode_replicas
        ).serve_config(target, port=port)
        for m in modes
    ]
    config = copy.deepcopy(configs[0])
    config["http_options"]["host"] = HOST
    if mode == "both":
        agg = configs[1]["applications"][0]
        agg["name"] = AGGREGATED_APP
        agg["route_prefix"] = AGGREGATED_PREFIX
        config["applications"].append(agg)
    return config


def admission_bound(config: dict[str, Any]) -> int:
    """Requests the disaggregated app admits at once: decode's running plus queued slots
    (Serve's max_ongoing_requests per replica, max_queued_requests per caller)."""
    for app in config["applications"]:
        if app["args"]["mode"] == "disaggregated":
            dep = app["args"]["decode_config"]["deployment_config"]
            replicas = dep["autoscaling_config"]["max_replicas"]
            return int(dep["max_ongoing_requests"] * replicas + dep["max_queued_requests"])
    raise ValueError("no disaggregated application in the config")


def app_urls(config: dict[str, Any], port: int) -> dict[str, str]:
    """OpenAI base URL (…/v1) of each application, by its mode."""
    urls = {}
    for app in config["applications"]:
        prefix = app["route_prefix"].rstrip("/")
        urls[app["args"]["mode"]] = f"http://{HOST}:{port}{prefix}/v1"
    return urls
