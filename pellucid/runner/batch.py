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
from pellucid.runner.staging import StepInputs
from pellucid.sampling_params import SamplingParams

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
    # True when sample_rows is 0, 1, ..., n - 1 (every request samples and has one row: a decode step), so
    # the rows to sample are the leading rows of the hidden states and need no gather.
    sample_rows_are_leading: bool = False
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # Requests (row indices) whose last scheduled token is pending: sampled by the step in flight, its id
    # not on the host yet (async scheduling). input_ids holds 0 at pending_token_index until the runner
    # copies the ids in on the device.
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_token_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def build_step_batch(so: SchedulerOutput, bufs: StepBuffers, block_size: int,
                     num_padded_tokens: int | None = None, num_padded_reqs: int | None = None) -> StepBatch:
    """Fill the persistent host buffers for this step and copy them to the device in one copy.

    `num_padded_reqs` (CUDA-graph replay of a decode step) adds dummy requests of one query token
    each with seq_len 0 after the real ones, so the captured shapes hold; attention writes zeros for
    them and their slot is -1. It needs num_padded_tokens == num_padded_reqs.
    """
    num_reqs = so.num_reqs
    num_tokens = sum(so.num_scheduled_tokens)
    padded = num_tokens if num_padded_tokens is None else num_padded_tokens
    padded_reqs = num_reqs if num_padded_reqs is None else num_padded_reqs
    if padded > bufs.max_num_tokens or padded_reqs > bufs.max_num_reqs:
        raise RuntimeError(f"step of {padded} tokens / {padded_reqs} requests exceeds the runner's buffers "
                           f"({bufs.max_num_tokens} / {bufs.max_num_reqs})")
    if padded_reqs > num_reqs and (padded - num_tokens) != (padded_reqs - num_reqs):
        raise ValueError("padding requests need exactly one padding token each")

    requests = so.requests
    computed = np.fromiter(so.num_computed_tokens, dtype=np.int64, count=num_reqs)
    qsl = bufs.query_start_loc.np
    token_to_req = bufs.token_to_req.np
    positions = bufs.positions.np
    seq_lens = bufs.seq_lens.np
    arange = bufs.arange
    # Every request schedules at least one token, so as many tokens as requests means one each: a decode
    # step (the common case at large batches), whose layout needs no cumsum or repeat.
    decode_only = num_tokens == num_reqs
    if decode_only:
        qsl[:num_reqs + 1] = arange[:num_reqs + 1]
        token_to_req[:num_reqs] = arange[:num_reqs]
        positions[:num_reqs] = computed
        np.add(computed, 1, out=seq_lens[:num_reqs])
        max_query_len = 1 if num_reqs else 0
    else:
        scheduled = np.array(so.num_scheduled_tokens, dtype=np.int64)
        ends = np.cumsum(scheduled)
        qsl[0] = 0
        qsl[1:num_reqs + 1] = ends
        token_to_req[:num_tokens] = np.repeat(arange[:num_reqs], scheduled)
        # Position of flat token t of request r: t - start[r] + computed[r].
        positions[:num_tokens] = arange[:num_tokens] - np.repeat(ends - scheduled - computed, scheduled)
        seq_lens[:num_reqs] = computed + scheduled
        max_query_len = int(scheduled.max()) if num_reqs else 0
    bufs.num_computed_tokens.np[:num_reqs] = computed

    input_ids = bufs.input_ids.np
    block_table = bufs.block_table.np
    # Per-request gathers go through map/attrgetter so the loops run in C: at a batch of hundreds of
    # decodes, Python-level per-request work is most of a step's host time.
    known_ends = np.fromiter(map(len, map(_all_token_ids, requests)), dtype=np.int64, count=num_reqs)
    pending_rows = np.flatnonzero(seq_lens[:num_reqs] > known_ends)
    if decode_only and len(pending_rows) == num_reqs:
        input_ids[:num_reqs] = 0    # a steady decode step scheduled ahead: every id comes from the device
    elif decode_only and not len(pending_rows):
        input_ids[:num_reqs] = list(map(operator.getitem, map(_all_token_ids, requests), so.num_computed_tokens))
    else:
        for tokens, start, n, offset in zip(map(_all_token_ids, requests), so.num_computed_tokens,
                                            so.num_scheduled_tokens, qsl[:num_reqs].tolist()):
            known = tokens[start:start + n]     # one short when the last token is pending
            input_ids[offset:offset + len(known)] = known
            if len(known) < n:
                input_ids[offset + len(known)] = 0
    # ---- persistent block-table rows (begin) ----
    # A request scheduled at the same row as in the previous step only appends blocks (the KV manager
    # extends, never rewrites, while it stays scheduled), so only rows with a new owner or new blocks
    # are written; in a steady decode batch that is the few requests whose last block just filled.
    row_owner, row_num_blocks = bufs.row_owner, bufs.row_num_blocks
    num_blocks = list(map(len, map(_block_ids, requests)))
    max_blocks = max(max(num_blocks, default=1), 1)
    # List equality compares Requests by identity (they define no __eq__), in C.
    same_owners = row_owner[:num_reqs] == requests
    if not (same_owners and row_num_blocks[:num_reqs] == num_blocks):
        block_id_lists = list(map(_block_ids, requests))
        new_owner = np.fromiter(map(operator.is_not, requests, row_owner), dtype=bool, count=num_reqs)
        counts = np.array(num_blocks, dtype=np.int64)
        written_counts = np.array(row_num_blocks[:num_reqs], dtype=np.int64)
        # Rows that kept their owner and gained one block (a decode filled its last one) take one
        # scattered write; other changed rows are written one by one.
        one_more = ~new_owner & (counts == written_counts + 1)
        one_more_rows = np.flatnonzero(one_more)
        if len(one_more_rows):
            block_table[one_more_rows, written_counts[one_more_rows]] = \
                [block_id_lists[i][-1] for i in one_more_rows.tolist()]
        for i in np.flatnonzero((new_owner | (counts != written_counts)) & ~one_more).tolist():
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
    max_seq_len = int(seq_lens[:num_reqs].max()) if num_reqs else 0
    if max_seq_len > bufs.max_blocks_per_req * block_size:
        raise IndexError(f"a sequence of {max_seq_len} tokens exceeds the block table's "
                         f"{bufs.max_blocks_per_req} blocks of {block_size}")
    token_positions = positions[:num_tokens]
    # Flat index into the block table: row * width + block index of the position.
    flat_index = np.floor_divide(token_positions, block_size)
    flat_index += (arange[:num_reqs] if decode_only else token_to_req[:num_tokens]) * bufs.max_blocks_per_req
    slot = bufs.slot_mapping.np
    np.multiply(block_table.ravel()[flat_index], block_size, out=slot[:num_tokens])
    slot[:num_tokens] += token_positions % block_size
    if padded > num_tokens:
        slot[num_tokens:padded] = -1
        input_ids[num_tokens:padded] = 0
        positions[num_tokens:padded] = 0
        if padded_reqs > num_reqs:
            token_to_req[num_tokens:padded] = arange[num_reqs:padded_reqs]
        else:
            token_to_req[num_tokens:padded] = max(num_reqs - 1, 0)
    if padded_reqs > num_reqs:
        qsl[num_reqs + 1:padded_reqs + 1] = arange[num_tokens + 1:padded + 1]
        seq_lens[num_reqs:padded_reqs] = 0
        bufs.num_computed_tokens.np[num_reqs:padded_reqs] = 0

    all_sample = all(so.samples)
    sample_requests = list(requests) if all_sample else [req for req, s in zip(requests, so.samples) if s]
    sample_rows_np = bufs.logits_indices.np
    n_sample = len(sample_requests)
    if all_sample:
        np.subtract(qsl[1:num_reqs + 1], 1, out=sample_rows_np[:num_reqs])
    else:
        sampling_idx = np.flatnonzero(np.asarray(so.samples, dtype=bool))
        sample_rows_np[:n_sample] = qsl[sampling_idx + 1] - 1

    # Rows whose owners did not change keep asking (or not) for prompt logprobs: a steady batch with none
    # skips the per-request check.
    if same_owners and num_reqs <= bufs.num_rows_without_prompt_logprobs:
        asks_prompt_logprobs = False
    else:
        asks_prompt_logprobs = any(p.prompt_logprobs is not None for p in _distinct_params(requests))
        bufs.num_rows_without_prompt_logprobs = 0 if asks_prompt_logprobs else num_reqs

    inputs = _step_inputs(bufs, padded, padded_reqs, max_blocks, n_sample)
    attn = CommonAttentionMetadata(
        num_reqs=padded_reqs, num_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        num_computed_tokens=inputs.num_computed_tokens,
        block_table=inputs.block_table,
        slot_mapping=inputs.slot_mapping,
        query_start_loc_cpu=bufs.query_start_loc.host(padded_reqs + 1),
        seq_lens_cpu=bufs.seq_lens.host(padded_reqs),
        num_computed_tokens_cpu=bufs.num_computed_tokens.host(padded_reqs),
        block_table_cpu=bufs.block_table.host(padded_reqs, max_blocks),
    )
    return StepBatch(
        num_tokens=num_tokens, num_padded_tokens=padded,
        input_ids=inputs.input_ids, positions=inputs.positions, token_to_req=inputs.token_to_req,
        token_to_req_cpu=token_to_req[:num_tokens], positions_cpu=token_positions,
        attn=attn, sample_requests=sample_requests,
        sample_rows=inputs.logits_indices, sample_rows_are_leading=all_sample and num_tokens == num_reqs,
        prompt_logprob_rows=_prompt_logprob_rows(so, qsl) if asks_prompt_logprobs else [],
        pending_rows=pending_rows, pending_token_index=qsl[pending_rows + 1].astype(np.int64) - 1,
    )


def _step_inputs(bufs: StepBuffers, num_tokens: int, num_reqs: int, max_blocks: int,
                 num_sample_rows: int) -> StepInputs:
    """The step's device tensors. With staging (a device), one copy of every array's used rows; the block
    table keeps the full width so that shapes and addresses are stable. On the CPU, the host arrays
    themselves, with only the used block-table columns."""
    if bufs.staging is not None:
        return bufs.staging.copy(num_tokens, num_reqs, num_sample_rows)
    return StepInputs(
        input_ids=bufs.input_ids.host(num_tokens), positions=bufs.positions.host(num_tokens),
        token_to_req=bufs.token_to_req.host(num_tokens), slot_mapping=bufs.slot_mapping.host(num_tokens),
        query_start_loc=bufs.query_start_loc.host(num_reqs + 1), seq_lens=bufs.seq_lens.host(num_reqs),
        num_computed_tokens=bufs.num_computed_tokens.host(num_reqs),
        block_table=bufs.block_table.host(num_reqs, max_blocks),
        logits_indices=bufs.logits_indices.host(num_sample_rows),
    )


def _distinct_params(requests: list[Request]) -> list[SamplingParams]:
    """The distinct SamplingParams objects of `requests`: requests of one generate() call share one."""
    params = list(map(_sampling_params, requests))
    return list(dict(zip(map(id, params), params)).values())


def _prompt_logprob_rows(so: SchedulerOutput, qsl: np.ndarray) -> list[PromptLogprobRows]:
    out: list[PromptLogprobRows] = []
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
