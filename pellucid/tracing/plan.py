"""A request's trace: its ops and, once bound to a request, the saves it accumulates and its error.

The tracing request feature (feature.py) binds a fresh plan to each traced request when it is added
and finalizes the plans of requests that end (their saves become the final `RequestOutput.extras`,
whose only owner the output then is).
"""
from __future__ import annotations

import operator
import traceback as traceback_module
from collections import Counter
from itertools import chain
from typing import Any, Iterable

import numpy as np
import torch

from pellucid.logger import get_logger
from pellucid.tracing.ops import LOGITS, TOKENS, Op, Save, ops_from_json
from pellucid.tracing.save_log import SaveLog
from pellucid.tracing.sites import SiteInfo

logger = get_logger(__name__)

TRACE_KEY = "trace"         # request.extras key holding the TracePlan


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
        plan.limit = max_total_tokens - 1     # the last sampled token is never fed back
        for i, (op, (selected, site)) in enumerate(zip(self.ops, self.resolve(prompt_len, max_total_tokens, table))):
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

    def first_position(self) -> int:
        """The first position any op of this bound plan touches."""
        return min(int(selected[0]) for selected in self.selected)

    def resolve(self, prompt_len: int, max_total_tokens: int, table: Any) -> list[tuple[np.ndarray, Any]]:
        """Per op, the positions it selects in a request of this shape and its site, checked against the site
        table (ValueError naming the op otherwise). A frontend checks a request with this alone."""
        limit = max_total_tokens - 1
        resolved = []
        for i, op in enumerate(self.ops):
            try:
                site = table.check(op)
                selected = op.selector.resolve(prompt_len, limit)
            except ValueError as exc:
                raise ValueError(f"trace op {i} ({op.kind} at {op.target}): {exc}") from exc
            if selected.size == 0:
                raise ValueError(f"trace op {i} ({op.describe()}) selects no position of this request "
                                 f"({prompt_len} prompt tokens, positions 0..{limit - 1} computed)")
            try:
                op.check_fits(site.shape, int(selected.size))
            except ValueError as exc:
                raise ValueError(f"trace op {i} ({op.describe()}): {exc}") from exc
            resolved.append((selected, site))
        return resolved

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
    gathered together, with one copy per distinct recorded chunk or SaveLog block and one stream sync per
    group, instead of slices, a concatenation and a sync per request and save. `position_limits[i]`: plan
    i keeps only positions below it (rows recorded by a step launched ahead of the request's end, under
    async scheduling); None keeps all."""
    results: list[dict[str, Any]] = []
    groups: dict[tuple[Any, ...], list[_Wanted]] = {}
    # The group of a save by its first recorded tensor (usually a chunk all the plans share): the tuple key
    # of its shape, dtype and device is made once per tensor, not per save.
    group_of_tensor: dict[tuple[int, bool], list[_Wanted]] = {}
    limits = position_limits if position_limits is not None else [None] * len(plans)
    for plan, limit in zip(plans, limits):
        plan.finalized = True
        if plan.failed:
            results.append({"trace_error": {"message": plan.error, "traceback": plan.error_traceback}})
            continue
        saves: dict[str, torch.Tensor] = {}
        positions: dict[str, list[int]] = {}
        on_device = plan.keep_saves_on_device
        for index, name in plan.save_names.items():
            chunks = plan.saves[name]
            first = _first_recorded(chunks)
            if first is None:
                _publish_empty(saves, positions, name, plan.sites[index])
                continue
            group = group_of_tensor.get((id(first[0]), on_device))
            if group is None:
                tensor, leading = first
                key = (tuple(tensor.shape[leading:]), tensor.dtype, tensor.device, on_device)
                group = group_of_tensor[(id(tensor), on_device)] = groups.setdefault(key, [])
            group.append(_Wanted(saves, positions, name, chunks, on_device, limit, plan.sites[index]))
        plan.saves = {}
        results.append({"saves": saves, "save_positions": positions})
    for group in groups.values():
        _gather_group(group)
    return results


def _first_recorded(chunks: list[Any]) -> tuple[torch.Tensor, int] | None:
    """The first tensor holding rows of a save's records and its number of leading (non per-row) dims: a
    chunk ([rows, *shape], 1) or a SaveLog block ([steps, pairs, *shape], 2); None when no record holds a row."""
    for k in range(0, len(chunks), 3):
        rows = chunks[k + 1]
        if rows is not None:
            return rows, 1
        blocks = chunks[k].blocks        # a SaveLog reference
        if blocks:
            return blocks[0], 2
    return None


def _publish_empty(saves: dict[str, torch.Tensor], positions: dict[str, list[int]], name: str,
                   site: SiteInfo) -> None:
    saves[name] = torch.empty((0, *site.shape), dtype=site.dtype)
    positions[name] = []


class _Wanted:
    """One save of one finishing request: its recorded chunks, and the dicts its result goes to."""

    __slots__ = ("saves", "positions", "name", "chunks", "count", "on_device", "limit", "site")

    def __init__(self, saves: dict[str, torch.Tensor], positions: dict[str, list[int]], name: str,
                 chunks: list[Any], on_device: bool, limit: int | None, site: SiteInfo) -> None:
        self.saves, self.positions, self.name, self.chunks = saves, positions, name, chunks
        self.on_device = on_device
        self.limit = limit          # keep only positions below it; None keeps all
        self.site = site            # for an empty save
        self.count = 0              # rows of its assembled save


_CHUNKS = operator.attrgetter("chunks")
_NO_LIMIT = np.iinfo(np.int64).max


class _RecordedRows:
    """Every row the records of a group hold, in recording order (save after save): its position, the
    save it belongs to (index in the group), and where it lies: row `rows[i]` of the (virtual)
    concatenation of `pieces`, the distinct recorded chunks and the blocks of the SaveLogs referenced."""

    def __init__(self, group: list[_Wanted]) -> None:
        flat = list(chain.from_iterable(w.chunks for w in group))     # positions, rows, start, positions, ...
        positions_of: list[Any] = flat[0::3]
        tensors: list[torch.Tensor | None] = flat[1::3]
        starts_of: list[int | None] = flat[2::3]
        records_per_want = np.fromiter(map(len, map(_CHUNKS, group)), dtype=np.int64, count=len(group)) // 3
        # A record's positions: an int (one row: a decode step), an array (a run of rows of its chunk from
        # `start`), or a SaveLog (its pair `start`'s row of every step logged so far; no chunk).
        multi = [i for i, p in enumerate(positions_of) if type(p) is not int]
        array_at: list[int] = []
        logs: dict[int, tuple[SaveLog, list[int], list[int]]] = {}     # id -> the log, its records, pairs
        for i in multi:
            if tensors[i] is None:
                log = positions_of[i]
                entry = logs.get(id(log))
                if entry is None:
                    entry = logs[id(log)] = (log, [], [])
                entry[1].append(i)
                entry[2].append(starts_of[i])
            else:
                array_at.append(i)
        steps_of = [log.num_steps for log, _, _ in logs.values()]
        sizes = np.ones(len(tensors), dtype=np.int64)
        if array_at:
            sizes[array_at] = [positions_of[i].size for i in array_at]
        for (_, records, _), steps in zip(logs.values(), steps_of):
            sizes[records] = steps
        record_starts = np.cumsum(sizes) - sizes
        want_first_record = np.cumsum(records_per_want) - records_per_want
        self.rows_per_want = np.add.reduceat(sizes, want_first_record)
        self.want = np.repeat(np.arange(len(group)), self.rows_per_want)

        # The pieces: the distinct chunks in order of first record, then each log's blocks.
        ids = list(map(id, tensors))
        chunk_of_id = dict(zip(ids, tensors))
        chunk_of_id.pop(id(None), None)
        self.pieces: list[torch.Tensor] = list(chunk_of_id.values())
        piece_of_id = dict(zip(chunk_of_id, range(len(chunk_of_id))))
        piece_of_id[id(None)] = 0           # a log record's (unused)
        log_first_piece = []
        for (log, _, _), steps in zip(logs.values(), steps_of):
            log_first_piece.append(len(self.pieces))
            self.pieces.extend(log.flat_blocks(steps))
        piece_sizes = np.array([piece.shape[0] for piece in self.pieces], dtype=np.int64)
        self.bases = np.cumsum(piece_sizes) - piece_sizes

        total = int(record_starts[-1] + sizes[-1])
        self.positions = np.empty(total, dtype=np.int64)
        self.rows = np.empty(total, dtype=np.int64)
        # Each chunk record's first row in the concatenation of the pieces.
        first_row = self.bases[np.fromiter(map(piece_of_id.__getitem__, ids), dtype=np.int64, count=len(ids))]
        first_row += np.array([0 if s is None else s for s in starts_of] if None in starts_of else starts_of,
                              dtype=np.int64)
        if not multi:
            self.positions[:] = positions_of
            self.rows[:] = first_row
            return
        if len(multi) < len(positions_of):
            is_int = np.ones(len(positions_of), dtype=bool)
            is_int[multi] = False
            at = np.flatnonzero(is_int)
            self.positions[record_starts[at]] = [positions_of[i] for i in at.tolist()]
            self.rows[record_starts[at]] = first_row[at]
        if array_at:
            values = np.concatenate([positions_of[i] for i in array_at], axis=None)
            array_sizes = sizes[array_at]
            within = np.arange(values.size) - np.repeat(np.cumsum(array_sizes) - array_sizes, array_sizes)
            at = np.repeat(record_starts[array_at], array_sizes) + within
            self.positions[at] = values
            self.rows[at] = np.repeat(first_row[array_at], array_sizes) + within
        for (log, records, pairs), steps, first_piece in zip(logs.values(), steps_of, log_first_piece):
            if steps:
                pairs_np = np.array(pairs, dtype=np.int64)
                at = record_starts[records][:, None] + np.arange(steps)
                self.positions[at] = log.positions_of(pairs_np, steps)
                self.rows[at] = log.row_index(pairs_np, steps) + self.bases[first_piece]


def _gather_group(group: list[_Wanted]) -> None:
    """Assemble the saves of `group` (one per-token shape, dtype, device and on_device flag), vectorised
    over every row of every save: on a GPU one copy per piece recorded, a copy to the host per save and
    one sync."""
    recorded = _RecordedRows(group)
    positions, rows, want = recorded.positions, recorded.rows, recorded.want
    counts = recorded.rows_per_want
    if positions.size:
        top = int(positions.max())
        limits = [w.limit for w in group if w.limit is not None]
        if limits and min(limits) <= top:          # some row may lie at or beyond its save's limit
            limit_of_want = np.array([_NO_LIMIT if w.limit is None else w.limit for w in group], dtype=np.int64)
            keep = positions < limit_of_want[want]
            if not keep.all():
                positions, rows, want = positions[keep], rows[keep], want[keep]
                counts = np.bincount(want, minlength=len(group))
        # Per save, each distinct position (sorted) from the row recorded last: a recompute after
        # preemption replaces the earlier value, so no position is duplicated. Usually every save's rows
        # were recorded in ascending positions already.
        span = top + 1
        keys = want * span + positions
        if not np.all(keys[1:] > keys[:-1]):
            keys, first_in_reversed = np.unique(keys[::-1], return_index=True)
            rows = rows[rows.size - 1 - first_in_reversed]
            want, positions = keys // span, keys % span
            counts = np.bincount(want, minlength=len(group))
    saved_positions = positions.tolist()
    live: list[_Wanted] = []
    offset = 0
    for w, count in zip(group, counts.tolist()):
        if count:
            w.positions[w.name] = saved_positions[offset:offset + count]
            w.count = count
            live.append(w)
            offset += count
        else:               # every row it recorded lies at or beyond its limit
            _publish_empty(w.saves, w.positions, w.name, w.site)
    if not live:
        return
    gathered, fresh = _take_rows(recorded.pieces, recorded.bases, rows)
    if gathered.device.type == "cuda" and not live[0].on_device:
        _to_host_per_save(live, gathered)
        return
    for w, saved in zip(live, torch.split(gathered, [w.count for w in live])):
        if w.on_device:
            w.saves[w.name] = saved     # the plan asked for device tensors (keep_saves_on_device)
        else:
            # A save is a copy that shares memory with nothing else (no other save, no activation).
            w.saves[w.name] = saved if fresh and len(live) == 1 else saved.clone()


def _take_rows(pieces: list[torch.Tensor], bases: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, bool]:
    """Rows `rows` of the concatenation of `pieces` (whose first rows are at `bases`), in that order, and
    whether the result is a fresh tensor (else it is a piece or a slice of one). Each piece is copied once
    into its rows of the result: whole, as a slice, or by one gather."""
    owner = np.searchsorted(bases, rows, side="right") - 1
    device = pieces[0].device
    if len(pieces) == 1 or not np.any(owner != owner[0]):
        c = int(owner[0])
        local = rows - bases[c]
        first = _run_start(local)
        if first is None:
            return pieces[c].index_select(0, _index(local, device)), True
        if first == 0 and local.size == pieces[c].shape[0]:
            return pieces[c], False
        return pieces[c][first:first + local.size], False
    # Per piece: the rows of the result it fills (`at`, ascending) and the rows of its own they take.
    order = np.argsort(owner, kind="stable")
    ends = np.cumsum(np.bincount(owner, minlength=len(pieces))).tolist()
    copies: list[tuple[torch.Tensor, bool, int | None]] = []     # source, gathered?, result run start
    indices: list[np.ndarray] = []          # the index arrays, moved to the device in one copy
    begin = 0
    for c, end in enumerate(ends):
        if end == begin:
            continue
        at = order[begin:end]
        begin = end
        local = rows[at] - bases[c]
        source = pieces[c]
        first = _run_start(local)
        if first is None:
            indices.append(local)
        elif first != 0 or local.size != source.shape[0]:
            source = source[first:first + local.size]
        run = int(at[0]) if int(at[-1]) - int(at[0]) + 1 == at.size else None
        if run is None:
            indices.append(at)
        copies.append((source, first is None, run))
    device_indices = iter(torch.split(_index(np.concatenate(indices), device), [i.size for i in indices])
                          if indices else ())
    result = torch.empty((rows.size, *pieces[0].shape[1:]), dtype=pieces[0].dtype, device=device)
    for source, gathered, run in copies:
        if gathered:
            source = source.index_select(0, next(device_indices))
        if run is None:
            result.index_copy_(0, next(device_indices), source)
        else:
            result[run:run + source.shape[0]].copy_(source)
    return result, True


def _run_start(local: np.ndarray) -> int | None:
    """local[0] when `local` is consecutive ascending rows, else None."""
    first = int(local[0])
    if int(local[-1]) - first + 1 != local.size:
        return None
    return first if local.size < 3 or bool(np.all(np.diff(local) == 1)) else None


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
