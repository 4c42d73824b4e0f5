"""Runs trace ops inside a batched step: each op on its own request's rows, for this step only.

The runner builds a StepTrace for a step whose batch holds traced requests (None otherwise, so an
untraced step pays nothing). At each addressed (site, point), the ops that are tap-expressible
(save, set, add, scale, zero, mean ablation; taps.py) run as one vectorised tap over every row of the
batch; the rest (`apply`, unusual compositions) run per request on that request's rows. A step whose
module targets are all taps can replay a CUDA graph captured with those taps (`graph_key`); any
other traced step runs eagerly with forward hooks on exactly the addressed modules for its one
forward. The logits / tokens parts run around the LM head and sampler.

Rows: request r owns rows query_start_loc[r]:query_start_loc[r+1] of every flat [num_tokens, ...]
activation, at consecutive positions from its computed-token count. An op touches the rows whose
positions it selects, whatever the tensor's shape beyond the first dim; rows past num_tokens
(padding) are never touched. Edits go to a copy of the activation that the hook returns, so no other
consumer of the original tensor sees them; saves are copies, never views.
"""
from __future__ import annotations

import collections
import contextlib
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pellucid.runner.sampler import host_to_device
from pellucid.runner.sampling_metadata import merge_sampler_outputs
from pellucid.tracing.ops import LOGITS, TOKENS
from pellucid.tracing.plan import TRACE_KEY, TracePlan, sorted_unique
from pellucid.tracing.taps import Target, TapRuntime, TapUser, TargetTap, captured_tap, install_hooks


_MODULES: "weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]]" = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class _Traced:
    """One traced request of the step and where its rows are."""

    plan: TracePlan
    row_start: int
    num_rows: int
    first_position: int
    sample_index: int | None        # its row among the step's sampling rows, if it samples
    batch_index: int = 0
    steps_seen: int = 0             # the trace's step count first_position was last brought up to

    def selection(self, op_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, ranks) of this step's rows that the op selects; ranks index the op's selection."""
        selected = self.plan.selected[op_index]
        lo = int(np.searchsorted(selected, self.first_position))
        hi = int(np.searchsorted(selected, self.first_position + self.num_rows))
        return selected[lo:hi], np.arange(lo, hi)


def _modules_of(model: nn.Module) -> dict[str, nn.Module]:
    modules = _MODULES.get(model)
    if modules is None:
        modules = dict(model.named_modules())
        _MODULES[model] = modules
    return modules


class StepTrace:
    def __init__(self, model: nn.Module, traced: list[_Traced], sample_rows: np.ndarray, num_tokens: int,
                 runtime: TapRuntime) -> None:
        self.model = model
        self.traced = traced
        self.sample_rows = sample_rows          # batch row of each sampling request, in sampling order
        self.num_tokens = num_tokens
        self.runtime = runtime
        self.sampling_logits: torch.Tensor | None = None   # edited exact logits of the edited_samples rows
        self.edited_samples = np.empty(0, dtype=np.int64)   # sampling rows whose logits an op edits
        self.taps: dict[Target, TargetTap] = {}
        self.per_request: dict[Target, list[_Traced]] = {}
        self._graph = False
        # Decode steps reuse this trace (see for_step): each step's per-request work touches only the
        # requests it concerns, never a Python loop over the whole batch.
        self._steps = 0                         # decode steps this trace has advanced by
        self._batch_index = np.array([t.batch_index for t in traced], dtype=np.int64)
        self._first_positions = np.array([t.first_position for t in traced], dtype=np.int64)
        # Traced requests are the batch's first rows (every row, when the batch has no more): see _continues.
        self._leading_rows_traced = bool(np.array_equal(self._batch_index, np.arange(len(traced))))
        self._logits_users = [t for t in traced if t.plan.has_logits_ops]
        self._logit_editors = [t for t in traced if t.plan.edits_logits]
        self._token_users = [t for t in traced if t.sample_index is not None and t.plan.has_tokens_ops]
        # Plans fail only through _fail while this trace runs; finish_step reports exactly these, each with
        # the step it failed in. Under async scheduling this trace may already run the next step (launched
        # ahead) when a step is collected: `_launched` holds the steps not collected yet, oldest first.
        self._newly_failed: list[tuple[int, _Traced]] = []
        self._launched: collections.deque[int] = collections.deque()
        self._any_failed = False
        self._split_targets()
        self._graph_key = None if self.per_request else tuple(sorted((t, tap.flags) for t, tap in self.taps.items()))
        self.requests: list[Any] = []           # the batch's requests, to recognise the next decode step

    @classmethod
    def for_step(cls, so: Any, model: nn.Module, runtime: TapRuntime) -> "StepTrace | None":
        """The step's trace, or None when no request in the batch is traced (or all traces failed)."""
        previous = runtime.last_trace
        if previous is not None and previous._continues(so):
            previous._advance()
            previous._launched.append(previous._steps)
            return previous
        traced: list[_Traced] = []
        sample_index = 0
        row = 0
        sample_rows = []
        for batch_index, (request, samples, n, computed) in enumerate(zip(
                so.requests, so.samples, so.num_scheduled_tokens, so.num_computed_tokens)):
            if samples:
                sample_rows.append(row + n - 1)
            plan = request.extras.get(TRACE_KEY) if request.extras else None
            if plan is not None:
                if not isinstance(plan, TracePlan) or not plan.bound:
                    raise RuntimeError(f"request {request.request_id} carries a trace that was not prepared; "
                                       f"add traced requests through EngineCore.add_request")
                if not plan.failed:
                    traced.append(_Traced(plan, row, n, computed, sample_index if samples else None,
                                          batch_index))
            sample_index += int(samples)
            row += n
        if not traced:
            runtime.last_trace = None
            return None
        trace = cls(model, traced, np.asarray(sample_rows, dtype=np.int64), row, runtime)
        trace._launched.append(0)
        # A decode step (one row per request) whose next step has the same requests reuses this one.
        decode = row == len(so.requests)
        trace.requests = list(so.requests) if decode else []
        runtime.last_trace = trace if decode else None
        return trace

    def _continues(self, so: Any) -> bool:
        """Is `so` the next decode step of exactly this batch (same requests, rows and sampling)? Also
        when the last step is still in flight (async scheduling: the scheduler has already advanced every
        request's computed tokens by one for it, exactly as after a collected step)."""
        requests = so.requests
        if not self.requests or len(requests) != len(self.requests) or so.total_num_scheduled_tokens != len(requests):
            return False
        if self._any_failed or not all(map(operator.is_, requests, self.requests)) or not all(so.samples):
            return False
        computed = np.asarray(so.num_computed_tokens, dtype=np.int64)
        if not (self._leading_rows_traced and computed.size == self._batch_index.size):
            computed = computed[self._batch_index]
        # Equal shapes here (the same requests, the same traced rows): an elementwise compare suffices.
        return bool((computed == self._first_positions + (self._steps + 1)).all())

    def _advance(self) -> None:
        """Move every traced request one position on; forget the last step's per-step state.
        A _Traced's first_position is brought up to date only when it is read (_up_to_date); a tap counts
        the steps for all its users at once (TargetTap.steps)."""
        self._steps += 1
        for tap in self.taps.values():
            tap.steps += 1
        self.sampling_logits = None

    def _up_to_date(self, users: list[_Traced]) -> list[_Traced]:
        """`users`, with first_position moved on by the decode steps since it was last read."""
        steps = self._steps
        for t in users:
            if t.steps_seen != steps:
                t.first_position += steps - t.steps_seen
                t.steps_seen = steps
        return users

    def _fail(self, t: _Traced, op_index: int, exc: BaseException) -> None:
        t.plan.fail(op_index, exc)
        self._newly_failed.append((self._steps, t))
        self._any_failed = True

    def _split_targets(self) -> None:
        """Per addressed module target: the requests that run as a tap, and those that run per request."""
        users: dict[Target, list[TapUser]] = {}
        for t in self.traced:     # runs before any step: first_position is current
            plan = t.plan
            for target in plan.module_target_list:
                if plan.failed:
                    break
                if target not in plan.tap_programs:
                    try:
                        plan.tap_programs[target] = self.runtime.shared_programs.program_for(plan, target)
                    except ValueError as exc:     # this request fails, the step runs for the others
                        self._fail(t, plan.ops_at(*target)[0], exc)
                        break
                program = plan.tap_programs[target]
                if program is None:
                    self.per_request.setdefault(target, []).append(t)
                else:
                    users.setdefault(target, []).append(TapUser(plan, program, t.row_start, t.num_rows,
                                                                t.first_position))
        for target, tap_users in users.items():
            live = [u for u in tap_users if not u.plan.failed]
            if live:
                site = live[0].plan.sites[live[0].plan.ops_at(*target)[0]]
                self.taps[target] = TargetTap(target, site.shape, site.dtype, live)
        self.per_request = {k: [t for t in v if not t.plan.failed] for k, v in self.per_request.items()}
        self.per_request = {k: v for k, v in self.per_request.items() if v}

    # ---- CUDA graphs ------------------------------------------------------------------------------
    @property
    def graph_key(self) -> tuple[Any, ...] | None:
        """What a graph replaying this step must have captured (the tapped targets and what each
        does), or None when some op needs the per-request path (eager only). () means no module tap."""
        return self._graph_key

    def capture_hooks(self, size: int) -> Any:
        """Context manager for capturing a graph of `size` rows with this step's taps (static buffers)."""
        runs = {}
        for target, tap in self.taps.items():
            static = self.runtime.static_buffers(target, tap.shape, tap.dtype)
            runs[target] = captured_tap(static, size, tap.flags)
        return install_hooks(_modules_of(self.model), runs, lambda target, x: runs[target](x))

    def prepare(self, num_rows: int, graph: bool) -> None:
        """Fill the taps for this step's `num_rows` rows: fresh tensors when eager, the static buffers a
        captured graph reads when `graph`. Call after the batch is built, before the forward."""
        self._graph = graph
        for target, tap in self.taps.items():
            static = self.runtime.static_buffers(target, tap.shape, tap.dtype) if graph else None
            tap.prepare(self.runtime, num_rows, static)

    def after_replay(self) -> None:
        """Copy the saved rows out of the static buffers the replayed graph wrote."""
        for target, tap in self.taps.items():
            tap.collect_static(self.runtime.static[target])

    # ---- module sites (eager) -----------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Hooks on the addressed modules for the duration of one eager forward."""
        targets = {**{t: None for t in self.taps}, **{t: None for t in self.per_request}}

        def run(target: Target, x: torch.Tensor) -> torch.Tensor | None:
            out = x
            tap = self.taps.get(target)
            if tap is not None:
                out = tap.apply(x)
            users = self.per_request.get(target)
            if users:
                new = self._run_ops(target[0], target[1], out, users)
                out = out if new is None else new
            return None if out is x else out
        with install_hooks(_modules_of(self.model), targets, run):
            yield

    def _run_ops(self, site: str, point: str, x: torch.Tensor, users: list[_Traced],
                 index_of_row: np.ndarray | None = None, copy_on_edit: bool = True) -> torch.Tensor | None:
        """Apply each user's ops at (site, point) to its own rows of x. Returns the edited copy, or None
        when nothing was edited. `index_of_row` maps batch rows to rows of x when x holds only some rows."""
        result = x
        edited = False
        for t in self._up_to_date(users):
            plan = t.plan
            if plan.failed:
                continue
            op_index = -1
            try:
                for op_index in plan.ops_at(site, point):
                    op = plan.ops[op_index]
                    positions, ranks = t.selection(op_index)
                    if positions.size == 0:
                        continue
                    rows = positions - t.first_position + t.row_start
                    if index_of_row is not None:
                        rows = index_of_row[rows]
                    index = _row_index(rows, result.device)
                    if op.edits:
                        if copy_on_edit and not edited:
                            result = x.clone()
                        edited = True
                        new = op.edit(result[index], ranks, len(plan.selected[op_index]))
                        result[index] = new
                    else:
                        plan.record_save(op_index, positions, _copy_rows(result, index))
            except Exception as exc:  # one request's failing op must not affect the others
                self._fail(t, op_index, exc)
        return result if edited and copy_on_edit else None

    # ---- logits and tokens ------------------------------------------------------------------------
    @property
    def has_logit_edits(self) -> bool:
        return any(not t.plan.failed for t in self._logit_editors)

    def apply_logits_ops(self, head: Any, hidden: torch.Tensor) -> None:
        """Exact logits for the rows that logits ops select (plus the sampling rows of the requests whose
        ops edit logits, so the edit reaches the sampler), then the ops on them."""
        users = self._up_to_date([t for t in self._logits_users if not t.plan.failed])
        if not users:
            return
        edited = sorted_unique(np.asarray([t.sample_index for t in self._logit_editors
                                           if not t.plan.failed and t.sample_index is not None], dtype=np.int64))
        wanted = [self.sample_rows[edited]] if edited.size else []
        for t in users:
            for op_index in t.plan.ops_at(LOGITS):
                positions, _ = t.selection(op_index)
                wanted.append(positions - t.first_position + t.row_start)
        rows = sorted_unique(np.concatenate(wanted)) if wanted else np.empty(0, dtype=np.int64)
        if rows.size == 0:
            return
        logits = head.compute_logits(hidden[_row_index(rows, hidden.device)])
        index_of_row = np.full(self.num_tokens, -1, dtype=np.int64)
        index_of_row[rows] = np.arange(rows.size)
        self._run_ops(LOGITS, "output", logits, users, index_of_row, copy_on_edit=False)
        if edited.size:
            self.edited_samples = edited
            self.sampling_logits = logits[_row_index(index_of_row[self.sample_rows[edited]], logits.device)]

    def sample(self, head: Any, sampler: Any, hidden_rows: torch.Tensor, sampling: Any) -> Any:
        """Sample the step's rows: those whose logits an op edited from the edited exact logits, the others
        by the head, as they would be without the edits (a row's tokens never depend on its batch-mates)."""
        if self.sampling_logits is None:
            return head.sample(hidden_rows, sampling, sampler)
        num_rows = hidden_rows.shape[0]
        if len(self.edited_samples) == num_rows:
            return sampler(self.sampling_logits, sampling)
        edited = self.edited_samples.tolist()
        others = np.setdiff1d(np.arange(num_rows), self.edited_samples).tolist()
        edited_index = host_to_device(edited, torch.int64, hidden_rows.device)
        others_index = host_to_device(others, torch.int64, hidden_rows.device)
        edited_out = sampler(self.sampling_logits, sampling.subset(edited, edited_index))
        others_out = head.sample(hidden_rows[others_index], sampling.subset(others, others_index), sampler)
        return merge_sampler_outputs(num_rows, [(edited_index, edited_out), (others_index, others_out)])

    def record_tokens(self, sampled_token_ids: torch.Tensor) -> None:
        """`tokens` saves: the id sampled at the request's last row this step, stored at that row's position."""
        for t in self._up_to_date(self._token_users):
            if t.plan.failed:
                continue
            position = t.first_position + t.num_rows - 1
            for op_index in t.plan.ops_at(TOKENS):
                selected = t.plan.selected[op_index]
                k = int(np.searchsorted(selected, position))
                if k < selected.size and selected[k] == position:
                    t.plan.record_save(op_index, np.array([position]),
                                       sampled_token_ids[t.sample_index:t.sample_index + 1].clone())

    def finish_step(self, out: Any) -> None:
        """Report requests whose trace failed in this step (the oldest step of this trace not collected
        yet; failures in a step launched after it wait for that step's collect). The scheduler ends them
        with an error."""
        step = self._launched.popleft() if self._launched else self._steps
        if not self._newly_failed:
            return
        now = [t for failed_in, t in self._newly_failed if failed_in <= step]
        self._newly_failed = [(failed_in, t) for failed_in, t in self._newly_failed if failed_in > step]
        for t in now:
            if t.plan.newly_failed:
                t.plan.newly_failed = False
                rid = t.plan.request_id
                out.errors[rid] = t.plan.error
                # A failed request gets nothing else from this step (its token came from edited state).
                out.sampled_token_ids.pop(rid, None)
                out.logprobs.pop(rid, None)
                out.prompt_logprobs.pop(rid, None)


def _row_index(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """A slice for a run of consecutive rows (the common case), else an index tensor on `device`."""
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == rows.size and np.all(np.diff(rows) == 1):
        return slice(first, last + 1)
    return torch.as_tensor(rows, dtype=torch.long, device=device)


def _copy_rows(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    if isinstance(index, slice):
        return x[index].clone()
    return x.index_select(0, index)
