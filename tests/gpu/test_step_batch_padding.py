"""CPU checks of the batch building the GPU path relies on: CUDA-graph padding of decode steps, and
persistent block-table rows (only new block ids written) against a fresh rewrite every step."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pellucid.engine.request import Request
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.runner.batch import build_step_batch
from pellucid.runner.buffers import StepBuffers
from pellucid.sampling_params import SamplingParams

BLOCK = 4


def _request(rid: str, rng: random.Random) -> Request:
    req = Request(rid, [rng.randrange(500) for _ in range(rng.randrange(1, 30))], SamplingParams(max_tokens=64))
    return req


def _grow(req: Request, num_tokens: int, free: list[int]) -> None:
    while len(req.block_ids) * BLOCK < num_tokens:
        req.block_ids = req.block_ids + [free.pop()]   # a new list each time, as the KV manager does


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_padded_decode_batch_matches_unpadded_rows(seed):
    rng = random.Random(seed)
    free = list(range(1000))
    rng.shuffle(free)
    reqs = [_request(f"r{i}", rng) for i in range(rng.randrange(1, 7))]
    for r in reqs:
        _grow(r, r.num_tokens, free)
    so = SchedulerOutput(requests=reqs, num_scheduled_tokens=[1] * len(reqs),
                         num_computed_tokens=[r.num_tokens - 1 for r in reqs], samples=[True] * len(reqs))
    plain_bufs = StepBuffers(64, 16, 32, torch.device("cpu"))
    padded_bufs = StepBuffers(64, 16, 32, torch.device("cpu"))
    plain = build_step_batch(so, plain_bufs, BLOCK)
    size = 8
    padded = build_step_batch(so, padded_bufs, BLOCK, num_padded_tokens=size, num_padded_reqs=size)
    n = len(reqs)
    assert padded.attn.num_reqs == size and padded.num_padded_tokens == size and padded.num_tokens == n
    for name in ("input_ids", "positions", "token_to_req"):
        assert torch.equal(getattr(padded, name)[:n], getattr(plain, name))
    assert torch.equal(padded.attn.slot_mapping[:n], plain.attn.slot_mapping)
    assert (padded.attn.slot_mapping[n:] == -1).all()
    assert torch.equal(padded.attn.query_start_loc, torch.arange(size + 1, dtype=torch.int32))
    assert torch.equal(padded.attn.seq_lens[:n], plain.attn.seq_lens)
    assert (padded.attn.seq_lens[n:] == 0).all()
    assert torch.equal(padded.attn.block_table[:n, :plain.attn.block_table.shape[1]], plain.attn.block_table)
    assert torch.equal(padded.sample_rows, plain.sample_rows)
    assert torch.equal(padded.token_to_req[n:], torch.arange(n, size, dtype=torch.int32))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_persistent_block_table_rows_equal_fresh_rewrite(seed):
    """Random steps: requests join, leave, change rows, get preempted (blocks freed and reallocated)."""
    rng = random.Random(seed)
    free = list(range(10_000))
    rng.shuffle(free)
    persistent = StepBuffers(256, 8, 64, torch.device("cpu"))
    pool = [_request(f"r{i}", rng) for i in range(12)]
    for step in range(60):
        batch = rng.sample(pool, rng.randrange(1, 9))
        if rng.random() < 0.5:
            batch.sort(key=lambda r: r.request_id)     # often the same order as before, sometimes not
        for r in pool:
            if r not in batch and rng.random() < 0.1:   # preempted: blocks freed, new ones later
                free.extend(r.block_ids)
                r.block_ids = []
        for r in batch:
            r.append_output_token(rng.randrange(500))
            _grow(r, r.num_tokens, free)
        so = SchedulerOutput(requests=batch, num_scheduled_tokens=[1] * len(batch),
                             num_computed_tokens=[r.num_tokens - 1 for r in batch], samples=[True] * len(batch))
        fresh = StepBuffers(256, 8, 64, torch.device("cpu"))
        got = build_step_batch(so, persistent, BLOCK)
        want = build_step_batch(so, fresh, BLOCK)
        width = want.attn.block_table_cpu.shape[1]
        for i, r in enumerate(batch):
            nb = len(r.block_ids)
            assert np.array_equal(got.attn.block_table_cpu[i, :nb].numpy(), np.asarray(r.block_ids)), (step, i)
        assert torch.equal(got.attn.block_table_cpu[:, :width].gather(1, torch.zeros(len(batch), 1, dtype=torch.long)),
                           want.attn.block_table_cpu.gather(1, torch.zeros(len(batch), 1, dtype=torch.long)))
        assert torch.equal(got.attn.slot_mapping, want.attn.slot_mapping)
