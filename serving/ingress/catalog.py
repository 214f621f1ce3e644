"""The front door's models: which models and adapters it serves, and the engines behind each.

What flows through here: the model a request names (or none: the only one) -> `Models.resolve`
-> a `ModelRoute` (the model as asked, its base model, a handle to its engines, the
deployment that serves its tokens as Serve's status names it, its context length), or
`ModelNotFound` for a model or adapter this front door does not serve (an empty adapter name,
or one that is not in the adapters' storage: refused before any engine loads it, so an
unknown adapter never evicts a loaded one), or `Unservable` while a model's application is
not deployed yet. `/v1/models` and `/v1/models/<id>` read the same tables; the adapters'
listing is read from storage off the event loop and kept for `ADAPTER_LISTING_TTL_S`, and no
answer carries a storage location.

The tables are Ray Serve LLM's OpenAiIngress's own (`_default_serve_handles`, `_model_cards`,
`_lora_paths`, and its `_get_configured_serve_handle`, which adds LoRA multiplexing): one copy.
In the many-model form (`ModelCatalog`) they are filled from the ingress deployment's
`user_config["models"]` (ServingSpec's model_table(): model id, application name, mode,
context length, adapters' path), each model's handle looked up on its first request.

Why our own: Ray Serve LLM 2.60 builds its ingress with the engines' handles bound in one
application (build_openai_app), so adding a model changes that application's args and
redeploys every engine. Here each model is its own application and the front door learns the
models from its user_config, which Serve hands to `reconfigure` without restarting anything;
the handles are looked up by application name (`serve.get_app_handle`, public API).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.core.failures import MODEL_STARTING_MESSAGE, MODEL_STARTING_RETRY_S, Reason, Unservable
from serving.spec import base_model_id
from serving.spec.models import ADAPTER_SEP

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


# --- resolving a request's model -----------------------------------------------------------
# How long the adapters' listing (one storage LIST per model) is trusted; an adapter added to
# storage is served after at most this long, or at once when a request names it.
ADAPTER_LISTING_TTL_S = 60.0
# A name that is a storage location, redacted from any text a client gets.
_STORAGE_URI = re.compile(r"\b(?:s3|gs|abfss|azure)://\S+")


class ModelNotFound(Exception):
    """The front door does not serve this model or adapter (OpenAI's 404)."""

    def __init__(self, model: str):
        super().__init__(model)
        self.model = model


@dataclass(frozen=True)
class ModelRoute:
    """The model a request asked for, worked out once."""

    model: str  # as asked (`<base>:<adapter>` for an adapter)
    base: str
    handle: Callable[[], Any]  # the configured Serve handle to its engines (multiplexed for an adapter)
    engine: str | None  # the deployment that serves its tokens, as ClusterWatch names it
    context_len: int | None  # the base model's context (max_model_len)


def redact_storage(text: str) -> str:
    """`text` without storage locations (an engine's adapter error names its S3 URI)."""
    return _STORAGE_URI.sub("<storage>", text)


def _list_adapters(path: str, base: str) -> list[str]:
    from ray.llm._internal.common.utils.lora_utils import get_lora_model_ids

    return get_lora_model_ids(dynamic_lora_loading_path=path, base_model_id=base)


class Models:
    """Resolution over the ingress's tables (`ingress`: Ray's OpenAiIngress subclass), with
    the many-model catalogue when there is one (`catalog`)."""

    def __init__(
        self,
        ingress: Any,
        catalog: ModelCatalog | None = None,
        list_adapters: Callable[[str, str], list[str]] = _list_adapters,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ingress = ingress
        self.catalog = catalog
        self._list = list_adapters
        self._clock = clock
        self._adapters: dict[str, tuple[float, frozenset[str]]] = {}  # base -> (read at, adapter ids)
        self._listing: dict[str, asyncio.Lock] = {}

    @property
    def cards(self) -> Mapping[str, Any]:
        return self._ingress._model_cards

    def only_model(self) -> str | None:
        return next(iter(self.cards)) if len(self.cards) == 1 else None

    def served(self, model: Any) -> bool:
        """Whether `model` names a served model or adapter by its form alone (no storage read)."""
        if not isinstance(model, str):
            return False
        base, sep, adapter = model.partition(ADAPTER_SEP)
        return base in self.cards and (not sep or (bool(adapter) and base in self._ingress._lora_paths))

    async def adapters(self, base: str, *, fresh: bool = False) -> frozenset[str]:
        """The adapter ids of `base` in its adapters' storage (cached; `fresh`: read again
        unless just read)."""
        path = self._ingress._lora_paths.get(base)
        if path is None:
            return frozenset()
        cached = self._adapters.get(base)
        max_age = 1.0 if fresh else ADAPTER_LISTING_TTL_S
        if cached is not None and self._clock() - cached[0] < max_age:
            return cached[1]
        lock = self._listing.setdefault(base, asyncio.Lock())
        async with lock:  # one storage listing at a time per model
            cached = self._adapters.get(base)
            if cached is not None and self._clock() - cached[0] < max_age:
                return cached[1]
            ids = frozenset(await asyncio.to_thread(self._list, path, base))
            self._adapters[base] = (self._clock(), ids)
            return ids

    async def resolve(self, model: Any) -> ModelRoute:
        """The route of the model a request names (None: the only model)."""
        if model is None:
            model = self.only_model()
            if model is None:
                raise ModelNotFound("")
        if not self.served(model):
            raise ModelNotFound(str(model))
        base = base_model_id(model)
        if (
            model != base
            and model not in await self.adapters(base)
            and model not in await self.adapters(base, fresh=True)
        ):
            raise ModelNotFound(model)
        handles = self._ingress._default_serve_handles
        if self.catalog is not None and base not in handles:
            try:
                handles[base] = await self.catalog.resolve(base)
            except Exception as exc:  # its application is not deployed (yet)
                logger.warning("no handle to model %s yet: %r", base, exc)
                raise Unservable(Reason.DECODE_UNAVAILABLE, MODEL_STARTING_RETRY_S, MODEL_STARTING_MESSAGE) from None
        card = self.cards[base]
        context = (getattr(card, "metadata", None) or {}).get("max_request_context_length")
        return ModelRoute(
            model=model,
            base=base,
            handle=lambda: self._ingress._get_configured_serve_handle(model),
            engine=self._engine(base),
            context_len=int(context) if isinstance(context, int) else None,
        )

    def _engine(self, base: str) -> str | None:
        deployment = getattr(self._ingress._default_serve_handles.get(base), "deployment_name", None)
        if self.catalog is None or deployment is None:
            return deployment
        # Another application's deployment: ClusterWatch keys those "<app>/<deployment>".
        entry = self.catalog.entries.get(base)
        return f"{entry.app_name}/{deployment}" if entry is not None else None

    def engines(self) -> list[str]:
        """Every model's engine deployment known so far (for /health)."""
        return [e for e in (self._engine(b) for b in self._ingress._default_serve_handles) if e]

    def take(self, rows: Any) -> tuple[set[str], set[str]]:
        """The many-model catalogue's new table into the ingress's tables: handles of models
        that left or moved are dropped, new ones looked up on their first request."""
        assert self.catalog is not None
        ingress = self._ingress
        added, removed = self.catalog.update(rows)
        ingress._model_cards = self.catalog.cards()
        ingress._lora_paths = self.catalog.lora_paths()
        for model_id in list(ingress._default_serve_handles):
            if self.catalog.handle(model_id) is None:
                del ingress._default_serve_handles[model_id]
        for model_id in list(ingress._configured_serve_handles):
            if base_model_id(model_id) not in ingress._default_serve_handles:
                del ingress._configured_serve_handles[model_id]
        self._adapters.clear()
        return added, removed

    async def listing(self) -> list[Any]:
        """Every served model's card and its adapters' cards (no storage location in them)."""
        cards = []
        for base, card in self.cards.items():
            cards.append(card)
            for adapter in sorted(await self.adapters(base)):
                cards.append(self.adapter_card(adapter))
        return cards

    def adapter_card(self, model: str) -> Any:
        """An adapter's card: its base model's, under its own id."""
        from serving.ray_internals import ModelCard

        base = self.cards[base_model_id(model)]
        metadata = {**(base.metadata or {}), "model_id": model, "base_model_id": base.id}
        metadata.pop("bucket_uri", None)
        return ModelCard(id=model, object="model", owned_by=base.owned_by, permission=[], metadata=metadata)
