"""The serving spec's per-model parts: where a model's roles run, its LoRA adapters, and the
`serving.models` list of a stack that serves several models from one cluster.

What flows through here: the keys of one model (a `serving.models[i]` entry, or the same keys
at the top of `serving:` in the one-model form) -> validated pydantic models that
serving/spec/serving.py's ServingSpec composes. `PER_MODEL_KEYS` names the keys that belong to one
model; every other `serving:` key (ingress, auth, placement, streaming, resilience, fallback,
limits) is shared by all models behind the one front door. pydantic and the standard library only.

LoRA facts, each read in the installed sources:
- Ray Serve LLM 2.60 `LLMConfig.lora_config` (ray/llm/_internal/serve/core/configs/llm_config.py
  `LoraConfig`): `dynamic_lora_loading_path` (s3://, gs://, abfss://, azure://; trailing "/"
  dropped) and `max_num_adapters_per_replica` (default 16); an adapter is addressed as
  `<model id>:<adapter>` and loaded from `<path>/<adapter>` through Serve multiplexing.
- Ray does not switch vLLM's LoRA support on: `enable_lora`, `max_lora_rank` (one of 1, 8, 16,
  32, 64, 128, 256, 320, 512) and `max_loras` are engine kwargs (vllm/config/lora.py,
  `MaxLoRARanks`, 0.32).
- P/D: Ray 2.60's P/D builder accepts LoRA when both legs carry the same loading path
  (serving_patterns/prefill_decode/builder.py `_validate_lora_configs`), and its decode server
  passes the request's multiplexed model id to the prefill handle so that prefill loads the
  same adapter (pd_server.py). vLLM's NIXL connectors move KV blocks by block id with no LoRA
  check (kv_connector/v1/nixl/, 0.32). So LoRA is allowed on P/D models; the spec renders the
  same `lora_config` and LoRA engine kwargs on both roles.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from serving.spec.base import Mode, SpecModel
from serving.spec.roles import KvTransferSpec, ModelSpec, RoleSpec, SloSpec

# A node pool's name: a Kubernetes label value, an EKS node group name part and a Ray worker
# group name (KubeRay names pods <cluster>-<group>-worker-<hash>: kept short).
POOL_NAME = re.compile(r"^[a-z][a-z0-9-]{0,22}[a-z0-9]$")
# Names that already mean something else: the Ray head's group and the CPU system nodes.
RESERVED_POOL_NAMES = frozenset({"head", "system", "headgroup"})
# vLLM 0.32 vllm/config/lora.py MaxLoRARanks (the same set in 0.29).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What joins an adapter to its base model in a request's `model` (`<model id>:<adapter>`): Ray
# Serve LLM 2.60 reads the base model as `model.split(":")[0]`
# (ray/llm/_internal/common/utils/lora_utils.py `get_base_model_id`); a model id has no ":".
ADAPTER_SEP = ":"
# Ray Serve LLM's remote-path check for dynamic_lora_loading_path; the stack's pods read S3 only.
_ADAPTERS_PATH = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](?:/[A-Za-z0-9._/-]*)?$")

# The `serving:` keys that describe one model (camelCase, as in a stack file). In the one-model
# form they sit at the top of `serving:`; in the many-model form each `serving.models[i]` has
# them and none may sit at the top.
PER_MODEL_KEYS = (
    "model",
    "mode",
    "prefill",
    "decode",
    "kvTransfer",
    "engineKwargs",
    "slo",
    "pools",
    "lora",
)


def base_model_id(model: str) -> str:
    """The served model a request's `model` names: itself, or an adapter's base model
    (`qwen:tenant-a` -> `qwen`), as Ray Serve LLM routes it."""
    return model.split(ADAPTER_SEP, 1)[0]


def pool_name_problem(name: str) -> str | None:
    if not POOL_NAME.match(name):
        return f"{name!r} is not a pool name (lowercase letters, digits and '-', 2-24 characters, a letter first)"
    if name in RESERVED_POOL_NAMES:
        return f"{name!r} is reserved ({', '.join(sorted(RESERVED_POOL_NAMES))})"
    return None


class RolePools(SpecModel):
    """Which node pool (a `nodePools` name) each engine role of a model runs on.

    A role not given runs on the pool named after it (`prefill`, `decode`), which is what a
    one-model stack has always done. The aggregated engine is the `decode` role.
    """

    prefill: str | None = None
    decode: str | None = None

    @field_validator("prefill", "decode")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        problem = pool_name_problem(v) if v is not None else None
        if problem:
            raise ValueError(problem)
        return v

    def pool(self, role: str) -> str:
        chosen: str | None = getattr(self, role)
        return chosen or role


class LoraSpec(SpecModel):
    """LoRA adapters loaded on demand from S3 (Ray Serve LLM multiplexing; see module doc)."""

    # s3://bucket/prefix holding one folder per adapter: `<model id>:<folder>` selects it.
    adapters_path: str
    # Ray's max_num_adapters_per_replica: adapters kept loaded per replica (LRU beyond it).
    max_adapters_per_replica: int = Field(default=16, ge=1, le=256)
    # vLLM's max_lora_rank: the largest adapter rank the engine accepts.
    max_lora_rank: int = 16
    # vLLM's max_loras: adapters in one batch (vLLM's default is 1).
    max_loras: int = Field(default=4, ge=1, le=256)

    @field_validator("adapters_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not _ADAPTERS_PATH.match(v) or ".." in v:
            raise ValueError(f"{v!r} is not an s3://bucket/prefix (the pods read adapters from S3 only)")
        return v.rstrip("/")

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v not in VLLM_LORA_RANKS:
            raise ValueError(f"{v} is not a rank vLLM accepts (one of {list(VLLM_LORA_RANKS)}, vllm/config/lora.py)")
        return v

    def llm_config(self) -> dict[str, object]:
        """LLMConfig.lora_config (Ray Serve LLM 2.60 LoraConfig's field names)."""
        return {
            "dynamic_lora_loading_path": self.adapters_path,
            "max_num_adapters_per_replica": self.max_adapters_per_replica,
        }

    def engine_kwargs(self) -> dict[str, object]:
        """vLLM's LoRA switches (vllm/config/lora.py LoRAConfig, vllm/engine/arg_utils.py)."""
        return {
            "enable_lora": True,
            "max_lora_rank": self.max_lora_rank,
            "max_loras": min(self.max_loras, self.max_adapters_per_replica),
        }

    @property
    def bucket(self) -> str:
        return self.adapters_path[len("s3://") :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """The key prefix of the adapters in their bucket ("" for the whole bucket)."""
        parts = self.adapters_path[len("s3://") :].split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""


class ModelEntry(SpecModel):
    """One `serving.models[i]`: a model, its engines and the pools they run on.

    The same keys, with the same defaults, as the one-model form's top of `serving:`
    (`PER_MODEL_KEYS`); a test keeps the two in step.
    """

    model: ModelSpec
    mode: Mode = Mode.DISAGGREGATED
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    engine_kwargs: dict[str, object] = Field(default_factory=dict)
    slo: SloSpec = Field(default_factory=SloSpec)
    pools: RolePools = Field(default_factory=RolePools)
    lora: LoraSpec | None = None


def duplicate_model_ids(entries: tuple[ModelEntry, ...]) -> list[str]:
    seen: set[str] = set()
    dup = []
    for e in entries:
        if e.model.id in seen:
            dup.append(e.model.id)
        seen.add(e.model.id)
    return dup
