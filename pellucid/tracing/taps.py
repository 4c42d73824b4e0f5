"""Taps: every tap-expressible op of a step at one site point, applied to all its rows at once.

A request's ops at one (site, point) are tap-expressible when, per position, they compose into one
affine edit `out = keep * x * scale + coef * value_row` plus saves of the value before or after that
edit. That covers save, set, add, scale, zero and mean ablation as long as at most one op with a
value selects each position and no save sits between two edits of the same target. Everything else
(`apply`, several values on one position, a save between edits) keeps the per-request path of
hooks.py.

A request's ops become a `TapProgram` once (tap_program.py; shared between requests with the same
ops where shared_programs.py allows): per-position arrays over the positions it computes. Each
step then copies slices of those arrays into pinned host buffers (no per-row Python), sends them to
the device in one copy, and the site's hook does one `where` + `addcmul` over all rows of the batch
and one `index_select` per save stage. Rows nobody edits have keep 1, scale 1, coef 0 (exact
identity). `keep` is separate from `scale`: zero / set / mean ablation discard the original value
(a NaN there does not leak through), while `scale(0.0)` multiplies it like the per-request path.

The same arithmetic runs inside captured CUDA graphs (`static_hooks`): per-runner static device
buffers hold keep / scale / add and copies of the tapped value; after replay the selected rows are
copied out of the static save buffers (a device op, no host sync).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pellucid.tracing.plan import TracePlan
from pellucid.tracing.save_log import SaveLog
from pellucid.tracing.shared_programs import SharedPrograms
from pellucid.tracing.tap_program import Target, TapProgram, program_forms

# ---- one step ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class TapUser:
    """A traced request whose ops at a target run as a tap this step."""

    plan: TracePlan
    program: TapProgram
    row_start: int
    num_rows: int
    first_position: int             # at the trace's first step (TargetTap.steps counts the steps since)


class _HostBuffers:
    """Pinned host staging for one target: [rows, 3] (keep, scale, coef) float32 and value indices."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.params = torch.empty((max_rows, 3), dtype=torch.float32, pin_memory=pin)
        self.value_index = torch.empty(max_rows, dtype=torch.int64, pin_memory=pin)
        self.params_np = self.params.numpy()
        self.value_index_np = self.value_index.numpy()


class _StaticBuffers:
    """Fixed device addresses a captured graph reads (keep, scale, add) and writes (saves)."""

    def __init__(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        ones = (1,) * len(shape)
        self.keep = torch.ones((rows, *ones), dtype=torch.bool, device=device)
        self.scale = torch.ones((rows, *ones), dtype=dtype, device=device)
        self.add = torch.zeros((rows, *shape), dtype=dtype, device=device)
        self.pre = torch.zeros((rows, *shape), dtype=dtype, device=device)
        self.post = torch.zeros((rows, *shape), dtype=dtype, device=device)


@dataclass(slots=True)
class _EditState:
    """What a target's keep / scale / add tensors were computed from."""

    params: np.ndarray
    value_index: np.ndarray
    table: torch.Tensor
    static: bool
    keep: torch.Tensor
    scale: torch.Tensor
    add: torch.Tensor


class TapRuntime:
    """Per-runner state that outlives a step: host staging buffers and the graphs' static buffers."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        # Host staging alternates between two sets per target: under async scheduling the next step is
        # filled before this one's readback, while this step's host-to-device copies may still be queued.
        self.host: dict[Target, list[_HostBuffers]] = {}
        self.uses: dict[Any, int] = {}
        self.static: dict[Target, _StaticBuffers] = {}
        self.last_trace: Any = None     # the last decode step's StepTrace, reused by the next one (hooks.py)
        # Per target: (key of the value forms, the step's value table, the forms it was built from).
        self.tables: dict[Target, tuple[tuple[Any, ...], torch.Tensor, list[torch.Tensor]]] = {}
        # Per (target, stage): two alternating pinned staging buffers for the save row index, grown as needed.
        self.index_staging: dict[tuple[Target, str], list[torch.Tensor | None]] = {}
        # Per target: the last edit tensors sent to the device and the host values they came from, so a
        # step with the same values (a steering vector on every decode step) sends and computes nothing.
        self.last_edit: dict[Target, _EditState] = {}
        # Tap programs shared by requests whose ops do the same at every position (one steering vector).
        self.shared_programs = SharedPrograms()

    def _next_slot(self, key: Any) -> int:
        use = self.uses.get(key, 0)
        self.uses[key] = use + 1
        return use % 2

    def host_buffers(self, target: Target) -> _HostBuffers:
        """The target's staging for this step (call once per step; the two sets alternate)."""
        pair = self.host.get(target)
        if pair is None:
            pair = self.host[target] = [_HostBuffers(self.max_rows, self.device),
                                        _HostBuffers(self.max_rows, self.device)]
        return pair[self._next_slot(target)]

    def index_to_device(self, target: Target, stage: str, rows: np.ndarray) -> torch.Tensor:
        """`rows` as an int64 index on the device, staged through a persistent pinned buffer (a fresh
        pin per step costs an allocation and an extra host copy)."""
        host = torch.from_numpy(rows)
        if self.device.type == "cpu":
            return host
        key = (target, stage)
        pair = self.index_staging.setdefault(key, [None, None])
        slot = self._next_slot(key)
        staging = pair[slot]
        if staging is None or staging.shape[0] < rows.size:
            staging = pair[slot] = torch.empty(max(rows.size, self.max_rows), dtype=torch.int64, pin_memory=True)
        staging[:rows.size].copy_(host)
        # Two alternating buffers, as host_buffers: the copy queued from this one is done by the time
        # it is rewritten, two steps later (the step in between has read its tokens back).
        return staging[:rows.size].to(self.device, non_blocking=True)

    def static_buffers(self, target: Target, shape: tuple[int, ...], dtype: torch.dtype) -> _StaticBuffers:
        if target not in self.static:
            self.static[target] = _StaticBuffers(self.max_rows, shape, dtype, self.device)
        return self.static[target]


@dataclass(slots=True)
class _SaveRecord:
    plan: TracePlan
    op_index: int
    positions: np.ndarray | int      # an int for one row (decode), kept unboxed: this runs per row
    start: int                # first row of this request in the stage's saved chunk


class _Stage:
    """The rows one save stage (before / after the edit) copies this step, and who they belong to (filled by
    _RowsLayout.fill_stage)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.records: list[_SaveRecord] = []
        self.count = 0
        self.index: torch.Tensor | None = None

    def finish_host(self, runtime: TapRuntime, target: Target, name: str) -> None:
        if self.count:
            self.index = runtime.index_to_device(target, name, np.asarray(self.rows, dtype=np.int64))

    def record(self, chunk: torch.Tensor) -> None:
        for r in self.records:
            if not r.plan.failed:       # a request that failed earlier in this forward keeps no saves
                r.plan.record_save(r.op_index, r.positions, chunk, r.start)

    def take(self, source: torch.Tensor) -> None:
        """Copy this stage's rows out of `source` (the tapped value, or a graph's static copy of it)."""
        self.record(source.index_select(0, self.index))


class _DecodeStage:
    """A save stage of a decode step: one row per hit (user, save op) pair, recorded with no per-row numpy."""

    def __init__(self, lists: list[list[Any]], positions: list[int], index: torch.Tensor | None) -> None:
        self.count = len(lists)
        self.lists, self.positions = lists, positions
        self.index = index

    def take(self, source: torch.Tensor) -> None:
        chunk = source.index_select(0, self.index)
        # Straight into each plan's save list (TracePlan.record_save's flat format): a failed plan has
        # swapped in a fresh dict, so whatever lands in its old list is dropped with it.
        for k, (saves, position) in enumerate(zip(self.lists, self.positions)):
            saves.extend((position, chunk, k))


class _LoggedStage:
    """A decode save stage in which every (request, save) pair of the layout saves its row: the rows go
    to the layout's SaveLog, whose reference each pair's save list already holds (no per-request work)."""

    def __init__(self, log: SaveLog, index: torch.Tensor, positions: np.ndarray) -> None:
        self.count = log.num_pairs
        self.log, self.index, self.positions = log, index, positions

    def take(self, source: torch.Tensor) -> None:
        self.log.write(source, self.index, self.positions)


class _DistinctPrograms:
    """The distinct programs of a step's tap users (requests sharing one, shared_programs.py, count once),
    with what the layouts concatenate over them."""

    def __init__(self, users: list[TapUser]) -> None:
        slot: dict[int, int] = {}
        self.programs: list[TapProgram] = []
        self.users: list[TapUser] = []                   # per program: a user reading it
        self.of_user = np.empty(len(users), dtype=np.int64)
        for j, u in enumerate(users):
            k = slot.get(id(u.program))
            if k is None:
                k = slot[id(u.program)] = len(self.programs)
                self.programs.append(u.program)
                self.users.append(u)
            self.of_user[j] = k
        lengths = np.array([p.params.shape[0] for p in self.programs], dtype=np.int64)
        self.bases = np.cumsum(lengths) - lengths         # each program's first entry in a concatenation

    def concatenate(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(p, field) for p in self.programs])

    def masks(self, stage: str) -> tuple[np.ndarray, list[list[int]]]:
        """The programs' save masks of `stage` concatenated, and per program the base of each of its masks."""
        masks: list[np.ndarray] = []
        bases: list[list[int]] = []
        base = 0
        for prog in self.programs:
            own = []
            for _, mask in getattr(prog, stage):
                own.append(base)
                masks.append(mask)
                base += mask.size
            bases.append(own)
        return (np.concatenate(masks) if masks else np.zeros(0, dtype=bool)), bases

    def table_starts(self, device: torch.device, tables: list[torch.Tensor]) -> np.ndarray:
        """Per program, the first row of its values in the step's value table (row 0 holds zeros, for rows
        without a value); appends each distinct set of value forms to `tables` once."""
        starts = np.zeros(len(self.programs), dtype=np.int64)
        rows: dict[tuple[int, ...], int] = {}
        next_row = 1
        for k, (prog, user) in enumerate(zip(self.programs, self.users)):
            if prog.edits and prog.value_ops:
                key, forms = prog.forms.get(device) or program_forms(user.plan, prog, device)
                if key not in rows:
                    rows[key] = next_row
                    tables.extend(forms)
                    next_row += sum(f.shape[0] for f in forms)
                starts[k] = rows[key]
        return starts


class _DecodeLayout:
    """Every user has one row (a decode step): their programs concatenated once, so that filling a step is
    a few numpy gathers over all users instead of work per user.

    A step's tap depends only on each user's program row at its position, and every user moves on one
    position per step. So the layout also knows, per user, the next position at which its row changes
    (`_next_change`): until the first user reaches one, the step's edit tensors and save stages are the
    last step's (only the saves' positions move on), and a steady step does no per-user work at all."""

    def __init__(self, tap: "TargetTap", runtime: TapRuntime) -> None:
        users = tap.users
        # Each distinct program once (requests sharing a program, shared_programs.py, share its rows).
        programs = _DistinctPrograms(users)
        self.bases = programs.bases[programs.of_user]
        self.rows = np.array([u.row_start for u in users], dtype=np.int64)
        self.params = programs.concatenate("params")
        self.value_local = programs.concatenate("value_local")
        self.has_value = programs.concatenate("has_value")
        changed = np.zeros(self.params.shape[0], dtype=bool)
        changed[1:] = (np.any(self.params[1:] != self.params[:-1], axis=1)
                       | (self.value_local[1:] != self.value_local[:-1]) | (self.has_value[1:] != self.has_value[:-1]))
        changed[programs.bases] = True
        self.edit_next_change = _next_change(changed)
        # Value table rows: fixed while the same users stay (one start per distinct set of forms).
        self.tables: list[torch.Tensor] = []
        self.starts = programs.table_starts(runtime.device, self.tables)[programs.of_user]
        self.table: torch.Tensor | None = None       # built on the first fill (the forms are fixed)
        # Every user advances one position per step (hooks.py reuses a decode layout only then), so the
        # positions are the users' first ones plus the tap's step count.
        self.first_positions = np.array([u.first_position for u in users], dtype=np.int64)
        # Per stage: the rows of the last step's hits and their device index, reused while unchanged.
        self.last_index: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        # Per stage: the log of the steps in which every pair saved (made on the first such step).
        self.logs: dict[str, SaveLog] = {}
        self.stages = {}
        # Per stage: (hit pairs' users, their save lists or None when every pair hit, device index) of the
        # last step the hits were computed in, and the first step count at which they may differ.
        self.last_hits: dict[str, tuple[np.ndarray, list[list[Any]] | None, torch.Tensor | None]] = {}
        self.hits_valid_until: dict[str, int] = {}
        for name in ("pre_saves", "post_saves"):
            # Every (user, save op) pair reads its program's mask, each distinct mask concatenated once.
            mask_flat, mask_base = programs.masks(name)
            pair_user, pair_lists, pair_base = [], [], []
            for i, (u, k) in enumerate(zip(users, programs.of_user.tolist())):
                for (op_index, _), base in zip(getattr(u.program, name), mask_base[k]):
                    pair_user.append(i)
                    pair_lists.append(u.plan.saves[u.plan.save_names[op_index]])
                    pair_base.append(base)
            changed = np.zeros(mask_flat.size, dtype=bool)
            changed[1:] = mask_flat[1:] != mask_flat[:-1]
            changed[[b for bases in mask_base for b in bases]] = True
            self.stages[name] = (np.array(pair_user, dtype=np.int64), pair_lists, mask_flat,
                                 np.array(pair_base, dtype=np.int64), _next_change(changed))
            self.hits_valid_until[name] = -1
        # The edit tensors this layout last made (runtime.last_edit's entry) and until which step count
        # its rows stay the same.
        self.edit_state: _EditState | None = None
        self.edit_valid_until = -1

    def positions(self, tap: "TargetTap") -> np.ndarray:
        """The users' positions this step, without a per-user Python loop."""
        return self.first_positions + tap.steps

    def _log(self, stage: str, lists: list[list[Any]]) -> SaveLog:
        """The stage's log; made (and referenced from every pair's save list) on its first step."""
        log = self.logs.get(stage)
        if log is None:
            log = self.logs[stage] = SaveLog(len(lists))
            # Rows recorded before this point precede the log in each list, later ones follow it: the
            # log's positions are all distinct from those (one position per step, moving on).
            for pair, saves in enumerate(lists):
                saves.extend((log, None, pair))
        return log

    def _hits(self, name: str, tap: "TargetTap", runtime: TapRuntime,
              positions: np.ndarray) -> tuple[np.ndarray, list[list[Any]] | None, torch.Tensor | None]:
        """The stage's hit pairs this step: recomputed only once some pair's mask may have changed."""
        if tap.steps < self.hits_valid_until[name]:
            return self.last_hits[name]
        pair_user, lists, mask_flat, mask_bases, next_change = self.stages[name]
        if not pair_user.size:
            self.hits_valid_until[name] = _FOREVER
            hits = self.last_hits[name] = (pair_user, [], None)
            return hits
        flat = mask_bases + positions[pair_user]
        hit = np.flatnonzero(mask_flat[flat])
        self.hits_valid_until[name] = tap.steps + int(np.min(next_change[flat] - flat))
        users = pair_user[hit]
        index = None
        if hit.size:
            rows = self.rows[users]
            last = self.last_index.get(name)
            if last is not None and np.array_equal(last[0], rows):
                index = last[1]        # the same rows as last step: the device index is still valid
            else:
                index = runtime.index_to_device(tap.target, name, rows)
                self.last_index[name] = (rows, index)
        hit_lists = None if hit.size == len(lists) else [lists[j] for j in hit.tolist()]
        hits = self.last_hits[name] = (users, hit_lists, index)
        return hits

    def fill(self, tap: "TargetTap", runtime: TapRuntime, num_rows: int) -> None:
        positions = self.positions(tap)
        stages = []
        for name in ("pre_saves", "post_saves"):
            users, hit_lists, index = self._hits(name, tap, runtime, positions)
            if hit_lists is None:
                stages.append(_LoggedStage(self._log(name, self.stages[name][1]), index, positions[users]))
            else:
                stages.append(_DecodeStage(hit_lists, positions[users].tolist(), index))
        tap.pre, tap.post = stages

    def reuse_edit(self, tap: "TargetTap", runtime: TapRuntime, num_rows: int, static: _StaticBuffers | None) -> bool:
        """Take the last step's edit tensors when no user's row changed since and nothing else has replaced
        them (the same rows, the same static buffers): a steering vector on every decode step sends and
        computes nothing."""
        state = self.edit_state
        if (state is None or tap.steps >= self.edit_valid_until or runtime.last_edit.get(tap.target) is not state
                or state.static != (static is not None) or state.keep.shape[0] != num_rows
                or (static is not None and state.keep.data_ptr() != static.keep.data_ptr())):
            return False
        tap.keep, tap.scale, tap.add, tap.table = state.keep, state.scale, state.add, self.table
        return True

    def fill_edit(self, tap: "TargetTap", runtime: TapRuntime, num_rows: int) -> None:
        """Write this step's (keep, scale, coef) and value rows into the tap's host staging."""
        positions = self.positions(tap)
        host = tap.host
        index = self.bases + positions
        host.params_np[:num_rows] = (1.0, 1.0, 0.0)
        host.value_index_np[:num_rows] = 0
        host.params_np[self.rows] = self.params[index]
        host.value_index_np[self.rows] = self.value_local[index] + self.starts * self.has_value[index]
        self.edit_valid_until = tap.steps + int(np.min(self.edit_next_change[index] - index))
        if self.table is None:
            self.table = tap._value_table(runtime, self.tables)
        tap.table = self.table


_FOREVER = np.iinfo(np.int64).max


def _next_change(changed: np.ndarray) -> np.ndarray:
    """Per index k: the smallest j > k with changed[j] (len(changed) if none)."""
    starts = np.flatnonzero(changed)
    bounded = np.append(starts, changed.size)
    return bounded[np.searchsorted(starts, np.arange(changed.size), side="right")]


class _RowsLayout:
    """The rows of a multi-row step's users and where each reads the users' programs.

    The distinct programs are concatenated (requests sharing a program share its rows); row i of the
    step's users is batch row `rows[i]`, at `positions[i]`, and reads entry `source[i]` of the
    concatenation (program `program_of_row[i]`)."""

    def __init__(self, users: list[TapUser], steps: int) -> None:
        self.distinct = _DistinctPrograms(users)
        self.programs = self.distinct.programs
        self.program_of_user = program_of_user = self.distinct.of_user
        counts = np.array([u.num_rows for u in users], dtype=np.int64)
        first = np.array([u.first_position for u in users], dtype=np.int64) + steps
        self.user_of_row = np.repeat(np.arange(len(users)), counts)
        self.rows_per_user = counts
        self.first_row_of_user = np.cumsum(counts) - counts       # in this layout's rows
        offset = np.arange(self.user_of_row.size) - np.repeat(self.first_row_of_user, counts)
        self.rows = np.array([u.row_start for u in users], dtype=np.int64)[self.user_of_row] + offset
        self.positions = first[self.user_of_row] + offset
        self.program_of_row = program_of_user[self.user_of_row]
        self.source = self.distinct.bases[self.program_of_row] + self.positions
        self.users = users

    def fill_stage(self, stage: "_Stage", name: str) -> None:
        """Record in `stage` every (user, save op) pair's selected rows among this step's rows."""
        mask_flat, mask_base = self.distinct.masks(name)
        if not mask_flat.size:
            return
        pair_user: list[int] = []
        pair_op: list[int] = []
        pair_base: list[int] = []
        for j, k in enumerate(self.program_of_user.tolist()):
            for (op_index, _), base in zip(getattr(self.programs[k], name), mask_base[k]):
                pair_user.append(j)
                pair_op.append(op_index)
                pair_base.append(base)
        # Every pair's rows: the user's rows, read in the pair's mask.
        users = np.array(pair_user, dtype=np.int64)
        pair_counts = self.rows_per_user[users]
        pair_of = np.repeat(np.arange(users.size), pair_counts)
        within = np.arange(pair_of.size) - np.repeat(np.cumsum(pair_counts) - pair_counts, pair_counts)
        row = self.first_row_of_user[users][pair_of] + within         # index into this layout's rows
        flat = np.array(pair_base, dtype=np.int64)[pair_of] + self.positions[row]
        hit = np.flatnonzero(mask_flat[flat])
        if not hit.size:
            return
        hit_pair = pair_of[hit]
        stage.rows = self.rows[row[hit]].tolist()
        positions = self.positions[row[hit]]
        starts = np.flatnonzero(np.diff(hit_pair, prepend=-1))       # each hit pair's first hit
        ends = np.append(starts[1:], hit.size)
        for p, a, b in zip(hit_pair[starts].tolist(), starts.tolist(), ends.tolist()):
            stage.records.append(_SaveRecord(self.users[pair_user[p]].plan, pair_op[p], positions[a:b], a))
        stage.count = int(hit.size)


class TargetTap:
    """This step's tap at one target: the device edit tensors and the save stages."""

    def __init__(self, target: Target, shape: tuple[int, ...], dtype: torch.dtype, users: list[TapUser]) -> None:
        self.target = target
        self.shape = shape
        self.dtype = dtype
        self.users = users
        self.edits = any(u.program.edits for u in users)
        self.pre, self.post = _Stage(), _Stage()
        self.keep: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.add: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self.num_rows = 0
        self.host: _HostBuffers | None = None          # this step's staging (edits only)
        # Decode steps this tap has moved on by (hooks.py reuses a trace for the next decode step of the
        # same batch): user u is at position u.first_position + steps.
        self.steps = 0
        self.decode_only = all(u.num_rows == 1 for u in users)
        self._decode: _DecodeLayout | None = None     # built on the first all-decode step, kept while reused

    @property
    def flags(self) -> tuple[bool, bool, bool]:
        return (self.edits, any(u.program.pre_saves for u in self.users),
                any(u.program.post_saves for u in self.users))

    def prepare(self, runtime: TapRuntime, num_rows: int, static: _StaticBuffers | None) -> None:
        """Fill the host arrays from each user's program slices, copy once, build keep / scale / add."""
        self.num_rows = num_rows
        if not self.decode_only:
            self.host = runtime.host_buffers(self.target) if self.edits else None
            self._fill_rows(runtime, num_rows)
            if self.edits:
                self._to_device(runtime, num_rows, static)
            return
        layout = self._decode
        if layout is None:
            layout = self._decode = _DecodeLayout(self, runtime)
        layout.fill(self, runtime, num_rows)
        if not self.edits or layout.reuse_edit(self, runtime, num_rows, static):
            self.host = None
            return
        self.host = runtime.host_buffers(self.target)
        layout.fill_edit(self, runtime, num_rows)
        self._to_device(runtime, num_rows, static)
        layout.edit_state = runtime.last_edit.get(self.target)

    def _fill_rows(self, runtime: TapRuntime, num_rows: int) -> None:
        """A step with multi-row users (prefill, chunked prefill, mixed): this step's save stages and edit
        staging for every user's rows, read from the users' programs (each distinct one once, concatenated)
        with a few numpy gathers over all rows, not a slice per user."""
        layout = _RowsLayout(self.users, self.steps)
        self.pre, self.post = _Stage(), _Stage()
        for stage, name in ((self.pre, "pre_saves"), (self.post, "post_saves")):
            layout.fill_stage(stage, name)
            stage.finish_host(runtime, self.target, name)
        if not self.edits:
            return
        params, value_index = self.host.params_np, self.host.value_index_np
        params[:num_rows] = (1.0, 1.0, 0.0)
        value_index[:num_rows] = 0
        tables: list[torch.Tensor] = []
        table_start = layout.distinct.table_starts(runtime.device, tables)
        edits = np.array([p.edits for p in layout.programs], dtype=bool)[layout.program_of_row]
        rows, source = layout.rows[edits], layout.source[edits]
        params[rows] = layout.distinct.concatenate("params")[source]
        has_value = layout.distinct.concatenate("has_value")[source]
        value_index[rows] = (layout.distinct.concatenate("value_local")[source]
                             + table_start[layout.program_of_row[edits]] * has_value)
        self.table = self._value_table(runtime, tables)

    def _to_device(self, runtime: TapRuntime, num_rows: int, static: _StaticBuffers | None) -> None:
        device = runtime.device
        host = self.host
        table = self.table
        params_np, index_np = host.params_np[:num_rows], host.value_index_np[:num_rows]
        last = runtime.last_edit.get(self.target)
        if (last is not None and last.table is table and last.static == (static is not None)
                and (static is None or last.keep.data_ptr() == static.keep.data_ptr())
                and np.array_equal(last.params, params_np) and np.array_equal(last.value_index, index_np)):
            # The same edit as the last step at this target (e.g. one steering vector on every decode
            # step): its device tensors (or the static buffers, which only this writes) still hold it.
            self.keep, self.scale, self.add = last.keep, last.scale, last.add
            return
        params_dev = _to_device(host.params[:num_rows], device)
        index_dev = _to_device(host.value_index[:num_rows], device)
        ones = (1,) * len(self.shape)
        keep_src = params_dev[:, 0].reshape(num_rows, *ones)
        scale_src = params_dev[:, 1].reshape(num_rows, *ones)
        coef = params_dev[:, 2].reshape(num_rows, *ones)
        if static is None:
            self.keep = keep_src != 0
            self.scale = scale_src.to(self.dtype)
            self.add = table.index_select(0, index_dev)
        else:
            self.keep, self.scale, self.add = static.keep[:num_rows], static.scale[:num_rows], static.add[:num_rows]
            torch.ne(keep_src, 0, out=self.keep)
            self.scale.copy_(scale_src)
            torch.index_select(table, 0, index_dev, out=self.add)
        self.add.mul_(coef)
        runtime.last_edit[self.target] = _EditState(params_np.copy(), index_np.copy(), table, static is not None,
                                                    self.keep, self.scale, self.add)

    def _value_table(self, runtime: TapRuntime, tables: list[torch.Tensor]) -> torch.Tensor:
        """Zeros row + every distinct value of the step; reused while the same values stay in the batch."""
        key = (self.dtype, *(id(t) for t in tables))
        cached = runtime.tables.get(self.target)
        if cached is not None and cached[0] == key:
            return cached[1]
        zeros = torch.zeros((1, *self.shape), dtype=self.dtype, device=runtime.device)
        table = torch.cat([zeros, *tables]) if tables else zeros
        # The key holds ids only: the cache keeps the forms alive so an id cannot be reused meanwhile.
        runtime.tables[self.target] = (key, table, tables)
        return table

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Eager: saves before the edit, the edit (out of place), saves after it."""
        if x.shape[0] != self.num_rows:
            raise RuntimeError(f"{'.'.join(self.target)}: {x.shape[0]} rows reach the tap, prepared for "
                               f"{self.num_rows}")
        if self.pre.count:
            self.pre.take(x)
        out = edit(x, self.keep, self.scale, self.add) if self.edits else x
        if self.post.count:
            self.post.take(out)
        return out

    def collect_static(self, static: _StaticBuffers) -> None:
        """After a graph replay: copy the selected rows out of the static save buffers."""
        if self.pre.count:
            self.pre.take(static.pre)
        if self.post.count:
            self.post.take(static.post)


def edit(x: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """`keep * x * scale + add` per row, out of place (no other consumer of x sees the edit); a row
    that does not keep x ignores it entirely (NaN or inf included)."""
    return torch.addcmul(add, torch.where(keep, x, 0.0), scale)


def captured_tap(static: _StaticBuffers, size: int, flags: tuple[bool, bool, bool]) -> Any:
    """The tap as a captured graph runs it: whole-value copies into the static save buffers (the
    selected rows are gathered after replay) and the edit from the static keep / scale / add."""
    edits, pre, post = flags

    def run(x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] != size:
            raise RuntimeError(f"a tap captured for {size} rows got {x.shape[0]}")
        if pre:
            static.pre[:size].copy_(x)
        out = edit(x, static.keep[:size], static.scale[:size], static.add[:size]) if edits else x
        if post:
            static.post[:size].copy_(out)
        return out if edits else None
    return run


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned staging is rewritten next step only after the step's token readback has synchronised.
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


@contextlib.contextmanager
def install_hooks(modules: dict[str, nn.Module], taps: dict[Target, Any], run: Any) -> Iterator[None]:
    """Forward (pre-)hooks on the tapped modules calling `run(target, x) -> new x or None`.

    A site a tensor-parallel rank holds only part of (parallel_layers.py `tp_sites`) is gathered first, so
    `run` sees the full HuggingFace tensor on every rank; an edited value goes back as each rank's part.
    Every rank installs the same hooks (the same plans run on every rank), so the gathers pair up."""
    handles = []
    try:
        for target in taps:
            site, point = target
            module = modules[site]
            shard = getattr(module, "tp_sites", {}).get(point)
            call = run if shard is None else _gathered(run, shard)
            if point == "input":
                def pre(_m: nn.Module, args: tuple[Any, ...], target: Target = target,
                        call: Any = call) -> tuple[Any, ...] | None:
                    if not args or not isinstance(args[0], torch.Tensor):
                        raise RuntimeError(f"{target[0]}.input: the module was called without a tensor first "
                                           f"argument")
                    new = call(target, args[0])
                    return None if new is None else (new, *args[1:])
                handles.append(module.register_forward_pre_hook(pre))
            else:
                def post(_m: nn.Module, _a: tuple[Any, ...], output: Any, target: Target = target,
                         call: Any = call) -> Any:
                    if not isinstance(output, torch.Tensor):
                        raise RuntimeError(f"{target[0]}.output is a {type(output).__name__}, not a tensor")
                    return call(target, output)
                handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _gathered(run: Any, shard: Any) -> Any:
    """`run` on the full tensor of which each tensor-parallel rank holds part `shard` (dim 1)."""
    from pellucid.distributed.parallel_state import get_tensor_parallel
    tp = get_tensor_parallel()
    assert tp is not None

    def run_full(target: Target, x: torch.Tensor) -> torch.Tensor | None:
        new = run(target, tp.gather_shards(x, shard))
        return None if new is None else tp.local_part(new, shard)
    return run_full
