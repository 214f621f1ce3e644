"""One admitted chat or completion request: the state the front door's pipeline carries.

What flows through here: nothing runs; serving/ingress/pipeline.py builds a `RequestContext`
step by step (key id, route, body, reservation) and hands it to the router
(serving/ingress/routing.py), which reads it to call the cluster or the external fallback and
to meter the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.ingress.catalog import ModelRoute
from serving.ingress.limits import Reservation


@dataclass
class RequestContext:
    """One admitted chat or completion request, as the pipeline worked it out."""

    request: Any  # the client's request (its headers: session affinity, trace context)
    endpoint: str  # "chat" or "completions"
    key_id: str
    route: ModelRoute
    # The client's fields (allow-listed JSON), with stream_options.include_usage added to a
    # stream: what the external fallback is sent (OpenAI's fields of it).
    body: dict[str, Any]
    asked_usage: bool  # the client asked for the usage event itself
    reservation: Reservation
    started: float
    # "fallback": the key's budget is spent and its budget sends it to the external fallback.
    overflow: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))
