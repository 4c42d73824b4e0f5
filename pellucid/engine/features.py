"""Request features: capabilities that ride on a request in `extras[key]` (tracing, extraction sinks,
prefix-cache salts, a pipeline stage's inputs).

Each feature declares, through one interface, what the engine needs to know of it:
- how a request carrying it is checked before it is queued: in the frontend, against the engine's
  published facts, so a bad request is refused before it reaches the engine (`RequestFeature.check`),
  and again in the engine (`EngineFeature.prepare`);
- whether its requests may step ahead (`step_ahead`);
- what it does after every step while some request carries it, and what it adds to a request's final
  output (`EngineFeature.after_step`), including outputs that are only ready later (a Future: the
  engine holds the request's final report until it is done);
- what it costs in prefix caching (`prepare` sets the request's read/publish policy);
- whether its requests read their sampled tokens (`discards_tokens`: an engine without an LM head serves
  only requests that do not);
- how its outputs are cut when the frontend ends a request early at a stop string (`trim_outputs`);
- engine-side utilities the frontends may call (`EngineFeature.utilities`);
- under tensor parallelism, what the model runners of the other ranks need of it (`for_ranks`, `on_rank`).

A feature is one registered `RequestFeature` (its frontend half, shared by everything in a process)
that makes one `EngineFeature` per engine core (its engine half, with that engine's state). The engine
core and the frontends know this interface, not the features: a new feature is a new module.
"""
from __future__ import annotations

import operator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

from pellucid.engine.request import allow_step_ahead_for_extras_key

if TYPE_CHECKING:
    from pellucid.engine.request import Request

ENTRY_POINT_GROUP = "pellucid.features"


class EngineFeature:
    """A feature's half in one engine core: its state there, and the engine's hooks."""

    def prepare(self, request: "Request") -> None:
        """Bind the feature's state to a request before it is queued (ValueError refuses the request);
        may set the request's prefix-cache policy."""

    def set_active(self, active: bool) -> None:
        """Some unfinished request carries the feature (True) or none does any more (False)."""

    def after_step(self, changed: list["Request"]) -> None:
        """After a step's tokens were applied: `changed` holds the requests that progressed or finished.
        Called only while the feature is active. What a finishing request adds to its final output goes
        into `request.feature_outputs`; a value that is a concurrent.futures.Future holds the final report
        back until it is done (its result, or {"error": ...}, is reported then)."""

    def after_finish(self, requests: list["Request"]) -> None:
        """Requests carrying the feature were ended outside a step (abort, a stop string)."""
        self.after_step(requests)

    def utilities(self) -> dict[str, Callable[..., Any]]:
        """Methods frontends may call as "<key>.<name>" (EngineCoreClient.call_utility); plain-data
        arguments and results."""
        return {}


class RequestFeature:
    """A feature's frontend half and its declarations. One instance, registered, serves the process."""

    key: str = ""
    # Requests carrying the feature may be scheduled ahead of their previous token's readback
    # (the feature keeps its per-step state on the device).
    step_ahead: bool = False
    # The feature adds outputs to a request's final output, so a request the frontend ends early waits
    # for the engine's final output.
    publishes_outputs: bool = False
    # Features' engine hooks run in increasing order (one may consume what another published).
    order: int = 0
    # Requests carrying the feature never read their sampled tokens (embeddings): an engine without an LM head
    # (heads/none.py) serves them, and only them.
    discards_tokens: bool = False

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

    def for_ranks(self, value: Any) -> Any:
        """Tensor parallelism: what of a prepared request's `extras[key]` the model runners of the other ranks
        read (it is pickled to their processes), or None (the default) when the runner does not read it."""
        return None

    def on_rank(self, value: Any, request: "Request", runner: Any) -> Any:
        """On another tensor-parallel rank: `request.extras[key]` made from for_ranks' `value` for that rank's
        copy of the request and its `runner`."""
        return value

    def for_engine(self, engine: Any) -> EngineFeature:
        """This feature's half in `engine` (an EngineCore), made once per engine. Keep the parts it needs
        (`engine.runner`), not the engine: the engine holds its features, and a cycle would keep a dropped
        engine's GPU memory until the cyclic garbage collector happens to run."""
        return EngineFeature()


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
    import pellucid.extraction.sink  # noqa: F401
    import pellucid.pipeline.stage_features  # noqa: F401
    import pellucid.pooling.feature  # noqa: F401
    import pellucid.tracing.feature  # noqa: F401
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _FEATURES:
            register_feature(ep.load()())


def check_served_without_logits(extras: dict[str, Any] | None, computes_logits: bool) -> None:
    """ValueError unless an engine whose head `computes_logits` (or not) can serve a request with `extras`."""
    if computes_logits or any(get_feature(key).discards_tokens for key in (extras or {})):
        return
    raise ValueError("this engine has no LM head (an embedding or classification checkpoint without one, or --head "
                     "none): it serves embeddings and classifications only (LLM.embed, LLM.classify, /v1/embeddings, "
                     "/classify), not generation, logprobs or logits")


def get_feature(key: str) -> RequestFeature:
    """The feature registered for an extras key; ValueError for an unknown key (never ignored)."""
    _load_builtin_and_plugins()
    feature = _FEATURES.get(key)
    if feature is None:
        raise ValueError(f"unknown request extras key {key!r}; known: {', '.join(sorted(_FEATURES))}")
    return feature


class ActiveFeatures:
    """An engine core's feature halves, and which of its unfinished requests carry each feature."""

    def __init__(self, engine: Any) -> None:
        self._scheduler = engine.scheduler
        _load_builtin_and_plugins()
        ordered = sorted(_FEATURES.values(), key=lambda f: f.order)
        self._halves: dict[str, EngineFeature] = {f.key: f.for_engine(engine) for f in ordered}
        self._carriers: dict[str, list["Request"]] = {}
        for half in self._halves.values():      # nothing carries any feature yet
            half.set_active(False)

    def prepare(self, request: "Request") -> None:
        """Bind every feature of a request (ValueError refuses it; nothing is recorded then)."""
        halves = [self._half(key) for key in request.extras]
        for half in halves:
            half.prepare(request)
        # A token nobody reads is not generation (the engine's generation-token counters leave it out).
        request.counts_as_generation = not any(get_feature(key).discards_tokens for key in request.extras)

    def queued(self, request: "Request") -> None:
        for key in request.extras:
            carriers = self._carriers.get(key)
            if carriers is None:
                carriers = self._carriers[key] = []
                self._halves[key].set_active(True)
            carriers.append(request)

    def after_step(self, changed: list["Request"]) -> None:
        if self._carriers:
            for key, half in self._halves.items():
                if key in self._carriers:
                    half.after_step(changed)
            self._forget_finished()

    def after_finish(self, requests: list["Request"]) -> None:
        if self._carriers:
            for key, half in self._halves.items():
                carrying = [r for r in requests if key in r.extras] if key in self._carriers else None
                if carrying:
                    half.after_finish(carrying)
            self._forget_finished()

    def utility(self, key: str, name: str) -> Callable[..., Any]:
        method = self._half(key).utilities().get(name)
        if method is None:
            raise ValueError(f"the request feature {key!r} has no engine utility {name!r}")
        return method

    def _half(self, key: str) -> EngineFeature:
        half = self._halves.get(key)
        if half is None:
            get_feature(key)        # the error names the known keys
            raise ValueError(f"the request feature {key!r} was registered after this engine started")
        return half

    def _forget_finished(self) -> None:
        unfinished = self._scheduler.requests
        for key, carriers in list(self._carriers.items()):
            left = still_unfinished(carriers, unfinished)
            if left:
                self._carriers[key] = left
            else:
                del self._carriers[key]
                self._halves[key].set_active(False)


def still_unfinished(requests: list["Request"], unfinished: dict[str, "Request"]) -> list["Request"]:
    """`requests` without the finished ones: the same list when every one is still in the scheduler's
    table of unfinished requests (the usual case, checked with map() so the loop runs in C: a Python
    loop over a large traced batch costs ~0.1 ms a step)."""
    ids = map(operator.attrgetter("request_id"), requests)
    if all(map(operator.is_, map(unfinished.get, ids), requests)):
        return requests
    return [r for r in requests if not r.is_finished]
