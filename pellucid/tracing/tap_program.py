"""A request's tap program: its ops at one target as per-position arrays (see taps.py).

A request's ops at one (site, point) are tap-expressible when, per position, they compose into one
affine edit `out = keep * x * scale + coef * value_row` plus saves of the value before or after that
edit. `build_program` turns them into per-position arrays once (at the request's first traced step),
and each step of taps.py copies slices of those arrays; it returns None where the ops need the
per-request path of hooks.py.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from pellucid.tracing.ops import Add, MeanAblate, Save, Scale, Set, Zero
from pellucid.tracing.plan import TracePlan

Target = tuple[str, str]          # (module path, "input" | "output")

_VALUE_OPS = (Set, Add, MeanAblate)
_TAP_OPS = (Save, Set, Add, MeanAblate, Scale, Zero)
# Table forms of edit values on the device, keyed by the user's tensor: requests that share one
# steering vector share one device copy (and one row of the step's value table).
_TABLE_FORMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass
class TapProgram:
    """One request's ops at one target as per-position arrays (index = absolute position)."""

    edits: bool
    keep: np.ndarray                        # float32 0/1: keep the original value
    scale: np.ndarray                       # float32 multiplier of the (kept) original value
    coef: np.ndarray                        # float32 multiplier of the value row
    value_slot: np.ndarray                  # int64 index into value_ops, len(value_ops) = no value
    value_rank: np.ndarray                  # int64 row of that op's table form
    value_ops: list[int]                    # op indices carrying a value
    pre_saves: list[tuple[int, np.ndarray]] = field(default_factory=list)    # (op index, bool mask)
    post_saves: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # Filled by _pack for the per-step copy: [size, 3] (keep, scale, coef); the value row within this
    # program's own forms (0 where no value) and whether there is one (0 / 1).
    params: np.ndarray = field(default_factory=lambda: np.empty((0, 3), np.float32))
    value_local: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    has_value: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    forms: dict[torch.device, tuple[tuple[int, ...], list[torch.Tensor]]] = field(default_factory=dict)

    def _pack(self, value_rows: list[int]) -> None:
        # Filled column by column, and the value-row starts summed in Python: this runs once per traced
        # request, and np.stack / np.cumsum over a handful of items cost more than the work.
        params = np.empty((self.keep.size, 3), np.float32)
        params[:, 0], params[:, 1], params[:, 2] = self.keep, self.scale, self.coef
        self.params = params
        has_value = self.value_slot < len(self.value_ops)
        self.has_value = has_value.astype(np.int64)
        starts = np.fromiter(itertools.accumulate(value_rows, initial=0), dtype=np.int64, count=len(value_rows) + 1)
        self.value_local = np.where(has_value, starts[self.value_slot] + self.value_rank, 0)


def build_program(plan: TracePlan, target: Target, limit: int) -> TapProgram | None:
    """The request's tap program at `target`, or None when its ops there need the per-request path. Its values
    fit their sites: TracePlan.bind checked them (Op.check_fits)."""
    indices = plan.ops_at(*target)
    ops = [plan.ops[i] for i in indices]
    if not all(isinstance(op, _TAP_OPS) and not (isinstance(op, Scale) and op.per_unit) for op in ops):
        return None
    edit_order = [k for k, op in enumerate(ops) if op.edits]
    size = limit + 1        # one spare identity position, so a slice never runs short
    masks = {}
    for i in indices:
        mask = np.zeros(size, dtype=bool)
        mask[plan.selected[i][plan.selected[i] < size]] = True
        masks[i] = mask
    value_indices = [i for i, op in zip(indices, ops) if isinstance(op, _VALUE_OPS)]
    if len(value_indices) > 1 and np.any(np.sum([masks[i] for i in value_indices], axis=0) > 1):
        return None         # two values on one position: their composition needs two table rows
    program = TapProgram(
        edits=bool(edit_order), keep=np.ones(size, np.float32), scale=np.ones(size, np.float32),
        coef=np.zeros(size, np.float32), value_slot=np.full(size, len(value_indices), np.int64),
        value_rank=np.zeros(size, np.int64), value_ops=value_indices)
    for k, (i, op) in enumerate(zip(indices, ops)):
        mask = masks[i]
        if isinstance(op, Save):
            if edit_order and edit_order[0] < k < edit_order[-1]:
                return None     # sees some edits of this target but not others
            (program.post_saves if edit_order and k > edit_order[0] else program.pre_saves).append((i, mask))
        elif isinstance(op, Scale):
            program.scale[mask] *= op.factor
            program.coef[mask] *= op.factor
        elif isinstance(op, Zero):
            program.keep[mask] = program.scale[mask] = program.coef[mask] = 0.0
        elif isinstance(op, Add):
            program.coef[mask] += 1.0
        else:                   # Set, MeanAblate: replace
            program.keep[mask] = program.scale[mask] = 0.0
            program.coef[mask] = 1.0
        if isinstance(op, _VALUE_OPS):
            program.value_slot[mask] = value_indices.index(i)
            if value_has_rows(plan, i):
                program.value_rank[plan.selected[i][plan.selected[i] < size]] = np.arange(
                    int(np.sum(plan.selected[i] < size)))
    program._pack([getattr(plan.ops[i], plan.ops[i].value_field).shape[0] if value_has_rows(plan, i) else 1
                   for i in value_indices])
    return program


def value_has_rows(plan: TracePlan, op_index: int) -> bool:
    op = plan.ops[op_index]
    return op.has_rows(plan.sites[op_index].shape)


def program_forms(plan: TracePlan, program: TapProgram, device: torch.device) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    forms = [table_form(plan, i, device) for i in program.value_ops]
    program.forms[device] = (tuple(id(f) for f in forms), forms)
    return program.forms[device]


def table_form(plan: TracePlan, op_index: int, device: torch.device) -> torch.Tensor:
    """The op's value as [rows, *site_shape] in the site's dtype on `device` (cached per user tensor)."""
    op = plan.ops[op_index]
    value = getattr(op, op.value_field)
    site = plan.sites[op_index]
    rows = value.shape[0] if value_has_rows(plan, op_index) else 1
    key = (device, site.dtype, site.shape, rows)
    forms = _TABLE_FORMS.get(value)
    if forms is None:
        forms = _TABLE_FORMS[value] = {}
    form = forms.get(key)
    if form is None:
        form = value.to(device=device, dtype=site.dtype).expand(rows, *site.shape).contiguous()
        forms[key] = form
    return form
