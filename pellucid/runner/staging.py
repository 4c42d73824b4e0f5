"""One host-to-device copy per step: the step's inputs packed back to back in one staging region.

Consecutive DMA copies on one stream each pay a setup gap, so the nine step arrays (token ids,
positions, request map, slot mapping, query starts, sequence lengths, computed tokens, block table, sample
rows) go over as one copy. A pinned host region and a device region of the same layout hold them:

    0         start                                                      head_bytes (fixed)       end
    | unused  | sample rows | ids | positions | request map | slots | ... | block table rows | unused |

    (the "..." being query starts, sequence lengths and computed tokens; block-table rows at full width)

The block table lives in the host region for good (its rows persist across steps, see batch.py), at
`head_bytes`; each step packs the used prefixes of the other arrays, each 16-byte aligned, so that they
end right where the block table starts. The copied span is then contiguous: from the first packed array
to the last used block-table row. Every offset is a pure function of the padded token and request counts
(the block-table width is fixed), so a CUDA graph captured at one size and every later replay of that
size read the same device addresses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import torch

ALIGN = 16

# The arrays packed in front of the block table, farthest from it first: (name, counted per token
# (else per request), extra rows). Sample rows are at most one per request, so they get the request count
# and a step's actual count only narrows the view.
PACKED_ARRAYS: tuple[tuple[str, bool, int], ...] = (
    ("logits_indices", False, 0),
    ("input_ids", True, 0),
    ("positions", True, 0),
    ("token_to_req", True, 0),
    ("slot_mapping", True, 0),
    ("query_start_loc", False, 1),
    ("seq_lens", False, 0),
    ("num_computed_tokens", False, 0),
)
BLOCK_TABLE_DTYPE = torch.int32


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _rows(per_token: bool, extra: int, num_tokens: int, num_reqs: int) -> int:
    return (num_tokens if per_token else num_reqs) + extra


def head_bytes(itemsizes: Mapping[str, int], max_num_tokens: int, max_num_reqs: int) -> int:
    """Room in front of the block table for the packed arrays of the largest step."""
    return sum(_aligned(_rows(per_token, extra, max_num_tokens, max_num_reqs) * itemsizes[name])
               for name, per_token, extra in PACKED_ARRAYS)


@dataclass(frozen=True)
class StagingLayout:
    """Where one step's arrays lie in the staging regions (byte offsets) and the span it copies."""

    offsets: dict[str, int]   # every packed array and "block_table"
    rows: dict[str, int]
    start: int                # first byte copied
    end: int                  # one past the last byte copied


def staging_layout(num_tokens: int, num_reqs: int, itemsizes: Mapping[str, int], head: int,
                   block_table_row_bytes: int) -> StagingLayout:
    """The layout of a step of `num_tokens` padded tokens and `num_reqs` padded requests."""
    offsets = {"block_table": head}
    rows = {"block_table": num_reqs}
    cursor = head
    for name, per_token, extra in reversed(PACKED_ARRAYS):
        rows[name] = _rows(per_token, extra, num_tokens, num_reqs)
        cursor -= _aligned(rows[name] * itemsizes[name])
        offsets[name] = cursor
    if cursor < 0:
        raise ValueError(f"a step of {num_tokens} tokens / {num_reqs} requests does not fit the staging head "
                         f"of {head} bytes")
    return StagingLayout(offsets, rows, cursor, head + num_reqs * block_table_row_bytes)


@dataclass
class StepInputs:
    """One step's device tensors: views into the device staging region (fixed per padded size)."""

    input_ids: torch.Tensor            # [num_tokens] int64
    positions: torch.Tensor            # [num_tokens] int64
    token_to_req: torch.Tensor         # [num_tokens] int32
    slot_mapping: torch.Tensor         # [num_tokens] int64
    query_start_loc: torch.Tensor      # [num_reqs + 1] int32
    seq_lens: torch.Tensor             # [num_reqs] int32
    num_computed_tokens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor          # [num_reqs, full width] int32
    logits_indices: torch.Tensor       # [num sample rows] int64 (the copy holds one row per request)


@dataclass
class _StepCopy:
    """Everything a step of one padded size needs, built once: the host packing and the copy's two ends."""

    packing: list[tuple[np.ndarray, np.ndarray]]   # (staging destination, source prefix)
    host_span: torch.Tensor
    device_span: torch.Tensor
    # By number of sample rows: a fresh slice per step costs more than the lookup.
    inputs: dict[int, StepInputs]


# Prefill steps come in many sizes; decode steps in a few. Start over when this many are kept.
_MAX_KEPT_SIZES = 8


class StepStaging:
    """The pinned host and device staging regions of a runner's step inputs, and the step's one copy.

    `sources` are the host tensors of PACKED_ARRAYS by name (persistent: a step fills their prefixes
    before `copy`). The block table's host array is this region's `block_table_host`. `device` may be the CPU
    (tests): the regions are then two host tensors and the copy a memcpy.
    """

    def __init__(self, sources: Mapping[str, torch.Tensor], max_num_tokens: int, max_num_reqs: int,
                 block_table_width: int, device: torch.device) -> None:
        missing = {name for name, _, _ in PACKED_ARRAYS} - set(sources)
        if missing:
            raise ValueError(f"staging sources lack {sorted(missing)}")
        for name, per_token, extra in PACKED_ARRAYS:
            if len(sources[name]) < _rows(per_token, extra, max_num_tokens, max_num_reqs):
                raise ValueError(f"staging source {name} has {len(sources[name])} rows, fewer than a step can use")
        self.dtypes = {name: sources[name].dtype for name, _, _ in PACKED_ARRAYS}
        self.sources = {name: sources[name].numpy() for name, _, _ in PACKED_ARRAYS}
        self.itemsizes = {name: dtype.itemsize for name, dtype in self.dtypes.items()}
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.block_table_width = block_table_width
        self.block_table_row_bytes = block_table_width * BLOCK_TABLE_DTYPE.itemsize
        self.head_bytes = head_bytes(self.itemsizes, max_num_tokens, max_num_reqs)
        total = self.head_bytes + max_num_reqs * self.block_table_row_bytes
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._host_np = self.host.numpy()
        self.device = torch.zeros(total, dtype=torch.uint8, device=device)
        self.block_table_host = self._typed(self.host, self.head_bytes, max_num_reqs * block_table_width,
                                            BLOCK_TABLE_DTYPE).view(max_num_reqs, block_table_width)
        self._copies: dict[tuple[int, int], _StepCopy] = {}

    def layout(self, num_tokens: int, num_reqs: int) -> StagingLayout:
        if num_tokens > self.max_num_tokens or num_reqs > self.max_num_reqs:
            raise ValueError(f"a step of {num_tokens} tokens / {num_reqs} requests exceeds the staging regions "
                             f"({self.max_num_tokens} / {self.max_num_reqs})")
        return staging_layout(num_tokens, num_reqs, self.itemsizes, self.head_bytes, self.block_table_row_bytes)

    def copy(self, num_tokens: int, num_reqs: int, num_sample_rows: int | None = None) -> StepInputs:
        """Pack the sources' prefixes for a step of `num_tokens` / `num_reqs` (padded) and copy the used span
        to the device in one non-blocking copy; returns the step's device views, with `num_sample_rows`
        (default: all `num_reqs`) sample rows.

        The host region is rewritten here: the caller makes sure the previous step's copy is done."""
        step = self._copies.get((num_tokens, num_reqs))
        if step is None:
            step = self._build(num_tokens, num_reqs)
        num_sample_rows = num_reqs if num_sample_rows is None else num_sample_rows
        inputs = step.inputs.get(num_sample_rows)
        if inputs is None:
            if not 0 <= num_sample_rows <= num_reqs:
                raise ValueError(f"{num_sample_rows} sample rows in a step of {num_reqs} requests (one at most each)")
            every_row = step.inputs[num_reqs]
            inputs = step.inputs[num_sample_rows] = replace(
                every_row, logits_indices=every_row.logits_indices[:num_sample_rows])
        for destination, source in step.packing:
            destination[...] = source
        step.device_span.copy_(step.host_span, non_blocking=True)
        return inputs

    def _build(self, num_tokens: int, num_reqs: int) -> _StepCopy:
        layout = self.layout(num_tokens, num_reqs)
        packing = []
        for name, _, _ in PACKED_ARRAYS:
            rows, offset, source = layout.rows[name], layout.offsets[name], self.sources[name]
            packing.append((self._host_np[offset:offset + rows * source.itemsize].view(source.dtype), source[:rows]))
        views = {name: self._typed(self.device, layout.offsets[name], layout.rows[name], self.dtypes[name])
                 for name, _, _ in PACKED_ARRAYS}
        block_table = self._typed(self.device, self.head_bytes, num_reqs * self.block_table_width,
                                  BLOCK_TABLE_DTYPE).view(num_reqs, self.block_table_width)
        step = _StepCopy(packing, self.host[layout.start:layout.end], self.device[layout.start:layout.end],
                         {num_reqs: StepInputs(block_table=block_table, **views)})
        if len(self._copies) >= _MAX_KEPT_SIZES:
            self._copies.clear()
        self._copies[(num_tokens, num_reqs)] = step
        return step

    @staticmethod
    def _typed(region: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """`count` elements of `dtype` at byte `offset` of a uint8 region (a view: same memory)."""
        return region[offset:offset + count * dtype.itemsize].view(dtype)
