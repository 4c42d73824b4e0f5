"""Moving a finished sample's hidden states from the GPU to the host without stalling the step loop.

The extraction's trace keeps its saves on the device (`TracePlan(keep_saves_on_device=True)`). For each
finished sample, `HostStager.stage` queues, on a side CUDA stream: wait for the compute stream, stack
the layer columns into `[num_tokens, num_layers, hidden]` on the GPU (the file's layout, so the host
never reorders bytes), and copy that into pinned host memory. It returns at once with an event; the
writer thread waits on the event, then writes the pinned buffer straight to the file. The copy runs
on the copy engine while the next step computes, and the step loop never synchronizes for it.

On the CPU the saves already are host tensors: `stage` returns the columns and the writer stacks them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StagedStates:
    """`hidden_states` is complete once `ready` has completed (None: already complete)."""

    hidden_states: torch.Tensor | list[torch.Tensor]     # [T, L, H] (pinned, being filled) or CPU columns
    ready: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class HostStager:
    """One side stream per device; `stage` is called from one thread at a time (the job's loop)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, columns: list[torch.Tensor]) -> StagedStates:
        if not columns:
            raise ValueError("nothing to stage: no layer columns")
        device = columns[0].device
        if device.type != "cuda":
            return StagedStates(columns)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        # Rows may be views of chunks that other requests' saves share; stacking copies them out.
        host = torch.empty((columns[0].shape[0], len(columns), *columns[0].shape[1:]), dtype=columns[0].dtype,
                           pin_memory=True)
        ready = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)
            stacked = torch.stack(columns, dim=1)
            host.copy_(stacked, non_blocking=True)
            ready.record(stream)
        # The columns belong to the compute stream's allocator pool: tell it the side stream reads them,
        # so that freeing them now (the engine's chunks go as soon as nobody refers to them) cannot hand
        # their memory to new work before the copy is done. `stacked` lives on the side stream itself.
        # Nothing here holds GPU memory while a sample waits for the disk.
        for column in columns:
            column.record_stream(stream)
        return StagedStates(host, ready)
