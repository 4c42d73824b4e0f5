"""Request features: capabilities that ride on a request in `extras[key]` (tracing, extraction sinks,
prefix-cache salts, a pipeline stage's inputs).

Each feature declares, through one interface, what the engine needs to know of it: how a request
carrying it is checked before it is queued (in the frontend, against the engine's published facts, so
a bad request is refused before it reaches the engine; and again in the engine), whether its requests
may step ahead, what it does after every step while some request carries it, and how its outputs are
cut when the frontend ends a request early (a stop string). The engine core and the frontends know
this interface, not the features: a new feature is a new module that registers itself.
"""
from __future__ import annotations

import operator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from pellucid.engine.request import allow_step_ahead_for_extras_key

if TYPE_CHECKING:
    from pellucid.engine.request import Request

ENTRY_POINT_GROUP = "pellucid.features"


class RequestFeature:
    """Base class: a feature overrides the hooks it needs. One instance serves every engine."""

    key: str = ""
    # Requests carrying the feature may be scheduled ahead of their previous token's readback
    # (the feature keeps its per-step state on the device).
    step_ahead: bool = False
    # The feature adds outputs to a request's final output (after_step publishes them), so a request the
    # frontend ends early waits for the engine's final output.
    publishes_outputs: bool = False

    # ---- frontend side ----
    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        """Validate `extras[key]` of a request with these prompt ids and SamplingParams (the parent's: `n`
        is the number of sequences) before it is sent (ValueError names the problem), and return the
        value to send. `engine_info` is the engine's published facts (EngineInfo)."""
        return value

    def trim_outputs(self, outputs: dict[str, Any], num_tokens: int) -> None:
        """The request ended at `num_tokens` tokens (prompt + output) although the engine computed more
        (a stop string found by the frontend while later steps were already running): drop from its
        final `outputs` whatever belongs to positions >= num_tokens - 1 (the last token is never fed)."""

    # ---- engine side ----
    def prepare(self, request: "Request", engine: Any) -> None:
        """Bind the feature's state to a request before it is queued (ValueError refuses the request);
        may set the request's prefix-cache policy."""

    def set_active(self, engine: Any, active: bool) -> None:
        """Some unfinished request carries the feature (True) or none does any more (False)."""

    def after_step(self, changed: list["Request"]) -> None:
        """After a step's tokens were applied: `changed` holds the requests that progressed or finished.
        Called only while the feature is active. A finishing request's outputs go into
        `request.extras[FEATURE_OUTPUTS_KEY]` (pellucid/engine/request.py)."""

    def after_finish(self, requests: list["Request"]) -> None:
        """Requests carrying the feature were ended outside a step (abort, a stop string)."""
        self.after_step(requests)


_FEATURES: dict[str, RequestFeature] = {}
_loaded = False


def register_feature(feature: RequestFeature) -> None:
    if not isinstance(feature, RequestFeature) or not feature.key:
        raise TypeError(f"a request feature must be a RequestFeature with a key, got {feature!r}")
    _FEATURES[feature.key] = feature
    if feature.step_ahead:
        allow_step_ahead_for_extras_key(feature.key)


def _load_builtin_and_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    # The built-in features register themselves on import.
    import pellucid.engine.cache_salt  # noqa: F401
    import pellucid.tracing.feature  # noqa: F401
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _FEATURES:
            register_feature(ep.load()())


def get_feature(key: str) -> RequestFeature:
    """The feature registered for an extras key; ValueError for an unknown key (never ignored)."""
    _load_builtin_and_plugins()
    feature = _FEATURES.get(key)
    if feature is None:
        raise ValueError(f"unknown request extras key {key!r}; known: {', '.join(sorted(_FEATURES))}")
    return feature


class ActiveFeatures:
    """An engine's view of the features its unfinished requests carry."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._carriers: dict[str, list["Request"]] = {}
        _load_builtin_and_plugins()
        for feature in _FEATURES.values():      # nothing carries any feature yet
            feature.set_active(engine, False)

    def prepare(self, request: "Request") -> None:
        """Bind every feature of a request (ValueError refuses it; nothing is recorded then)."""
        features = [get_feature(key) for key in request.extras]
        for feature in features:
            feature.prepare(request, self.engine)

    def queued(self, request: "Request") -> None:
        for key in request.extras:
            carriers = self._carriers.setdefault(key, [])
            if not carriers:
                get_feature(key).set_active(self.engine, True)
            carriers.append(request)

    def after_step(self, changed: list["Request"]) -> None:
        if self._carriers:
            for key in list(self._carriers):
                get_feature(key).after_step(changed)
            self._forget_finished()

    def after_finish(self, requests: list["Request"]) -> None:
        if self._carriers:
            for key in list(self._carriers):
                carrying = [r for r in requests if key in r.extras]
                if carrying:
                    get_feature(key).after_finish(carrying)
            self._forget_finished()

    def _forget_finished(self) -> None:
        unfinished = self.engine.scheduler.requests
        for key, carriers in list(self._carriers.items()):
            left = still_unfinished(carriers, unfinished)
            if left:
                self._carriers[key] = left
            else:
                del self._carriers[key]
                get_feature(key).set_active(self.engine, False)


def still_unfinished(requests: list["Request"], unfinished: dict[str, "Request"]) -> list["Request"]:
    """`requests` without the finished ones: the same list when every one is still in the scheduler's
    table of unfinished requests (the usual case, checked with map() so the loop runs in C: a Python
    loop over a large traced batch costs ~0.1 ms a step)."""
    ids = map(operator.attrgetter("request_id"), requests)
    if all(map(operator.is_, map(unfinished.get, ids), requests)):
        return requests
    return [r for r in requests if not r.is_finished]
