"""A request's trace: its ops and, once bound to a request, the saves it accumulates and its error.

The engine calls `prepare_traced_request` when a request is added (validates the ops against the
model's sites, binds a fresh plan to the request, sets its prefix-cache policy) and
`finish_traced_requests` when requests end (stacks the saves into `request.extras["outputs"]`, which
the output processor moves into the final `RequestOutput.extras`: the output is then their only owner).
"""
from __future__ import annotations

import operator
import traceback as traceback_module
from collections import Counter
from typing import Any, Iterable

import numpy as np
import torch

from pellucid.engine.output_processor import FEATURE_OUTPUTS_KEY
from pellucid.engine.request import RequestStatus, allow_step_ahead_for_extras_key
from pellucid.logger import get_logger
from pellucid.tracing.ops import LOGITS, TOKENS, Op, Save, ops_from_json
from pellucid.tracing.save_log import SaveLog
from pellucid.tracing.sites import SiteInfo, site_table

logger = get_logger(__name__)

TRACE_KEY = "trace"         # request.extras key holding the TracePlan
OUTPUTS_KEY = FEATURE_OUTPUTS_KEY    # request.extras key the final RequestOutput.extras takes over
# Ops, saves and recorded tokens live on the device per step, and a request's saves are cut at its
# end (`_trim_rows`), so traced requests work on steps launched ahead of the previous readback.
allow_step_ahead_for_extras_key(TRACE_KEY)
# By id: an enum member's hash is computed in Python, an int's in C (enum members are singletons).
_FINISHED_STATUS_IDS = frozenset(id(status) for status in RequestStatus if status.finished)


class TraceFailure(Exception):
    """An op failed for one request; carries the message and the traceback text."""


class TracePlan:
    """`TracePlan(ops)`: what to do for one request. `bind` gives a request its own copy with state."""

    def __init__(self, ops: Iterable[Op], keep_saves_on_device: bool = False) -> None:
        ops = list(ops)
        for i, op in enumerate(ops):
            if not isinstance(op, Op):
                raise ValueError(f"trace op {i} is a {type(op).__name__}, not a pellucid.tracing op")
        self._init_state(ops, keep_saves_on_device, _save_names(ops))

    def _init_state(self, ops: list[Op], keep_saves_on_device: bool, save_names: dict[int, str]) -> None:
        """Every attribute, for ops already checked (bind() makes each request's plan from checked ops)."""
        self.ops: list[Op] = ops
        # Saves are published as device tensors (read-only; they may share memory with other saves)
        # instead of host copies: the consumer moves them itself, off the step loop (extraction).
        self.keep_saves_on_device = keep_saves_on_device
        self.save_names = save_names
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
        # Per save name: the chunks recorded, in recording order, as a flat list positions, rows, start,
        # positions, rows, start, ... (see record_save).
        self.saves: dict[str, list[Any]] = {}
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
        plan = object.__new__(TracePlan)      # this plan's ops and save names were checked when it was made
        plan._init_state(list(self.ops), self.keep_saves_on_device, dict(self.save_names))
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
        replaces the earlier row when the saves are assembled, so it is never duplicated.
        The list is flat (no tuple per record): a decode step records one row per request, and that
        many surviving container objects per step make Python's cyclic GC run full collections of
        the whole heap (~100 ms each) every few hundred steps."""
        if not isinstance(positions, int):      # an int (one row) stays unboxed until finalize
            positions = np.asarray(positions, dtype=np.int64)
        self.saves[self.save_names[op_index]].extend((positions, rows, start))

    def fail(self, op_index: int, exc: BaseException) -> None:
        op = self.ops[op_index]
        self.error = f"trace op {op_index} ({op.describe()}) failed: {type(exc).__name__}: {exc}"
        self.error_traceback = "".join(traceback_module.format_exception(exc))
        self.newly_failed = True
        self.saves = {}
        logger.warning("request %s: %s", self.request_id, self.error)

    def finalize(self) -> dict[str, Any]:
        """Saves stacked in position order on the CPU, their positions, or the error."""
        return finalize_plans([self])[0]


def finalize_plans(plans: list[TracePlan], position_limits: list[int] | None = None) -> list[dict[str, Any]]:
    """`finalize` for several plans at once (the requests that finish in one step): all their saves are
    gathered together, with at most one copy per distinct recorded chunk, one reordering gather and one
    stream sync per group, instead of slices, a concatenation and a sync per request and save. `position_limits[i]`: plan i keeps only positions below it (rows recorded by a step
    launched ahead of the request's end, under async scheduling); None keeps all."""
    results: list[dict[str, Any]] = []
    wanted: list[_Wanted] = []
    limits = position_limits if position_limits is not None else [None] * len(plans)
    _expand_save_logs(plans)
    for plan, limit in zip(plans, limits):
        plan.finalized = True
        if plan.failed:
            results.append({"trace_error": {"message": plan.error, "traceback": plan.error_traceback}})
            continue
        saves: dict[str, torch.Tensor] = {}
        positions: dict[str, list[int]] = {}
        for index, name in plan.save_names.items():
            chunks = plan.saves[name]
            if chunks and limit is not None:
                chunks = _below(chunks, limit)
            if chunks:
                wanted.append(_Wanted(saves, positions, name, chunks, plan.keep_saves_on_device))
            else:
                site = plan.sites[index]
                saves[name] = torch.empty((0, *site.shape), dtype=site.dtype)
                positions[name] = []
        plan.saves = {}
        results.append({"saves": saves, "save_positions": positions})
    groups: dict[tuple[Any, ...], list[_Wanted]] = {}
    for w in wanted:
        first = w.chunks[1]
        groups.setdefault((tuple(first.shape[1:]), first.dtype, first.device, w.on_device), []).append(w)
    for group in groups.values():
        _gather_group(group)
    return results


def _expand_save_logs(plans: list[TracePlan]) -> None:
    """Replace each reference to a SaveLog (save_log.py) in the plans' save lists by one ordinary record:
    the pair's rows of every step logged, taken out of each log with one gather for all finishing pairs."""
    refs: dict[int, tuple[SaveLog, list[tuple[list[Any], int, int]]]] = {}
    for plan in plans:
        if plan.failed:
            continue
        for chunks in plan.saves.values():
            if not any(type(p) is SaveLog for p in chunks[0::3]):
                continue
            for k in range(0, len(chunks), 3):
                log = chunks[k]
                if type(log) is SaveLog:
                    refs.setdefault(id(log), (log, []))[1].append((chunks, k, chunks[k + 2]))
    for log, pairs in refs.values():
        rows, positions = log.rows_of([pair for _, _, pair in pairs])
        steps = log.num_steps
        for j, (chunks, k, _) in enumerate(pairs):
            chunks[k:k + 3] = (positions[j], rows, j * steps)


def _below(chunks: list[Any], limit: int) -> list[Any]:
    """The flat record list (positions, rows, start, ...) without positions >= limit."""
    kept: list[Any] = []
    for k in range(0, len(chunks), 3):
        positions, rows, start = chunks[k:k + 3]
        if type(positions) is int:
            if positions < limit:
                kept.extend((positions, rows, start))
            continue
        keep = positions < limit
        if keep.all():
            kept.extend((positions, rows, start))
        elif keep.any():      # positions of a record ascend: keep a prefix of its rows
            kept.extend((positions[:int(keep.sum())], rows, start))
    return kept




class _Wanted:
    """One save of one finishing request: its recorded chunks, and the dicts its result goes to."""

    __slots__ = ("saves", "positions", "name", "chunks", "count", "on_device")

    def __init__(self, saves: dict[str, torch.Tensor], positions: dict[str, list[int]], name: str,
                 chunks: list[Any], on_device: bool = False) -> None:
        self.saves, self.positions, self.name, self.chunks = saves, positions, name, chunks
        self.on_device = on_device
        self.count = 0          # rows of its assembled save


def _gather_group(group: list[_Wanted]) -> None:
    """Assemble the saves of `group` (one per-token shape, dtype, device and on_device flag), vectorised
    over every record of every save: on a GPU one gather, a copy to the host per save and one sync."""
    # Every record (positions, chunk, first row) of the group, flattened.
    positions_of: list[Any] = []
    tensors: list[torch.Tensor] = []
    starts_of: list[int | None] = []
    records_per_want = np.empty(len(group), dtype=np.int64)
    for k, w in enumerate(group):
        flat = w.chunks            # positions, rows, start, positions, rows, start, ...
        positions_of.extend(flat[0::3])
        tensors.extend(flat[1::3])
        starts_of.extend(flat[2::3])
        records_per_want[k] = len(flat) // 3
    num_records = len(tensors)
    # A record holds one row (an int position: a decode step) or an array of positions.
    multi = [i for i, p in enumerate(positions_of) if type(p) is not int]
    sizes = np.ones(num_records, dtype=np.int64)
    for i in multi:
        sizes[i] = positions_of[i].size
    record_starts = np.cumsum(sizes) - sizes
    if multi:
        positions = np.empty(int(sizes.sum()), dtype=np.int64)
        single = np.ones(num_records, dtype=bool)
        single[multi] = False
        positions[record_starts[single]] = [p for p, one in zip(positions_of, single.tolist()) if one]
        for i in multi:
            positions[record_starts[i]:record_starts[i] + sizes[i]] = positions_of[i]
    else:
        positions = np.array(positions_of, dtype=np.int64)
    _, first, chunk_of_record = np.unique(np.fromiter(map(id, tensors), dtype=np.int64, count=num_records),
                                          return_index=True, return_inverse=True)
    chunks = [tensors[i] for i in first.tolist()]
    record_of_row = np.repeat(np.arange(num_records), sizes)
    first_rows = np.fromiter((s or 0 for s in starts_of), dtype=np.int64, count=num_records)
    local_row = first_rows[record_of_row] + np.arange(positions.size) - record_starts[record_of_row]
    chunk_sizes = np.array([c.shape[0] for c in chunks], dtype=np.int64)
    bases = np.cumsum(chunk_sizes) - chunk_sizes
    row_in_all = bases[chunk_of_record[record_of_row]] + local_row    # in a virtual concatenation of the chunks
    # Per save, each distinct position (sorted) from the row recorded last: a recompute after preemption
    # replaces the earlier value, so no position is duplicated.
    want_of_row = np.repeat(np.arange(len(group)), records_per_want)[record_of_row]
    span = int(positions.max()) + 1
    keys, first_in_reversed = np.unique((want_of_row * span + positions)[::-1], return_index=True)
    wanted_rows = row_in_all[positions.size - 1 - first_in_reversed]
    counts = np.bincount(keys // span, minlength=len(group))
    for w, saved in zip(group, np.split(keys % span, np.cumsum(counts)[:-1])):
        w.positions[w.name] = saved.tolist()
        w.count = saved.size
    # Copy only the rows someone wants: whole chunks, slices or one gather per chunk, then one reorder.
    needed = sorted_unique(wanted_rows)
    owner = np.searchsorted(bases, needed, side="right") - 1
    device = chunks[0].device
    pieces = []
    for segment in np.split(np.arange(needed.size), np.flatnonzero(np.diff(owner)) + 1):
        c = int(owner[segment[0]])
        local = needed[segment] - bases[c]
        if local.size == chunk_sizes[c]:
            pieces.append(chunks[c])            # every row of the chunk, in order
        elif local[-1] - local[0] + 1 == local.size:
            pieces.append(chunks[c][int(local[0]):int(local[-1]) + 1])
        else:
            pieces.append(chunks[c].index_select(0, _index(local, device)))
    gathered = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    order = np.searchsorted(needed, wanted_rows)
    if order.size != needed.size or np.any(order != np.arange(order.size)):   # else no reordering gather
        gathered = gathered.index_select(0, _index(order, device))
    if device.type == "cuda" and not group[0].on_device:
        _to_host_per_save(group, gathered)
        return
    fresh = gathered._base is None and not any(gathered is c for c in chunks)
    offset = 0
    for w in group:
        rows = gathered[offset:offset + w.count]
        offset += w.count
        if w.on_device:
            w.saves[w.name] = rows      # the plan asked for device tensors (keep_saves_on_device)
        else:
            # A save is a copy that shares memory with nothing else (no other save, no activation).
            w.saves[w.name] = rows if fresh and len(group) == 1 else rows.clone()


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) by sorting: numpy 2's np.unique without return_index hashes, which costs ~50 us
    for a hundred values and ~0.5 ms for a few thousand, several times a sort."""
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def _index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device, non_blocking=True)


def _to_host_per_save(group: list[_Wanted], gathered: torch.Tensor) -> None:
    """One pinned CPU tensor per save (sharing memory with nothing else), filled by non-blocking copies
    and completed by one stream sync. Measured on the H100 inside the engine (benchmarks/tracing_bench.py,
    64 saves, 37 MB per generate): 32 ms this way against 92 ms through one reused pinned staging buffer
    and a pageable clone per save. Fresh host memory, pinned or pageable, costs about 1 ms/MB on that
    machine; torch's pinned-memory cache recycles the blocks of saves the application has dropped."""
    offset = 0
    for w in group:
        rows = gathered[offset:offset + w.count]
        offset += w.count
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        w.saves[w.name] = host
    torch.cuda.current_stream(gathered.device).synchronize()


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
    """Publish the saves (or the trace error) of traced requests that just finished, assembled together."""
    requests = requests if isinstance(requests, list) else list(requests)
    # This runs over every request that progressed, every step, and usually none has finished: that test
    # runs in C (a Python loop over a large batch costs ~20 us a step).
    if not any(map(_FINISHED_STATUS_IDS.__contains__, map(id, map(operator.attrgetter("status"), requests)))):
        return
    finishing = []
    for request in requests:
        if not request.is_finished:
            continue
        extras = request.extras
        plan = extras.get(TRACE_KEY) if extras else None
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
        request.extras.setdefault(OUTPUTS_KEY, {}).update(result)
