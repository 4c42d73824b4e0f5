"""Tracing over HTTP: the `interventions` request field in, the `saves` response field out.

A request body may carry `"interventions": [op, ...]` (JSON ops, see ops.py; `apply` is refused:
the server never executes code from a request). Each choice of the response then carries
`"saves": "<base64 safetensors>"` holding that choice's saved tensors by name, plus
`"save_positions": {name: [positions]}`.
"""
from __future__ import annotations

from typing import Any

from pellucid.outputs import RequestOutput
from pellucid.tracing.ops import ops_from_json
from pellucid.tracing.plan import TRACE_KEY, TracePlan
from pellucid.tracing.serialization import tensors_to_b64


def trace_extras(interventions: Any, n: int = 1) -> dict[str, Any] | None:
    """Engine extras for a request's `interventions` field (None when absent); ValueError naming the
    problem for a malformed one."""
    if interventions is None:
        return None
    if n != 1:
        raise ValueError(f"interventions need n=1 (got n={n}); send separate requests")
    ops = ops_from_json(interventions)
    if not ops:
        raise ValueError("interventions is an empty list")
    return {TRACE_KEY: TracePlan(ops)}


def saves_fields(output: RequestOutput) -> dict[str, Any]:
    """The fields to add to a finished traced request's choice: {"saves": b64, "save_positions": {...}}."""
    saves = output.extras.get("saves")
    if saves is None:
        return {}
    return {"saves": tensors_to_b64(saves), "save_positions": output.extras.get("save_positions", {})}


def with_saves(response: dict[str, Any], final_outputs: dict[int, RequestOutput]) -> dict[str, Any]:
    """Add each traced choice's saves to a dumped response (choice index = prompt index, since n = 1)."""
    for choice in response.get("choices", []):
        output = final_outputs.get(choice["index"])
        if output is not None:
            choice.update(saves_fields(output))
    return response
