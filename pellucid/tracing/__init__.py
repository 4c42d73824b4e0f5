"""Tracing and interventions: read and edit any activation of any request inside the batched engine.

Offline: `with llm.trace(prompts, params) as tr: ...` (pellucid/tracing/api.py). Engine level: a
`TracePlan` (or a list of ops / JSON ops) in `extras={"trace": ...}` of any entry point. See
docs/tracing.md.
"""
from pellucid.tracing.ops import (Add, Apply, MeanAblate, Op, Save, Scale, Set, Zero, op_from_json, ops_from_json,
                                  ops_to_json)
from pellucid.tracing.plan import TracePlan
from pellucid.tracing.serialization import b64_to_tensors, tensors_to_b64

__all__ = ["Op", "Save", "Set", "Add", "Scale", "Zero", "MeanAblate", "Apply", "TracePlan", "op_from_json",
           "ops_from_json", "ops_to_json", "tensors_to_b64", "b64_to_tensors", "Trace", "TraceError",
           "async_trace"]


def __getattr__(name: str):
    # The offline API imports the engine, which imports this package: load it only when asked for.
    if name in ("Trace", "TraceError", "async_trace"):
        from pellucid.tracing import api
        return getattr(api, name)
    raise AttributeError(f"module 'pellucid.tracing' has no attribute {name!r}")
