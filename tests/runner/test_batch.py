"""build_step_batch against a per-token reference, over random step sequences on persistent buffers.

The reference lays out every step from scratch, one token at a time, from the requests' tokens and block
ids; the builder reuses block-table rows across steps, takes decode-only shortcuts and caches the prompt
logprobs check per batch composition. Sequences mix decode-only steps, chunks, pending tokens (stepping
ahead), batches that keep, reorder, grow and shrink their rows, requests whose blocks are replaced, and
CUDA-graph padding.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pellucid.engine.request import Request
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.runner.batch import StepBatch, build_step_batch
from pellucid.runner.buffers import StepBuffers
from pellucid.sampling_params import SamplingParams

BLOCK = 4
MAX_TOKENS = 96
MAX_REQS = 12
MAX_BLOCKS = 40


class Pool:
    """Requests with tokens and block ids that evolve like the scheduler and KV manager make them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free_blocks = list(range(1, 5000))
        rng.shuffle(self.free_blocks)
        plain = SamplingParams(max_tokens=64)
        asking = SamplingParams(max_tokens=64, prompt_logprobs=2)
        self.requests = []
        for i in range(16):
            params = asking if rng.random() < 0.2 else plain
            prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 60))]
            self.requests.append(Request(f"r{i}", prompt, params))

    def cover(self, request: Request, num_tokens: int) -> None:
        while len(request.block_ids) * BLOCK < num_tokens:
            request.block_ids.append(self.free_blocks.pop())   # extended in place, as the KV manager does

    def reset_blocks(self, request: Request) -> None:
        """Preemption: the request's blocks are freed; it comes back later with new ones."""
        request.block_ids = []


def random_step(pool: Pool, previous: list[Request], decode_only: bool) -> SchedulerOutput:
    rng = pool.rng
    if previous and rng.random() < 0.5:
        requests = list(previous)                        # a steady batch: same rows
        if rng.random() < 0.3:
            requests = requests[:rng.randint(1, len(requests))]
    else:
        requests = rng.sample(pool.requests, rng.randint(1, MAX_REQS))
    for request in pool.requests:
        if request not in requests and request not in previous and rng.random() < 0.1:
            pool.reset_blocks(request)   # only while out of the batch, like a preempted request
    so = SchedulerOutput()
    budget = MAX_TOKENS
    for request in requests:
        if budget == 0:
            break
        known = request.num_tokens
        if rng.random() < 0.3:
            request.append_output_token(rng.randrange(1, 500))
            known += 1
        # End of the scheduled chunk: the known tokens, or one more (a pending token, stepping ahead).
        end = known + (1 if rng.random() < 0.4 else 0)
        num_new = 1 if decode_only else rng.randint(1, min(budget, end))
        num_new = min(num_new, budget)
        start = end - num_new
        if not decode_only and rng.random() < 0.3:
            start = rng.randint(0, start)        # an earlier chunk (prefill or recompute)
            end = start + num_new
        pool.cover(request, end)
        so.requests.append(request)
        so.num_scheduled_tokens.append(num_new)
        so.num_computed_tokens.append(start)
        so.samples.append(end >= known if rng.random() < 0.8 else rng.random() < 0.5)
        budget -= num_new
    return so


def check_against_reference(so: SchedulerOutput, batch: StepBatch, padded: int, padded_reqs: int) -> None:
    n_reqs = so.num_reqs
    input_ids, positions, token_to_req, slots, qsl = [], [], [], [], [0]
    pending_rows, prompt_rows = [], []
    for i, (request, n, start) in enumerate(zip(so.requests, so.num_scheduled_tokens, so.num_computed_tokens)):
        for position in range(start, start + n):
            input_ids.append(request.all_token_ids[position] if position < request.num_tokens else 0)
            positions.append(position)
            token_to_req.append(i)
            slots.append(request.block_ids[position // BLOCK] * BLOCK + position % BLOCK)
        if start + n > request.num_tokens:
            pending_rows.append(i)
        k = request.sampling_params.prompt_logprobs
        end = min(start + n, request.num_prompt_tokens - 1)
        if k is not None and end > start:
            prompt_rows.append((request, list(range(qsl[-1], qsl[-1] + end - start)),
                                request.prompt_token_ids[start + 1:end + 1], start + 1))
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1]
    seq_lens = [c + n for c, n in zip(so.num_computed_tokens, so.num_scheduled_tokens)]
    extra = padded - num_tokens
    input_ids += [0] * extra
    positions += [0] * extra
    slots += [-1] * extra
    if padded_reqs > n_reqs:
        token_to_req += list(range(n_reqs, padded_reqs))
        qsl += list(range(num_tokens + 1, padded + 1))
        seq_lens += [0] * (padded_reqs - n_reqs)
    else:
        token_to_req += [n_reqs - 1] * extra
    attn = batch.attn
    assert batch.num_tokens == attn.num_tokens == num_tokens and batch.num_padded_tokens == padded
    assert attn.num_reqs == padded_reqs
    assert batch.input_ids.tolist() == input_ids
    assert batch.positions.tolist() == positions and batch.positions_cpu.tolist() == positions[:num_tokens]
    assert batch.token_to_req.tolist() == token_to_req
    assert batch.token_to_req_cpu.tolist() == token_to_req[:num_tokens]
    assert attn.slot_mapping.tolist() == slots
    assert attn.query_start_loc.tolist() == attn.query_start_loc_cpu.tolist() == qsl
    assert attn.seq_lens.tolist() == attn.seq_lens_cpu.tolist() == seq_lens
    computed = so.num_computed_tokens + [0] * (padded_reqs - n_reqs)
    assert attn.num_computed_tokens.tolist() == attn.num_computed_tokens_cpu.tolist() == computed
    assert attn.max_query_len == max(so.num_scheduled_tokens)
    assert attn.max_seq_len == max(seq_lens)
    max_blocks = max(len(r.block_ids) for r in so.requests)
    assert tuple(attn.block_table.shape) == tuple(attn.block_table_cpu.shape) == (padded_reqs, max_blocks)
    for i, request in enumerate(so.requests):
        assert attn.block_table[i, :len(request.block_ids)].tolist() == request.block_ids
    sampling = [i for i, s in enumerate(so.samples) if s]
    assert batch.sample_requests == [so.requests[i] for i in sampling]
    assert batch.sample_rows.tolist() == [qsl[i + 1] - 1 for i in sampling]
    # The leading-rows flag (the runner then samples hidden[:n] without a gather) only when it is exact.
    leading = batch.sample_rows.tolist() == list(range(len(sampling))) and len(sampling) == n_reqs \
        and num_tokens == n_reqs
    assert batch.sample_rows_are_leading == leading
    assert batch.pending_rows.tolist() == pending_rows
    assert batch.pending_token_index.tolist() == [qsl[i + 1] - 1 for i in pending_rows]
    got = [(p.request, p.rows.tolist(), p.target_token_ids, p.first_position) for p in batch.prompt_logprob_rows]
    assert got == prompt_rows


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_per_token_reference(seed: int) -> None:
    rng = random.Random(seed)
    pool = Pool(rng)
    bufs = StepBuffers(MAX_TOKENS + 8, MAX_REQS + 4, MAX_BLOCKS, torch.device("cpu"))
    previous: list[Request] = []
    for _ in range(150):
        decode_only = rng.random() < 0.5
        so = random_step(pool, previous, decode_only)
        padded, padded_reqs = None, None
        if decode_only and rng.random() < 0.3:
            padded = padded_reqs = so.num_reqs + rng.randint(0, 4)
        batch = build_step_batch(so, bufs, BLOCK, num_padded_tokens=padded, num_padded_reqs=padded_reqs)
        check_against_reference(so, batch, padded or so.total_num_scheduled_tokens, padded_reqs or so.num_reqs)
        previous = so.requests


def test_prompt_logprobs_follow_a_changed_row_owner() -> None:
    """A steady batch skips the prompt logprobs check; a new request in a row brings it back."""
    plain = SamplingParams(max_tokens=8)
    asking = SamplingParams(max_tokens=8, prompt_logprobs=1)
    a, b = Request("a", [5, 6, 7, 8, 9], plain), Request("b", [1, 2, 3, 4, 5, 6], plain)
    c = Request("c", [7, 8, 9, 10, 11, 12], asking)
    bufs = StepBuffers(64, 4, 8, torch.device("cpu"))
    for r in (a, b, c):
        r.block_ids = [10 + len(r.request_id), 20 + len(r.request_id)]

    def step(requests: list[Request], starts: list[int], sizes: list[int]) -> StepBatch:
        so = SchedulerOutput(requests=requests, num_scheduled_tokens=sizes, num_computed_tokens=starts,
                             samples=[True] * len(requests))
        return build_step_batch(so, bufs, BLOCK)

    assert step([a, b], [0, 0], [3, 3]).prompt_logprob_rows == []
    assert step([a, b], [3, 3], [1, 1]).prompt_logprob_rows == []
    rows = step([a, c], [4, 0], [1, 3]).prompt_logprob_rows
    assert [(r.request, r.rows.tolist(), r.target_token_ids) for r in rows] == [(c, [1, 2, 3], [8, 9, 10])]
    rows = step([a, c], [5, 3], [1, 1]).prompt_logprob_rows
    assert [(r.request, r.rows.tolist(), r.target_token_ids) for r in rows] == [(c, [1], [11])]
    bufs.invalidate_rows()
    assert step([a, b], [6, 4], [1, 1]).prompt_logprob_rows == []


def test_host_views_are_reused_and_track_the_buffer() -> None:
    bufs = StepBuffers(16, 4, 4, torch.device("cpu"))
    first = bufs.positions.to_device(5)
    assert bufs.positions.to_device(5) is first and bufs.positions.host(5) is first
    bufs.positions.np[:5] = np.arange(5) * 3
    assert first.tolist() == [0, 3, 6, 9, 12]
    assert tuple(bufs.block_table.host(3, 2).shape) == (3, 2)


def test_kept_views_stay_bounded() -> None:
    bufs = StepBuffers(64, 8, 8, torch.device("cpu"))
    for n in range(1, 64):
        assert bufs.slot_mapping.to_device(n).shape == (n,)
        assert tuple(bufs.block_table.host(n % 8, n % 5).shape) == (n % 8, n % 5)
    assert len(bufs.slot_mapping._host_views) <= 8 and len(bufs.block_table._host_views) <= 8


def test_a_sequence_past_the_block_table_is_an_error() -> None:
    bufs = StepBuffers(64, 4, 2, torch.device("cpu"))
    request = Request("a", list(range(1, 11)), SamplingParams(max_tokens=4))
    request.block_ids = [1, 2]   # position 9 falls in a third block, past the table
    so = SchedulerOutput(requests=[request], num_scheduled_tokens=[1], num_computed_tokens=[9], samples=[True])
    with pytest.raises(IndexError):
        build_step_batch(so, bufs, BLOCK)
