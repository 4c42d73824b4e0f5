"""Turn a SchedulerOutput into device inputs: token ids, positions, the request map and attention metadata."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from pellucid.attention.metadata import CommonAttentionMetadata
from pellucid.engine.request import Request
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.runner.buffers import StepBuffers

_all_token_ids = operator.attrgetter("all_token_ids")
_block_ids = operator.attrgetter("block_ids")
_sampling_params = operator.attrgetter("sampling_params")


@dataclass
class PromptLogprobRows:
    """Rows of this step whose logits score the next prompt token (for prompt_logprobs)."""

    request: Request
    rows: np.ndarray            # token rows in the flat batch
    target_token_ids: list[int]  # the prompt token each row predicts
    first_position: int          # prompt position of target_token_ids[0]


@dataclass
class StepBatch:
    num_tokens: int
    num_padded_tokens: int
    input_ids: torch.Tensor            # [num_padded_tokens] device
    positions: torch.Tensor            # [num_padded_tokens] device
    token_to_req: torch.Tensor         # [num_padded_tokens] device
    token_to_req_cpu: np.ndarray       # [num_tokens] host copy
    positions_cpu: np.ndarray          # [num_tokens] host copy
    attn: CommonAttentionMetadata
    sample_requests: list[Request]     # requests that sample this step, in row order
    sample_rows: torch.Tensor          # [len(sample_requests)] device row index of each one's last token
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # Requests (row indices) whose last scheduled token is pending: sampled by the step in flight, its id
    # not on the host yet (async scheduling). input_ids holds 0 at pending_token_index until the runner
    # copies the ids in on the device.
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_token_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def build_step_batch(so: SchedulerOutput, bufs: StepBuffers, block_size: int,
                     num_padded_tokens: int | None = None, num_padded_reqs: int | None = None) -> StepBatch:
    """Fill the persistent host buffers for this step and copy them to the device once.

    `num_padded_reqs` (CUDA-graph replay of a decode step) adds dummy requests of one query token
    each with seq_len 0 after the real ones, so the captured shapes hold; attention writes zeros for
    them and their slot is -1. It needs num_padded_tokens == num_padded_reqs.
    """
    num_reqs = so.num_reqs
    num_tokens = so.total_num_scheduled_tokens
    padded = num_tokens if num_padded_tokens is None else num_padded_tokens
    padded_reqs = num_reqs if num_padded_reqs is None else num_padded_reqs
    if padded > bufs.max_num_tokens or padded_reqs > bufs.max_num_reqs:
        raise RuntimeError(f"step of {padded} tokens / {padded_reqs} requests exceeds the runner's buffers "
                           f"({bufs.max_num_tokens} / {bufs.max_num_reqs})")
    if padded_reqs > num_reqs and (padded - num_tokens) != (padded_reqs - num_reqs):
        raise ValueError("padding requests need exactly one padding token each")

    scheduled = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
    computed = np.asarray(so.num_computed_tokens, dtype=np.int64)
    qsl = bufs.query_start_loc.np
    qsl[0] = 0
    np.cumsum(scheduled, out=qsl[1:num_reqs + 1])
    bufs.seq_lens.np[:num_reqs] = computed + scheduled
    bufs.num_computed_tokens.np[:num_reqs] = computed

    token_to_req = bufs.token_to_req.np
    token_to_req[:num_tokens] = np.repeat(np.arange(num_reqs, dtype=np.int32), scheduled)
    starts = qsl[:num_reqs].astype(np.int64)
    positions = bufs.positions.np
    positions[:num_tokens] = np.arange(num_tokens) - np.repeat(starts, scheduled) + np.repeat(computed, scheduled)

    input_ids = bufs.input_ids.np
    block_table = bufs.block_table.np
    requests = so.requests
    # Per-request gathers go through map/attrgetter so the loops run in C: at a batch of hundreds of
    # decodes, Python-level per-request work is most of a step's host time.
    token_lists = list(map(_all_token_ids, requests))
    known_ends = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_reqs)
    pending_rows = np.flatnonzero(computed + scheduled > known_ends)
    if num_tokens == num_reqs and not len(pending_rows):
        # Decode-only step: one token per request.
        input_ids[:num_reqs] = list(map(operator.getitem, token_lists, so.num_computed_tokens))
    elif num_tokens == num_reqs and len(pending_rows) == num_reqs:
        input_ids[:num_reqs] = 0    # a steady decode step scheduled ahead: every id comes from the device
    else:
        for tokens, start, n, offset in zip(token_lists, so.num_computed_tokens, so.num_scheduled_tokens,
                                            qsl[:num_reqs].tolist()):
            known = tokens[start:start + n]     # one short when the last token is pending
            input_ids[offset:offset + len(known)] = known
            if len(known) < n:
                input_ids[offset + len(known)] = 0
    # ---- persistent block-table rows (begin) ----
    # A request scheduled at the same row as in the previous step only appends blocks (the KV manager
    # extends, never rewrites, while it stays scheduled), so only rows with a new owner or new blocks
    # are written; in a steady decode batch that is the few requests whose last block just filled.
    row_owner, row_num_blocks = bufs.row_owner, bufs.row_num_blocks
    block_id_lists = list(map(_block_ids, requests))
    num_blocks = list(map(len, block_id_lists))
    max_blocks = max(max(num_blocks, default=1), 1)
    new_owner = np.fromiter(map(operator.is_not, requests, row_owner), dtype=bool, count=num_reqs)
    grown = np.fromiter(map(operator.ne, num_blocks, row_num_blocks), dtype=bool, count=num_reqs)
    for i in np.flatnonzero(new_owner | grown).tolist():
        written = 0 if new_owner[i] else row_num_blocks[i]
        if num_blocks[i] > written:
            block_table[i, written:num_blocks[i]] = block_id_lists[i][written:] if written else block_id_lists[i]
    row_owner[:num_reqs] = requests
    row_num_blocks[:num_reqs] = num_blocks
    for i in range(num_reqs, len(row_owner)):
        if row_owner[i] is None:
            break
        row_owner[i] = None
    # ---- persistent block-table rows (end) ----
    block_idx = positions[:num_tokens] // block_size
    slot = bufs.slot_mapping.np
    slot[:num_tokens] = block_table[token_to_req[:num_tokens], block_idx].astype(np.int64) * block_size \
        + positions[:num_tokens] % block_size
    if padded > num_tokens:
        slot[num_tokens:padded] = -1
        input_ids[num_tokens:padded] = 0
        positions[num_tokens:padded] = 0
        if padded_reqs > num_reqs:
            token_to_req[num_tokens:padded] = np.arange(num_reqs, padded_reqs, dtype=np.int32)
        else:
            token_to_req[num_tokens:padded] = max(num_reqs - 1, 0)
    if padded_reqs > num_reqs:
        qsl[num_reqs + 1:padded_reqs + 1] = np.arange(num_tokens + 1, padded + 1, dtype=np.int32)
        bufs.seq_lens.np[num_reqs:padded_reqs] = 0
        bufs.num_computed_tokens.np[num_reqs:padded_reqs] = 0

    sample_requests = list(so.requests) if all(so.samples) else [req for req, s in zip(so.requests, so.samples) if s]
    sample_rows_np = bufs.logits_indices.np
    if len(sample_requests) == num_reqs:
        n_sample = num_reqs
        np.subtract(qsl[1:num_reqs + 1], 1, out=sample_rows_np[:num_reqs])
    else:
        sampling_idx = np.flatnonzero(np.asarray(so.samples, dtype=bool))
        n_sample = len(sampling_idx)
        sample_rows_np[:n_sample] = qsl[sampling_idx + 1] - 1

    attn = CommonAttentionMetadata(
        num_reqs=padded_reqs, num_tokens=num_tokens,
        max_query_len=int(scheduled.max()) if num_reqs else 0,
        max_seq_len=int(bufs.seq_lens.np[:num_reqs].max()) if num_reqs else 0,
        block_size=block_size,
        query_start_loc=bufs.query_start_loc.to_device(padded_reqs + 1),
        seq_lens=bufs.seq_lens.to_device(padded_reqs),
        num_computed_tokens=bufs.num_computed_tokens.to_device(padded_reqs),
        block_table=_block_table_to_device(bufs, padded_reqs, max_blocks),
        slot_mapping=bufs.slot_mapping.to_device(padded),
        query_start_loc_cpu=bufs.query_start_loc.cpu[:padded_reqs + 1],
        seq_lens_cpu=bufs.seq_lens.cpu[:padded_reqs],
        num_computed_tokens_cpu=bufs.num_computed_tokens.cpu[:padded_reqs],
        block_table_cpu=bufs.block_table.cpu[:padded_reqs, :max_blocks],
    )
    return StepBatch(
        num_tokens=num_tokens, num_padded_tokens=padded,
        input_ids=bufs.input_ids.to_device(padded), positions=bufs.positions.to_device(padded),
        token_to_req=bufs.token_to_req.to_device(padded),
        token_to_req_cpu=token_to_req[:num_tokens], positions_cpu=positions[:num_tokens],
        attn=attn, sample_requests=sample_requests,
        sample_rows=bufs.logits_indices.to_device(n_sample),
        prompt_logprob_rows=_prompt_logprob_rows(so, qsl),
        pending_rows=pending_rows, pending_token_index=qsl[pending_rows + 1].astype(np.int64) - 1,
    )


def _block_table_to_device(bufs: StepBuffers, num_reqs: int, max_blocks: int) -> torch.Tensor:
    """Copy only the used rows; the column count stays the full width so device shapes are stable."""
    table = bufs.block_table
    if table.device is table.cpu:
        return table.cpu[:num_reqs, :max_blocks]
    table.device[:num_reqs].copy_(table.cpu[:num_reqs], non_blocking=True)
    return table.device[:num_reqs]


def _prompt_logprob_rows(so: SchedulerOutput, qsl: np.ndarray) -> list[PromptLogprobRows]:
    out: list[PromptLogprobRows] = []
    # Requests of one generate() call share a SamplingParams object: check each distinct one once.
    params = list(map(_sampling_params, so.requests))
    params_by_id = dict(zip(map(id, params), params))
    if all(p.prompt_logprobs is None for p in params_by_id.values()):
        return out
    for i, req in enumerate(so.requests):
        if req.sampling_params.prompt_logprobs is None:
            continue
        start = so.num_computed_tokens[i]
        end = min(start + so.num_scheduled_tokens[i], req.num_prompt_tokens - 1)
        if end <= start:
            continue
        rows = np.arange(int(qsl[i]), int(qsl[i]) + (end - start))
        out.append(PromptLogprobRows(req, rows, req.prompt_token_ids[start + 1:end + 1], start + 1))
    return out
