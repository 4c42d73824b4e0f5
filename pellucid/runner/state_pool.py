"""Per-request recurrent state (conv / SSM layers of hybrid models), held next to the paged KV cache.

One pool tensor per recurrent layer, `[max_num_seqs + 1, *state_shape]` in the model dtype. A request
gets a slot the first time it is scheduled and keeps it until it finishes or is preempted (a preempted
request recomputes from position 0, so it starts over from a zeroed state in a fresh slot). The last slot
is scratch for dummy forwards (profiling) that belong to no request.

Each step, `prepare` fills a host buffer with the slot of every request in batch order and copies it to
the device once (no device-to-host read); the model finds pools and slots in `ForwardContext.extras`.
The layers themselves zero the state of a request whose chunk starts at position 0.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.logger import get_logger
from pellucid.models.recurrent_state import RECURRENT_SLOTS_KEY, RECURRENT_STATES_KEY
from pellucid.runner.buffers import HostDeviceBuffer

logger = get_logger(__name__)


class RecurrentStatePool:
    def __init__(self, state_shapes: list[tuple[int, ...]], max_num_reqs: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.scratch_slot = max_num_reqs
        self.states = [torch.zeros((max_num_reqs + 1, *shape), dtype=dtype, device=device) for shape in state_shapes]
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))   # pop() hands out the lowest slot first
        self._slot_of: dict[str, int] = {}
        # Where each request's state stands: the next position its conv state expects to see.
        self._next_position: dict[str, int] = {}
        self._slots = HostDeviceBuffer((max_num_reqs,), torch.int64, device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_num_reqs: int, dtype: torch.dtype,
                  device: torch.device) -> "RecurrentStatePool | None":
        """A pool for a model that declares `recurrent_state_shapes()`; None for pure-attention models."""
        shapes_fn = getattr(model, "recurrent_state_shapes", None)
        shapes = list(shapes_fn()) if shapes_fn is not None else []
        if not shapes:
            return None
        pool = cls(shapes, max_num_reqs, dtype, device)
        logger.info("recurrent state pool: %d layers x %d slots, %.1f MiB", len(shapes), max_num_reqs + 1,
                    pool.nbytes / 2**20)
        return pool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states)

    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def release(self, request_ids: Iterable[str]) -> None:
        """Return the slots of finished or preempted requests; unknown ids are ignored."""
        for rid in request_ids:
            slot = self._slot_of.pop(rid, None)
            self._next_position.pop(rid, None)
            if slot is not None:
                self._free_slots.append(slot)

    def prepare(self, so: SchedulerOutput) -> dict[str, Any]:
        """Assign slots for this step's requests; returns the forward-context extras for the model."""
        self.release(so.finished_request_ids)
        self.release(so.preempted_request_ids)
        slots = self._slots.np
        for i, (req, start, count) in enumerate(zip(so.requests, so.num_computed_tokens, so.num_scheduled_tokens)):
            rid = req.request_id
            slot = self._slot_of.get(rid)
            if slot is None:
                slot = self._allocate(rid, start)
            elif start != self._next_position[rid] and start != 0:
                raise RuntimeError(f"request {rid}: chunk starts at position {start} but its recurrent state "
                                   f"covers positions up to {self._next_position[rid]}")
            slots[i] = slot
            self._next_position[rid] = start + count
        return {RECURRENT_STATES_KEY: self.states, RECURRENT_SLOTS_KEY: self._slots.to_device(so.num_reqs)}

    def scratch_extras(self, num_reqs: int) -> dict[str, Any]:
        """Extras for a dummy forward of `num_reqs` requests that all write the scratch slot."""
        self._slots.np[:num_reqs] = self.scratch_slot
        return {RECURRENT_STATES_KEY: self.states, RECURRENT_SLOTS_KEY: self._slots.to_device(num_reqs)}

    def _allocate(self, rid: str, start: int) -> int:
        if start != 0:
            # Its earlier tokens came from somewhere (e.g. a prefix-cache hit) that left no recurrent state.
            raise RuntimeError(f"request {rid} is first scheduled at position {start}, but a hybrid model "
                               "must compute every position from 0 to build its recurrent state")
        if not self._free_slots:
            raise RuntimeError(f"no free recurrent-state slot for request {rid}: all {self.max_num_reqs} are held "
                               "(more running requests than max_num_seqs)")
        slot = self._free_slots.pop()
        self._slot_of[rid] = slot
        return slot
