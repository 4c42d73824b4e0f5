"""Persistent host buffers (pinned when the device is CUDA) mirrored by device buffers.

The batch is built in the host arrays with numpy and copied to the device once per step with
`non_blocking=True`; nothing in the step reads device memory back except the sampled token ids.
"""
from __future__ import annotations

import numpy as np
import torch


class HostDeviceBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device (asynchronously on CUDA) and return the device view."""
        if self.device is self.cpu:
            return self.cpu[:n]
        self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class StepBuffers:
    """Everything one step feeds the model and the attention backends."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        def buf(shape: tuple[int, ...], dtype: torch.dtype) -> HostDeviceBuffer:
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
        self.block_table = buf((max_num_reqs, max_blocks_per_req), torch.int32)
        self.logits_indices = buf((max_num_tokens,), torch.int64)
        # Which request's block ids each block-table row holds, and how many (see batch.py): rows of a
        # request that stays at its row only get its new blocks written.
        self.row_owner: list[object | None] = [None] * max_num_reqs
        self.row_num_blocks: list[int] = [0] * max_num_reqs

    def invalidate_rows(self) -> None:
        """Forget row ownership after the host block table was written by anything but build_step_batch."""
        self.row_owner = [None] * self.max_num_reqs
        self.row_num_blocks = [0] * self.max_num_reqs
