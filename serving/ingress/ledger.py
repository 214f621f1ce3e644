"""The limits ledger: one Ray actor per application holding every key's sliding-minute windows
and its spend per UTC day and month, so that a limit or a budget holds across ingress
replicas, and across a rollout of new ingress code.

What flows through here: an ingress replica's Limiter (serving/ingress/limits.py) asks
`admit(kid, model, rpm, tpm, tokens, rid, budget)` -> a Decision: refused (its budget spent,
or a window full), or counted, its tokens reserved under the replica's reservation id `rid`.
Later `settle(kid, model, rid, used, spend)` replaces the reservation by the tokens really
used and adds the request's cost to the key's spend, or `release(kid, model, rid)` takes the
request out again (one the ingress refused after all); `record(rows)` adds the spend of keys
with no reservation (batched by each replica), `spend(kid)` answers a key's own day and month
(the key-scoped usage endpoint). The arithmetic is serving/ingress/windows.py's. A settle or release whose admit has
not landed (the replica stopped waiting for it) is remembered, so that the admit counts
nothing when it lands; a settle whose admit never lands counts the tokens used, then.
Every call of one replica reaches the actor in the order it was sent (Ray: a synchronous,
single-threaded actor runs one submitter's tasks in submission order, without task retries;
docs.ray.io ray-core/actors/task-orders), so a settle never overtakes its own admit.

Names and rollouts. The actor is `pd-limits-<app>-v<LEDGER_SCHEMA>` in namespace `serve`,
detached (the counts outlive replica restarts). The schema is the version of the ledger's
calls (`CALLS`) and stored state, not of its code: every ingress version of one schema names
the same actor, so during a rollout old and new replicas count in one place. A change to the
ledger that keeps its calls and state keeps the schema (the running actor keeps the code it
started with until it restarts); a change to either bumps LEDGER_SCHEMA
(tests/serving/ingress/test_ledger.py holds the calls to `CALLS`). A ledger of a new schema
takes over from the older one when it starts: the older one hands over its windows and open
reservations and from then on forwards its replicas' calls (its schema's calls, which a newer
ledger keeps serving) to the new one, so the two versions still count in one place. The
ledgers named by a hash of their code (schema 1, before this scheme) cannot hand over: during
the rollout that replaces them, their replicas and the new ones count apart.

Spend outlives the actor: every SPEND_CHECKPOINT_S the ledger writes its spend book to Ray's
GCS key-value store under its own name, and a restarted ledger reads it back (a restart loses
at most that much spend; with gcsFaultTolerance the store survives a head restart too). A
newer schema's ledger takes the older one's spend over with its windows.

Cleanup. Every SWEEP_S the ledger looks at its application's other ledgers and kills (no
restart) each that has had no call for RETIRE_IDLE_S (as it says itself; a schema-1 ledger,
which cannot say, that long after this one first saw it), but only while no rollout of the
ingress deployment is under way (Serve's status: not UPDATING, so every replica runs code that
names one ledger) and while this one is in use (after a rollback to code that names another
ledger, this one leaves it alone and is retired by it). A retired ledger that a replica still
names is created again by that replica and retired again later.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from serving.ingress.windows import WINDOW_S, Decision, KeyLimit, SlidingWindows, SpendBook

logger = logging.getLogger("ray.serve")

# The arithmetic's names, where the ledger's callers have always found them.
__all__ = ["WINDOW_S", "Decision", "KeyLimit", "LimitsLedger", "SlidingWindows", "get_ledger"]

NAMESPACE = "serve"
LEDGER_SCHEMA = 3
# The calls of this schema, with their parameters: what every ingress replica of the schema
# sends, and what a ledger of a newer schema keeps serving for an older one forwarding to it
# (schema 2's admit and settle had no budget and spend: they default to none).
CALLS: dict[str, tuple[str, ...]] = {
    "admit": ("kid", "model", "rpm", "tpm", "tokens", "rid", "budget"),
    "settle": ("kid", "model", "rid", "used", "spend"),
    "release": ("kid", "model", "rid"),
    "record": ("rows",),
    "spend": ("kid",),
    "totals": ("kid", "model"),
    "idle_s": (),
    "hand_over": ("successor",),
}
# How often the spend book is written to Ray's GCS key-value store (what a restart may lose).
SPEND_CHECKPOINT_S = 10.0
SWEEP_S = 60.0
RETIRE_IDLE_S = 300.0
# How long a call to another ledger (the sweep's, or a forwarded one) may take.
CALL_TIMEOUT_S = 1.0
# An open reservation whose settle never came (its replica died) is forgotten after this long.
OPEN_MAX_S = 3600
# How many calls between two clean-ups of idle windows and forgotten reservations.
TIDY_EVERY = 10_000


# --- names ----------------------------------------------------------------------------------------
def ledger_name(app_name: str, schema: int = LEDGER_SCHEMA) -> str:
    return f"pd-limits-{app_name}-v{schema}"


def family(app_name: str) -> re.Pattern[str]:
    """The names of `app_name`'s ledgers, of every schema: `v<N>`, or (schema 1) a code hash."""
    return re.compile(rf"pd-limits-{re.escape(app_name)}-(?:v(?P<schema>\d+)|[0-9a-f]{{10}})")


def schema_of(name: str, app_name: str) -> int | None:
    """The schema a ledger's name says (1: named by a code hash), None: not one of the app's."""
    m = family(app_name).fullmatch(name)
    if m is None:
        return None
    return int(m["schema"]) if m["schema"] else 1


class Registry(Protocol):
    """Where a ledger finds its application's other ledgers (RayLedgers; a stand-in in tests)."""

    def names(self) -> list[str]: ...

    def proxy(self, name: str) -> Any: ...  # its calls, answered (AttributeError: no such call)

    def kill(self, name: str) -> None: ...

    def rolling(self) -> bool: ...  # a rollout of the ingress is under way (or unknown)


class SpendStore(Protocol):
    """Where a ledger keeps its spend book across restarts (RaySpendStore; a stand-in in tests)."""

    def load(self) -> list[list[Any]]: ...

    def save(self, rows: list[list[Any]]) -> None: ...


_LOCAL = object()


# --- the shared ledger --------------------------------------------------------------------------
class LimitsLedger:
    """The Ray actor every ingress replica asks; one per application and schema (a named actor).
    One window per (key id, base model id): see serving/ingress/limits.py's docstring."""

    def __init__(
        self,
        app_name: str | None = None,
        ingress: str | None = None,
        *,
        registry: Registry | None = None,
        schema: int = LEDGER_SCHEMA,
        clock: Callable[[], float] = time.time,
        store: SpendStore | None = None,
    ) -> None:
        self.app_name, self.schema, self.clock = app_name, schema, clock
        self.name = ledger_name(app_name, schema) if app_name is not None else None
        self._w = SlidingWindows()
        self._spend = SpendBook()
        self._spend_changed = False
        self._open: dict[str, tuple[tuple[str, str], tuple[int, int]]] = {}  # rid -> (key, ticket)
        self._closed: dict[str, int] = {}  # rid settled or released before its admit landed -> when
        self._lock = threading.Lock()  # the sweep's hand-over runs beside the calls
        self._calls = 0
        self._last_call = clock()  # created to be used: creation counts as a call
        self._successor: Any = None  # a newer ledger this one forwards to, once it took over
        self._registry = registry
        self._store = store
        if registry is None and app_name is not None:  # the actor: sweep and checkpoint in the background
            self._registry = RayLedgers(app_name, ingress)
            self._store = RaySpendStore(ledger_name(app_name, schema))
            succession = Succession(self, self._registry)
            threading.Thread(target=succession.run, name="ledger-sweep", daemon=True).start()
            threading.Thread(target=self._checkpoints, name="ledger-checkpoint", daemon=True).start()
        if self._store is not None:
            self._spend.load(self._store.load())  # what this ledger had spent before a restart

    # --- the calls (CALLS) -------------------------------------------------------------------
    def admit(
        self, kid: str, model: str, rpm: int, tpm: int, tokens: int, rid: str, budget: Sequence[Any] | None = None
    ) -> Decision:
        """`budget`: the key's [USD, "day" or "month"], refused once that period's spend reached it."""
        if (fwd := self._forward("admit", kid, model, rpm, tpm, tokens, rid, budget)) is not _LOCAL:
            return fwd  # the successor's answer
        with self._lock:
            if self._closed.pop(rid, None) is not None:
                return Decision(True)  # settled or released before it landed: the request is over
            if budget:
                spent = self._spend.refusal(kid, float(budget[0]), str(budget[1]), self.clock())
                if spent is not None:
                    return spent
            subject = f"this API key on model '{model}'"
            d = self._w.admit((kid, model), self.clock(), KeyLimit(rpm, tpm), tokens, subject)
            if not d.ok or not isinstance(d.ticket, tuple):
                return d
            self._open[rid] = ((kid, model), d.ticket)
            return replace(d, ticket=rid)

    def settle(self, kid: str, model: str, rid: str, used: int, spend: Sequence[float] | None = None) -> None:
        """`spend`: the request's windows.Spend (USD, requests, prompt, completion, cached tokens)."""
        if self._forward("settle", kid, model, rid, used, spend) is not _LOCAL:
            return
        with self._lock:
            if spend:
                self._spend.add(kid, self.clock(), spend)
                self._spend_changed = True
            opened = self._open.pop(rid, None)
            if opened is not None:
                self._w.settle(opened[0], self.clock(), opened[1], used)
                return
            # Its admit has not landed, or never will: the tokens were spent now, and the admit
            # counts nothing if it lands later.
            self._w.charge((kid, model), self.clock(), used)
            self._closed[rid] = int(self.clock())

    def release(self, kid: str, model: str, rid: str) -> None:
        if self._forward("release", kid, model, rid) is not _LOCAL:
            return
        with self._lock:
            opened = self._open.pop(rid, None)
            if opened is not None:
                self._w.release(opened[0], self.clock(), opened[1])
            else:
                self._closed[rid] = int(self.clock())

    def record(self, rows: Sequence[Sequence[Any]]) -> None:
        """The spend of requests that held no reservation: [kid, *windows.Spend] per key."""
        if self._forward("record", rows) is not _LOCAL:
            return
        with self._lock:
            now = self.clock()
            for kid, *spend in rows:
                self._spend.add(kid, now, spend)
            self._spend_changed = True

    def spend(self, kid: str) -> dict[str, Any]:
        """Key `kid`'s spend and tokens in the current UTC day and month (nothing of other keys)."""
        if (fwd := self._forward("spend", kid)) is not _LOCAL:
            return fwd  # the successor's answer
        with self._lock:
            return self._spend.report(kid, self.clock())

    def totals(self, kid: str, model: str) -> tuple[int, int]:
        if (fwd := self._forward("totals", kid, model)) is not _LOCAL:
            return fwd  # the successor's answer
        with self._lock:
            return self._w.totals((kid, model), int(self.clock()))

    def idle_s(self) -> float:
        """Seconds since an ingress replica last called this ledger (the sweep's calls aside)."""
        return self.clock() - self._last_call

    def hand_over(self, successor: str) -> dict[str, Any]:
        """A newer ledger takes over: from now on every call goes to `successor`; returns the
        windows and open reservations, for it to add to its own."""
        if self._registry is None:
            raise RuntimeError("a ledger without a registry cannot forward")
        with self._lock:
            self._successor = self._registry.proxy(successor)
            state = {
                "schema": self.schema,
                "windows": [[k[0], k[1], rows] for k, rows in self._w.export()],  # type: ignore[index]
                "open": [[rid, k[0], k[1], t[0], t[1]] for rid, (k, t) in self._open.items()],
                "spend": self._spend.export(),
            }
            self._open.clear()
            self._spend = SpendBook()  # the successor's now: checkpointed there, not here
            self._spend_changed = True
            return state

    # --- inside -----------------------------------------------------------------------------------
    def _forward(self, call: str, *args: Any) -> Any:
        """The successor's answer once one took over, else _LOCAL (answer here); counts the call."""
        self._last_call = self.clock()
        self._calls += 1
        if self._calls % TIDY_EVERY == 0:
            with self._lock:
                self._tidy()
        if self._successor is None:
            return _LOCAL
        return getattr(self._successor, call)(*args)

    def _tidy(self) -> None:
        now = self.clock()
        self._w.forget_idle(now)
        self._spend.tidy(now)
        self._open = {r: o for r, o in self._open.items() if o[1][0] > now - OPEN_MAX_S}
        self._closed = {r: s for r, s in self._closed.items() if s > now - 2 * WINDOW_S}

    def _take_over(self, older: Any) -> None:
        """Load the windows and open reservations of an older ledger, which from now on
        forwards its calls here; no call here runs in between (a forwarded one waits)."""
        with self._lock:
            state = older.hand_over(self.name)
            self._w.load([((kid, model), rows) for kid, model, rows in state.get("windows") or []])
            for rid, kid, model, second, reserved in state.get("open") or []:
                self._open[rid] = ((kid, model), (second, reserved))
            self._spend.load(state.get("spend") or [])  # schema 2 kept none
            self._spend_changed = True

    def _checkpoint(self) -> bool:
        """Write the spend book to the store if it changed since the last write; whether it wrote."""
        if self._store is None or not self._spend_changed:
            return False
        with self._lock:
            rows, self._spend_changed = self._spend.export(), False
        self._store.save(rows)
        return True

    def _checkpoints(self) -> None:
        while True:
            time.sleep(SPEND_CHECKPOINT_S)
            try:
                self._checkpoint()
            except Exception as exc:  # the next checkpoint tries again
                self._spend_changed = True
                logger.warning("limits ledger spend checkpoint failed: %r", exc)


class Succession:
    """A ledger's duties toward its application's other ledgers (see the module docstring):
    take over from an older schema's, retire the quiet ones. The actor runs `sweep` every
    SWEEP_S in a thread of its own."""

    def __init__(self, ledger: LimitsLedger, registry: Registry):
        self.ledger, self.registry = ledger, registry
        self._seen: dict[str, float] = {}  # other ledgers of the app -> when first seen
        self._taken: set[str] = set()

    def sweep(self) -> list[str]:
        """One look at the other ledgers; returns the names of those retired (killed)."""
        me = self.ledger
        assert me.app_name is not None
        now = me.clock()
        others = [n for n in self.registry.names() if n != me.name]
        for name in others:
            self._seen.setdefault(name, now)
            if 2 <= (schema_of(name, me.app_name) or 0) < me.schema and name not in self._taken:
                me._take_over(self.registry.proxy(name))
                self._taken.add(name)
                logger.info("limits ledger %s took over from %s", me.name, name)
        killed: list[str] = []
        if others and me.idle_s() < RETIRE_IDLE_S and not self.registry.rolling():
            for name in others:
                other = self.registry.proxy(name)
                quiet = other.idle_s() if hasattr(other, "idle_s") else now - self._seen[name]
                if quiet >= RETIRE_IDLE_S:
                    self.registry.kill(name)
                    killed.append(name)
                    logger.info("limits ledger %s retired %s (no call for %.0fs)", me.name, name, quiet)
        self._seen = {n: t for n, t in self._seen.items() if n in others and n not in killed}
        return killed

    def run(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception as exc:  # the next sweep tries again
                logger.warning("limits ledger sweep failed: %r", exc)
            time.sleep(SWEEP_S)


# --- Ray ------------------------------------------------------------------------------------------
class _Proxy:
    """Another ledger actor's calls, answered (blocking, with a deadline)."""

    def __init__(self, handle: Any):
        self._handle = handle

    def __getattr__(self, call: str) -> Callable[..., Any]:
        method = getattr(self._handle, call)  # AttributeError: that ledger has no such call

        def answered(*args: Any) -> Any:
            import ray

            return ray.get(method.remote(*args), timeout=CALL_TIMEOUT_S)

        return answered


class RayLedgers:
    """An application's ledgers as Ray knows them: named actors in namespace `serve`."""

    def __init__(self, app_name: str, ingress: str | None):
        self.app_name, self.ingress = app_name, ingress

    def names(self) -> list[str]:
        import ray

        mine = family(self.app_name)
        found = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in found if a["namespace"] == NAMESPACE and mine.fullmatch(a["name"])]

    def proxy(self, name: str) -> Any:
        import ray

        return _Proxy(ray.get_actor(name, namespace=NAMESPACE))

    def kill(self, name: str) -> None:
        import ray

        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)

    def rolling(self) -> bool:
        """Whether Serve is rolling the ingress deployment out (not knowing counts as yes)."""
        if self.ingress is None:
            return True
        try:
            from ray import serve

            app = serve.status().applications[self.app_name]
            return bool(app.deployments[self.ingress].status == "UPDATING")  # a str Enum
        except Exception:
            return True


class RaySpendStore:
    """A ledger's spend book in Ray's GCS key-value store (internal_kv), under the ledger's name."""

    def __init__(self, name: str):
        self.key = f"pd-spend:{name}".encode()

    def load(self) -> list[list[Any]]:
        from ray.experimental import internal_kv

        try:
            raw = internal_kv._internal_kv_get(self.key, namespace=NAMESPACE)
        except Exception as exc:  # no store: start from zero, and say so
            logger.warning("limits ledger spend not read back: %r", exc)
            return []
        return json.loads(raw) if raw else []

    def save(self, rows: list[list[Any]]) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, json.dumps(rows).encode(), overwrite=True, namespace=NAMESPACE)


def get_ledger(app_name: str, ingress: str | None = None, label_selector: dict[str, str] | None = None) -> Any:
    """The application's ledger actor, created by whichever ingress replica asks first.

    Detached, so it outlives the replica that created it (replicas come and go; the counts
    must not); named per application and schema, so two apps in one cluster do not share and
    every ingress version of one schema does. Blocks on the GCS: call it off the event loop.
    """
    import ray

    opts: dict[str, Any] = {
        "name": ledger_name(app_name),
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
    }
    if label_selector:
        opts["label_selector"] = dict(label_selector)
    return ray.remote(LimitsLedger).options(**opts).remote(app_name, ingress)
