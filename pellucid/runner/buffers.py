"""Persistent host buffers of a step's inputs, and host buffers mirrored by device buffers.

The batch is built in the host arrays with numpy. On CUDA the step's used prefixes go to the device in
one non-blocking copy through the staging regions (staging.py); on the CPU the step reads the host arrays
themselves. Nothing in the step reads device memory back except the sampled token ids.
"""
from __future__ import annotations

import numpy as np
import torch

from pellucid.runner.staging import BLOCK_TABLE_DTYPE, PACKED_ARRAYS, StepStaging


class HostBuffer:
    """A persistent host tensor, its numpy view, and kept views of its leading rows."""

    def __init__(self, cpu: torch.Tensor) -> None:
        self.cpu = cpu
        self.np: np.ndarray = cpu.numpy()
        # Views of the leading rows, kept for the sizes used lately: slicing a tensor costs about a
        # microsecond and a step takes a dozen views, mostly of the same sizes as the step before. Views
        # share the buffers' memory, so a kept one stays valid.
        self._host_views: dict[tuple[int, int | None], torch.Tensor] = {}

    def host(self, n: int, num_cols: int | None = None) -> torch.Tensor:
        """The host view of the first n rows (and, for a 2-D buffer, the first num_cols columns)."""
        key = (n, num_cols)
        view = self._host_views.get(key)
        if view is None:
            _make_room(self._host_views)
            view = self._host_views[key] = self.cpu[:n] if num_cols is None else self.cpu[:n, :num_cols]
        return view


class HostDeviceBuffer(HostBuffer):
    """A host buffer (pinned when the device is CUDA) mirrored by a device buffer, copied per use."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda"))
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        self._device_views: dict[int, torch.Tensor] = {}

    def to_device(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device (asynchronously on CUDA) and return the device view."""
        host = self.host(n)
        if self.device is self.cpu:
            return host
        device = self._device_views.get(n)
        if device is None:
            _make_room(self._device_views)
            device = self._device_views[n] = self.device[:n]
        device.copy_(host, non_blocking=True)
        return device


_MAX_KEPT_VIEWS = 8


def _make_room(views: dict) -> None:
    """Bound the kept views: sizes vary freely across prefill steps, so start over when the cache is full."""
    if len(views) >= _MAX_KEPT_VIEWS:
        views.clear()


class StepBuffers:
    """Everything one step feeds the model and the attention backends, as host arrays.

    On a CUDA device `staging` copies them over (one copy per step) and the block table's host array lies
    in its pinned region; the other arrays are plain host memory, packed into that region per step. On
    the CPU `staging` is None and the arrays are HostDeviceBuffers whose device is the host (no copy).
    `use_staging` forces staging on or off (tests run it on the CPU, with a host "device" region).
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device, use_staging: bool | None = None) -> None:
        if use_staging is None:
            use_staging = device.type != "cpu"
        if not use_staging and device.type != "cpu":
            raise ValueError("a step on a device other than the CPU copies its inputs through the staging regions")

        def buf(shape: tuple[int, ...], dtype: torch.dtype) -> HostBuffer:
            if use_staging:
                return HostBuffer(torch.zeros(shape, dtype=dtype))
            return HostDeviceBuffer(shape, dtype, device)

        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.input_ids = buf((max_num_tokens,), torch.int64)
        self.positions = buf((max_num_tokens,), torch.int64)
        self.token_to_req = buf((max_num_tokens,), torch.int32)
        self.slot_mapping = buf((max_num_tokens,), torch.int64)
        self.query_start_loc = buf((max_num_reqs + 1,), torch.int32)
        self.seq_lens = buf((max_num_reqs,), torch.int32)
        self.num_computed_tokens = buf((max_num_reqs,), torch.int32)
        # Sample rows: at most one per request; staging copies as many rows as the step has requests.
        self.logits_indices = buf((max(max_num_tokens, max_num_reqs),), torch.int64)
        self.staging: StepStaging | None = None
        if use_staging:
            sources = {name: getattr(self, name).cpu for name, _, _ in PACKED_ARRAYS}
            self.staging = StepStaging(sources, max_num_tokens, max_num_reqs, max_blocks_per_req, device)
            self.block_table = HostBuffer(self.staging.block_table_host)
        else:
            self.block_table = buf((max_num_reqs, max_blocks_per_req), BLOCK_TABLE_DTYPE)
        # 0, 1, 2, ...: sliced for query offsets, row indices and padding instead of a new arange per step.
        self.arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        # Which request's block ids each block-table row holds, and how many (see batch.py): rows of a
        # request that stays at its row only get its new blocks written.
        self.row_owner: list[object | None] = [None] * max_num_reqs
        self.row_num_blocks: list[int] = [0] * max_num_reqs
        # The leading rows known to hold no request asking for prompt logprobs, while their owners stay.
        self.num_rows_without_prompt_logprobs = 0

    def invalidate_rows(self) -> None:
        """Forget row ownership after the host block table was written by anything but build_step_batch."""
        self.row_owner = [None] * self.max_num_reqs
        self.row_num_blocks = [0] * self.max_num_reqs
        self.num_rows_without_prompt_logprobs = 0
