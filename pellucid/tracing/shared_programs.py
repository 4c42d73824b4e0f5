"""Tap programs shared by requests whose ops at a target do the same thing at every position.

A request's tap program (taps.py) is per-position arrays over the positions it computes, built at its
first traced step (~40-80 us of host time per request and target). When every op of the request at the
target selects every position (no positions or phase given) and no value carries one row per position,
the program holds the same entries at every position it covers. Requests with the same ops there (the
same op kinds at the same op indices, scale factors and values, i.e. the same memory at the same
version: a batch sharing one steering vector) can then read one program: each reads it only at the positions it computes, which all lie
before its own limit, so a program built for the longest of them serves them all. A request longer than
the cached program gets a new one, which replaces it.

The key holds where the values live, and the entry holds the values, so that memory is never reused
by another tensor while its entry lives. The cache keeps the most recently used entries (`capacity`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pellucid.tracing.plan import TracePlan
from pellucid.tracing.selectors import Selector
from pellucid.tracing.tap_program import Target, TapProgram, build_program, value_has_rows

EVERY_POSITION = Selector()
DEFAULT_CAPACITY = 64


class SharedPrograms:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        # key -> (program or None for the per-request path, the limit it covers, the values it keeps alive)
        self._entries: OrderedDict[tuple[Any, ...], tuple[TapProgram | None, int, tuple[Any, ...]]] = OrderedDict()
        self.hits = 0           # for tests and benchmarks
        self.builds = 0

    def program_for(self, plan: TracePlan, target: Target) -> TapProgram | None:
        """`build_program(plan, target, plan.limit)`, shared with earlier requests where that gives the same
        entries at every position this request computes. Raises what build_program raises."""
        shared = _shared_key(plan, target)
        if shared is None:
            return build_program(plan, target, plan.limit)
        key, values = shared
        entry = self._entries.get(key)
        # A None program (the per-request path) depends on the ops alone, never on the length.
        if entry is not None and (entry[0] is None or entry[1] >= plan.limit):
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]
        program = build_program(plan, target, plan.limit)
        self.builds += 1
        self._entries[key] = (program, plan.limit, values)
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return program


def _shared_key(plan: TracePlan, target: Target) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """(key, values) when the plan's program at `target` is the same at every position, else None."""
    parts: list[Any] = [target]
    values: list[Any] = []
    for i in plan.ops_at(*target):
        op = plan.ops[i]
        if op.selector != EVERY_POSITION or getattr(op, "per_unit", False):
            return None
        field = getattr(op, "value_field", None)
        value = getattr(op, field) if field is not None else None
        if value is not None:
            if value_has_rows(plan, i):
                return None
            values.append(value)
        parts.append((i, type(op), getattr(op, "factor", None), None if value is None else _value_identity(value)))
    return tuple(parts), tuple(values)


def _value_identity(value: Any) -> tuple[Any, ...]:
    """Which memory holds the value, and which version of it: ops made from one user tensor hold distinct
    detached tensors over the same storage, and a program's device copy of the value (its forms) must not
    outlive an in-place change of it (the version counter, shared by a tensor and its detached views)."""
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
            value.dtype, value.device, value._version)
