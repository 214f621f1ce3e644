"""The front door's model catalogue (many-model form): which Serve application serves each model.

What flows through here: the ingress deployment's `user_config["models"]` (ServingSpec's
model_table(): model id, application name, mode, context length, adapters' path) -> one
`ModelCard` per model for `/v1/models`, the LoRA adapters' path per model, and, on the first
request for a model, a deployment handle to its application's ingress deployment (the decode
server of a P/D model, the LLMServer of an aggregated one) -> the ingress's routing tables,
which Ray Serve LLM's OpenAiIngress already reads (`_default_serve_handles`, `_model_cards`,
`_lora_paths`), so requests then follow Ray's own path, LoRA multiplexing included.

Why our own: Ray Serve LLM 2.60 builds its ingress with the engines' handles bound in one
application (build_openai_app), so adding a model changes that application's args and
redeploys every engine. Here each model is its own application and the front door learns the
models from its user_config, which Serve hands to `reconfigure` without restarting anything;
the handles are looked up by application name (`serve.get_app_handle`, public API).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

# ModelCard.owned_by as Ray's own cards say it (openai_api_models.to_model_metadata).
OWNED_BY = "organization-owner"


@dataclass(frozen=True)
class CatalogEntry:
    """One row of the model table (serving.spec.ServingSpec.model_table)."""

    model_id: str
    app_name: str
    mode: str
    max_model_len: int | None = None
    lora_path: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], where: str) -> CatalogEntry:
        try:
            return cls(
                model_id=str(row["model_id"]),
                app_name=str(row["app_name"]),
                mode=str(row["mode"]),
                max_model_len=int(row["max_model_len"]) if row.get("max_model_len") is not None else None,
                lora_path=str(row["lora_path"]) if row.get("lora_path") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a model row ({exc!r})") from None

    def card(self) -> Any:
        """The model's card, with the metadata keys of Ray's own (to_model_metadata)."""
        from serving.ray_internals import ModelCard

        return ModelCard(
            id=self.model_id,
            object="model",
            owned_by=OWNED_BY,
            permission=[],
            metadata={
                "model_id": self.model_id,
                "input_modality": "text",
                "max_request_context_length": self.max_model_len,
            },
        )


def parse_models(rows: Sequence[Mapping[str, Any]] | None) -> dict[str, CatalogEntry]:
    """user_config `models` -> entries by model id; a repeated id is refused (the spec refuses it too)."""
    entries: dict[str, CatalogEntry] = {}
    for i, row in enumerate(rows or ()):
        entry = CatalogEntry.from_row(row, f"user_config.models[{i}]")
        if entry.model_id in entries:
            raise ValueError(f"user_config.models[{i}]: model id {entry.model_id!r} is listed twice")
        entries[entry.model_id] = entry
    return entries


class ModelCatalog:
    """The models behind the front door, and their handles, looked up once per model.

    `lookup(app_name)` returns a handle to the application's ingress deployment; it blocks on
    Serve's controller (serve.get_app_handle), so it runs in a thread. An application that does
    not exist yet (Serve deploys the applications of one config side by side) is looked up again
    on the next request, not cached as missing.
    """

    def __init__(self, lookup: Callable[[str], Any] | None = None):
        self.entries: dict[str, CatalogEntry] = {}
        self._lookup = lookup or _app_handle
        self._handles: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def update(self, rows: Sequence[Mapping[str, Any]] | None) -> tuple[set[str], set[str]]:
        """Take a new model table; returns (added, removed) model ids. A model whose
        application changed is looked up again."""
        new = parse_models(rows)
        old = self.entries
        for model_id, entry in old.items():
            if model_id not in new or new[model_id].app_name != entry.app_name:
                self._handles.pop(model_id, None)
        self.entries = new
        return set(new) - set(old), set(old) - set(new)

    def cards(self) -> dict[str, Any]:
        return {m: e.card() for m, e in self.entries.items()}

    def lora_paths(self) -> dict[str, str]:
        return {m: e.lora_path for m, e in self.entries.items() if e.lora_path}

    def handle(self, model_id: str) -> Any | None:
        """The handle already looked up for `model_id` (a base model id), else None."""
        return self._handles.get(model_id)

    async def resolve(self, model_id: str) -> Any:
        """The handle to `model_id`'s application, looked up on first use.

        Raises KeyError for a model not in the catalogue, and what the lookup raises
        (RayServeException) while its application does not exist yet.
        """
        entry = self.entries[model_id]
        handle = self._handles.get(model_id)
        if handle is not None:
            return handle
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:  # one lookup per model, however many requests wait for it
            handle = self._handles.get(model_id)
            if handle is None:
                handle = await asyncio.to_thread(self._lookup, entry.app_name)
                if self.entries.get(model_id) is entry:  # not replaced while we looked
                    self._handles[model_id] = handle
                    logger.info("model %s is served by application %s", model_id, entry.app_name)
        return handle


def _app_handle(app_name: str) -> Any:
    from ray import serve

    return serve.get_app_handle(app_name)
