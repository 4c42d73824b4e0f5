"""Tracing as a request feature: `extras={"trace": TracePlan | [ops] | [JSON ops]}`.

Frontend: the ops are checked against the engine's site table (published at start-up), so a bad
intervention is refused before it reaches the engine. Engine: each request gets its own bound plan
(the runner records and edits through it), a traced request computes every position its ops touch
itself (it reads the prefix cache only below the first of them) and an edited one never publishes to it; when traced requests end,
their saves are assembled together and become the request's feature outputs.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from pellucid.engine.features import EngineFeature, RequestFeature, register_feature
from pellucid.engine.request import RequestStatus
from pellucid.tracing.plan import TRACE_KEY, TracePlan, finalize_plans
from pellucid.tracing.sites import site_table

# By id: an enum member's hash is computed in Python, an int's in C (enum members are singletons).
_FINISHED_STATUS_IDS = frozenset(id(status) for status in RequestStatus if status.finished)
_STATUS = operator.attrgetter("status")


class Tracing(RequestFeature):
    key = TRACE_KEY
    # Ops, saves and recorded tokens live on the device per step, and a request's saves are cut at its
    # end (the position limits below), so traced requests work on steps launched ahead of the readback.
    step_ahead = True
    publishes_outputs = True

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> TracePlan:
        if params.n != 1:
            raise ValueError(f"a traced request must have n=1 (got n={params.n}); send n separate requests")
        plan = TracePlan.from_extras(value)
        if not plan.ops:
            raise ValueError("the trace has no ops")
        plan.resolve(len(prompt_token_ids), max_total_tokens, engine_info.site_table)
        return plan

    def trim_outputs(self, outputs: dict[str, Any], num_tokens: int) -> None:
        saves, positions = outputs.get("saves"), outputs.get("save_positions")
        if not saves or not positions:
            return
        limit = num_tokens - 1
        for name, kept in list(positions.items()):
            keep = [i for i, p in enumerate(kept) if p < limit]
            if len(keep) != len(kept):
                saves[name] = saves[name][torch.tensor(keep, dtype=torch.long, device=saves[name].device)]
                positions[name] = [kept[i] for i in keep]

    def for_ranks(self, value: Any) -> Any:
        # Every tensor-parallel rank runs the ops (gathering sharded sites, editing its own part); each binds
        # its own plan. Saves kept on another rank are dropped with its copy of the request.
        return (value.ops, value.keep_saves_on_device)

    def on_rank(self, value: Any, request: Any, runner: Any) -> TracePlan:
        ops, keep_saves_on_device = value
        return TracePlan(ops, keep_saves_on_device).bind(request.num_prompt_tokens, request.max_total_tokens,
                                                         request.request_id, site_table(runner))

    def for_engine(self, engine: Any) -> "EngineTracing":
        return EngineTracing(engine.runner)


class EngineTracing(EngineFeature):
    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def prepare(self, request: Any) -> None:
        plan = TracePlan.from_extras(request.extras[TRACE_KEY])
        if not plan.ops:
            raise ValueError("the trace has no ops")
        plan = plan.bind(request.num_prompt_tokens, request.max_total_tokens, request.request_id,
                         site_table(self.runner))
        request.extras[TRACE_KEY] = plan
        # A traced request computes every position its ops touch itself (the KV below the first of them is
        # the model's, cached or not); an edited one's KV is not the model's.
        first = plan.first_position()
        request.read_prefix_cache = first > 0
        request.prefix_cache_read_limit = first
        if plan.edits:
            request.publish_prefix_cache = False

    def set_active(self, active: bool) -> None:
        # Most steps trace nothing: the runner skips its per-request scan for traced rows then.
        self.runner.trace_possible = active

    def after_step(self, changed: list[Any]) -> None:
        """Publish the saves (or the trace error) of traced requests that just finished, assembled together."""
        # This runs over every request that progressed, every step, and usually none has finished: that
        # test runs in C (a Python loop over a large batch costs ~20 us a step).
        if _FINISHED_STATUS_IDS.isdisjoint(map(id, map(_STATUS, changed))):
            return
        finishing = []
        for request in changed:
            if not request.is_finished:
                continue
            plan = request.extras.get(TRACE_KEY) if request.extras else None
            if plan is None or not isinstance(plan, TracePlan) or not plan.bound or plan.finalized:
                continue
            if request.error is not None and not plan.failed:
                plan.error = request.error
            finishing.append((request, plan))
        if not finishing:
            return
        # A request computes positions up to its second-to-last token (the last is never fed back). A step
        # launched ahead of its end (async scheduling) may have recorded one more position: not kept.
        limits = [request.num_tokens - 1 for request, _ in finishing]
        for (request, _), result in zip(finishing, finalize_plans([plan for _, plan in finishing], limits)):
            if request.feature_outputs is None:
                request.feature_outputs = {}
            request.feature_outputs.update(result)


register_feature(Tracing())
