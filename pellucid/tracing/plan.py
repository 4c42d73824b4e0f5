"""A request's trace: its ops and, once bound to a request, the saves it accumulates and its error.

The engine calls `prepare_traced_request` when a request is added (validates the ops against the
model's sites, binds a fresh plan to the request, sets its prefix-cache policy) and
`finish_traced_requests` when requests end (stacks the saves into `request.extras["outputs"]`, which
the output processor copies into `RequestOutput.extras`).
"""
from __future__ import annotations

import traceback as traceback_module
from collections import Counter
from typing import Any, Iterable

import numpy as np
import torch

from pellucid.logger import get_logger
from pellucid.tracing.ops import LOGITS, TOKENS, Op, Save, ops_from_json
from pellucid.tracing.sites import SiteInfo, site_table

logger = get_logger(__name__)

TRACE_KEY = "trace"         # request.extras key holding the TracePlan
OUTPUTS_KEY = "outputs"     # request.extras key the output processor copies into RequestOutput.extras


class TraceFailure(Exception):
    """An op failed for one request; carries the message and the traceback text."""


class TracePlan:
    """`TracePlan(ops)`: what to do for one request. `bind` gives a request its own copy with state."""

    def __init__(self, ops: Iterable[Op]) -> None:
        self.ops: list[Op] = list(ops)
        for i, op in enumerate(self.ops):
            if not isinstance(op, Op):
                raise ValueError(f"trace op {i} is a {type(op).__name__}, not a pellucid.tracing op")
        self.save_names = _save_names(self.ops)
        # Set by bind():
        self.bound = False
        self.request_id: str | None = None
        self.selected: list[np.ndarray] = []          # per op: sorted positions it selects
        self.sites: list[SiteInfo] = []               # per op: the site it addresses
        self.by_target: dict[tuple[str, str], list[int]] = {}
        self.limit = 0                                # positions 0 .. limit - 1 are computed
        self.module_target_list: list[tuple[str, str]] = []
        self.has_logits_ops = self.has_tokens_ops = self.edits_logits = False
        # Per target: the tap program (taps.py), or None where the per-request path runs; built lazily.
        self.tap_programs: dict[tuple[str, str], Any] = {}
        # Per save name: the (positions, rows, start) chunks recorded, in recording order (see record_save).
        self.saves: dict[str, list[tuple[np.ndarray, torch.Tensor, int | None]]] = {}
        self.error: str | None = None
        self.error_traceback: str | None = None
        self.newly_failed = False                     # failed during the current step (runner reports it)
        self.finalized = False

    @classmethod
    def from_extras(cls, value: Any) -> "TracePlan":
        """Accept a TracePlan, a list of ops, or a list of JSON op objects."""
        if isinstance(value, TracePlan):
            return value
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            return cls(ops_from_json(value))
        if isinstance(value, (list, tuple)):
            return cls(value)
        raise ValueError(f"extras['trace'] must be a TracePlan or a list of ops, got {type(value).__name__}")

    @property
    def edits(self) -> bool:
        return any(op.edits for op in self.ops)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def bind(self, prompt_len: int, max_total_tokens: int, request_id: str, table: Any) -> "TracePlan":
        """A fresh plan for one request: ops checked against the site table, selectors resolved."""
        plan = TracePlan(self.ops)
        plan.bound = True
        plan.request_id = request_id
        limit = max_total_tokens - 1          # the last sampled token is never fed back
        plan.limit = limit
        for i, op in enumerate(self.ops):
            try:
                site = table.check(op)
                selected = op.selector.resolve(prompt_len, limit)
            except ValueError as exc:
                raise ValueError(f"trace op {i} ({op.kind} at {op.target}): {exc}") from exc
            if selected.size == 0:
                raise ValueError(f"trace op {i} ({op.describe()}) selects no position of this request "
                                 f"({prompt_len} prompt tokens, positions 0..{limit - 1} computed)")
            plan.selected.append(selected)
            plan.sites.append(site)
            plan.by_target.setdefault((op.site, op.point), []).append(i)
        plan.saves = {name: [] for name in plan.save_names.values()}
        # Looked up for every traced request at every step: computed once here.
        plan.module_target_list = plan.module_targets()
        plan.has_logits_ops = bool(plan.ops_at(LOGITS))
        plan.has_tokens_ops = bool(plan.ops_at(TOKENS))
        plan.edits_logits = any(plan.ops[i].edits for i in plan.ops_at(LOGITS))
        return plan

    def module_targets(self) -> list[tuple[str, str]]:
        return [t for t in self.by_target if t[0] not in (LOGITS, TOKENS)]

    def ops_at(self, site: str, point: str = "output") -> list[int]:
        return self.by_target.get((site, point), [])

    def record_save(self, op_index: int, positions: np.ndarray | int, rows: torch.Tensor,
                    start: int | None = None) -> None:
        """Store a chunk of copied rows (row j at positions[j]); with `start`, the rows are
        rows[start:start + len(positions)] of a chunk shared with other requests of the step (a tap's
        one copy for all its rows), sliced when the saves are assembled. Chunks are kept whole, not
        split per position (a per-row Python loop costs ~1 us x tokens x saves per step, which
        extraction of long prompts feels); a position recorded again (recomputed after preemption)
        replaces the earlier row when the saves are assembled, so it is never duplicated."""
        if not isinstance(positions, int):      # an int (one row) stays unboxed until finalize
            positions = np.asarray(positions, dtype=np.int64)
        self.saves[self.save_names[op_index]].append((positions, rows, start))

    def fail(self, op_index: int, exc: BaseException) -> None:
        op = self.ops[op_index]
        self.error = f"trace op {op_index} ({op.describe()}) failed: {type(exc).__name__}: {exc}"
        self.error_traceback = "".join(traceback_module.format_exception(exc))
        self.newly_failed = True
        self.saves = {}
        logger.warning("request %s: %s", self.request_id, self.error)

    def finalize(self) -> dict[str, Any]:
        """Saves stacked in position order on the CPU, their positions, or the error."""
        self.finalized = True
        if self.failed:
            return {"trace_error": {"message": self.error, "traceback": self.error_traceback}}
        saves, positions = {}, {}
        for index, name in self.save_names.items():
            chunks = self.saves[name]
            site = self.sites[index]
            if not chunks:
                saves[name] = torch.empty((0, *site.shape), dtype=site.dtype)
                positions[name] = []
                continue
            recorded = np.concatenate([np.atleast_1d(p) for p, _, _ in chunks]).astype(np.int64)
            parts = [r if start is None else r[start:start + np.size(p)] for p, r, start in chunks]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            # For each distinct position (sorted), the row recorded last.
            order, first_in_reversed = np.unique(recorded[::-1], return_index=True)
            last = recorded.size - 1 - first_in_reversed
            if not np.array_equal(last, np.arange(recorded.size)):
                rows = rows[torch.as_tensor(last, device=rows.device)]
            shared = rows is parts[0] and chunks[0][2] is not None
            rows = _to_host(rows)
            # A slice of a step's shared chunk must not alias other requests' saves (saves are copies).
            saves[name] = rows.clone() if shared and rows.data_ptr() == parts[0].data_ptr() else rows
            positions[name] = order.tolist()
        if any(t.is_pinned() for t in saves.values()):
            torch.cuda.current_stream().synchronize()     # completes _to_host's non-blocking copies
        self.saves = {}
        return {"saves": saves, "save_positions": positions}


def _to_host(rows: torch.Tensor) -> torch.Tensor:
    """CPU copy of a save. Device tensors go through pinned memory (PyTorch caches those buffers): a
    pageable copy runs at a fraction of the bandwidth and stalls the step loop on large saves (hidden-
    state extraction moves tens of MB per request). The caller synchronizes the stream afterwards."""
    if rows.device.type != "cuda":
        return rows.to("cpu")
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    return host


def _save_names(ops: list[Op]) -> dict[int, str]:
    """Op index -> save name; unnamed saves are called after their site ("model.layers.0.output",
    then "...#1", "...#2" for repeats). Two saves with one name are an error."""
    explicit = Counter(op.name for op in ops if isinstance(op, Save) and op.name is not None)
    duplicated = [name for name, count in explicit.items() if count > 1]
    if duplicated:
        raise ValueError(f"several saves are named {duplicated[0]!r}; save names must be unique per request")
    names: dict[int, str] = {}
    used = set(explicit)
    for i, op in enumerate(ops):
        if not isinstance(op, Save):
            continue
        name = op.name
        if name is None:
            name, k = op.target, 0
            while name in used:
                k += 1
                name = f"{op.target}#{k}"
        used.add(name)
        names[i] = name
    return names


# ---- engine integration ---------------------------------------------------------------------------
def prepare_traced_request(request: Any, num_samples: int, runner: Any) -> None:
    """If the request carries a trace: validate and bind it, and set its prefix-cache policy.
    Raises ValueError (the request is then not queued) for anything wrong with the trace."""
    value = request.extras.get(TRACE_KEY)
    if value is None:
        return
    if num_samples != 1:
        raise ValueError(f"a traced request must have n=1 (got n={num_samples}); send n separate requests")
    plan = TracePlan.from_extras(value)
    if not plan.ops:
        raise ValueError("the trace has no ops")
    request.extras[TRACE_KEY] = plan.bind(request.num_prompt_tokens, request.max_total_tokens,
                                          request.request_id, site_table(runner))
    # A traced request computes every prompt position itself; an edited one's KV is not the model's.
    request.read_prefix_cache = False
    if plan.edits:
        request.publish_prefix_cache = False


def finish_traced_requests(requests: Iterable[Any]) -> None:
    """Publish the saves (or the trace error) of traced requests that just finished."""
    for request in requests:
        plan = request.extras.get(TRACE_KEY)
        if plan is None or not request.is_finished or not isinstance(plan, TracePlan) or not plan.bound:
            continue
        if plan.finalized:
            continue
        outputs = request.extras.setdefault(OUTPUTS_KEY, {})
        if request.error is not None and not plan.failed:
            plan.error = request.error
        outputs.update(plan.finalize())
