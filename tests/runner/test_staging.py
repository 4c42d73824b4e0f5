"""The step's one host-to-device copy (staging.py): layout, the copy, and batches built through it.

The layout is checked byte by byte against its contract on random sizes; the copy runs with a host tensor
as the "device" region (CPU), so its views can be compared with the host arrays and its addresses per
padded size followed across steps (what CUDA graphs rely on). Staged batches must equal unstaged ones over
random step sequences, and an engine stepping ahead (sampled ids fed into the next step's input ids)
must give the same tokens with staging as without.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pellucid.config import EngineConfig
from pellucid.llm import LLM
from pellucid.engine.request import Request
from pellucid.runner.batch import build_step_batch
from pellucid.runner.buffers import StepBuffers
from pellucid.runner.staging import ALIGN, PACKED_ARRAYS, StepStaging, head_bytes, staging_layout
from pellucid.sampling_params import SamplingParams
from tests.runner.test_batch import BLOCK, MAX_BLOCKS, MAX_REQS, MAX_TOKENS, Pool, random_step

CPU = torch.device("cpu")


def _address(view: torch.Tensor) -> int:
    """Where a view starts in memory (also for an empty view, whose data_ptr() is 0)."""
    return view.untyped_storage().data_ptr() + view.storage_offset() * view.element_size()
# How many rows of each array a step of T tokens and R requests copies (written out independently).
EXPECTED_ROWS = {
    "logits_indices": lambda t, r: r, "input_ids": lambda t, r: t, "positions": lambda t, r: t,
    "token_to_req": lambda t, r: t, "slot_mapping": lambda t, r: t, "query_start_loc": lambda t, r: r + 1,
    "seq_lens": lambda t, r: r, "num_computed_tokens": lambda t, r: r, "block_table": lambda t, r: r,
}


@pytest.mark.parametrize("seed", range(4))
def test_layout_packs_aligned_disjoint_arrays_against_the_block_table(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        itemsizes = {name: rng.choice([1, 2, 4, 8]) for name, _, _ in PACKED_ARRAYS}
        max_tokens, max_reqs = rng.randint(1, 300), rng.randint(1, 40)
        row_bytes = 4 * rng.randint(1, 50)
        head = head_bytes(itemsizes, max_tokens, max_reqs)
        t, r = rng.randint(0, max_tokens), rng.randint(0, max_reqs)
        layout = staging_layout(t, r, itemsizes, head, row_bytes)
        assert head % ALIGN == 0 and layout.offsets["block_table"] == head
        assert layout.end == head + r * row_bytes and 0 <= layout.start <= head
        owner = np.full(layout.end, -1)
        sizes = dict(itemsizes, block_table=row_bytes)
        for index, (name, rows) in enumerate(EXPECTED_ROWS.items()):
            offset, want_rows = layout.offsets[name], rows(t, r)
            assert layout.rows[name] == want_rows, name
            assert offset % ALIGN == 0 and layout.start <= offset, name
            span = owner[offset:offset + want_rows * sizes[name]]
            assert len(span) == want_rows * sizes[name], f"{name} runs past the copied span"
            assert (span == -1).all(), f"{name} overlaps another array"
            span[:] = index
        # Back to back: the only unowned bytes in the copied span are alignment padding (< 16 after each array).
        owned = np.flatnonzero(owner[layout.start:] >= 0)
        gaps = np.diff(np.concatenate([[-1], owned, [layout.end - layout.start]])) - 1
        assert (gaps < ALIGN).all()


def _random_staging(rng: random.Random) -> tuple[StepStaging, dict[str, torch.Tensor]]:
    max_tokens, max_reqs, width = rng.randint(8, 64), rng.randint(2, 12), rng.randint(1, 9)
    dtypes = {"input_ids": torch.int64, "positions": torch.int64, "token_to_req": torch.int32,
              "slot_mapping": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
              "num_computed_tokens": torch.int32, "logits_indices": torch.int64}
    sources = {name: torch.zeros(max_tokens + max_reqs + 1, dtype=dtype) for name, dtype in dtypes.items()}
    return StepStaging(sources, max_tokens, max_reqs, width, CPU), sources


@pytest.mark.parametrize("seed", range(4))
def test_copied_views_equal_the_host_prefixes_at_fixed_addresses(seed: int) -> None:
    rng = random.Random(seed)
    staging, sources = _random_staging(rng)
    base = staging.device.data_ptr()
    # Few distinct sizes, many steps: sizes repeat, also after the kept copies are dropped (> 8 sizes).
    sizes = [(rng.randint(0, staging.max_num_tokens), rng.randint(0, staging.max_num_reqs)) for _ in range(12)]
    first_addresses: dict[tuple[int, int], dict[str, int]] = {}
    for _ in range(80):
        t, r = rng.choice(sizes)
        for source in sources.values():
            source.copy_(torch.randint(-2**31, 2**31, source.shape))
        staging.block_table_host.copy_(torch.randint(-2**31, 2**31, staging.block_table_host.shape))
        staging.device.fill_(0xAB)
        num_sample_rows = rng.randint(0, r)
        inputs = staging.copy(t, r, num_sample_rows)
        layout = staging.layout(t, r)
        rows = {name: EXPECTED_ROWS[name](t, r) for name in EXPECTED_ROWS}
        rows["logits_indices"] = num_sample_rows     # the copy holds r rows; the view shows the sampled ones
        for name, source in sources.items():
            assert torch.equal(getattr(inputs, name), source[:rows[name]]), name
        assert torch.equal(inputs.block_table, staging.block_table_host[:r])
        addresses = {name: _address(getattr(inputs, name)) - base for name in EXPECTED_ROWS}
        assert addresses == {name: layout.offsets[name] for name in EXPECTED_ROWS}
        assert first_addresses.setdefault((t, r), addresses) == addresses
        # One copy of exactly the used span: the bytes around it keep what the region held.
        device = staging.device.numpy()
        assert (device[:layout.start] == 0xAB).all() and (device[layout.end:] == 0xAB).all()


def test_a_step_past_the_regions_is_an_error() -> None:
    staging, _ = _random_staging(random.Random(0))
    with pytest.raises(ValueError):
        staging.copy(staging.max_num_tokens + 1, 1)
    with pytest.raises(ValueError):
        staging.copy(1, staging.max_num_reqs + 1)
    with pytest.raises(ValueError):
        staging.copy(2, 2, 3)     # more sample rows than requests


@pytest.mark.parametrize("seed", range(4))
def test_staged_batches_equal_unstaged_ones(seed: int) -> None:
    """Random step sequences (chunks, pending tokens, padded decode steps) through both paths."""
    rng = random.Random(seed)
    pool = Pool(rng)
    plain = StepBuffers(MAX_TOKENS + 8, MAX_REQS + 4, MAX_BLOCKS, CPU)
    staged = StepBuffers(MAX_TOKENS + 8, MAX_REQS + 4, MAX_BLOCKS, CPU, use_staging=True)
    addresses: dict[tuple[int, int], list[int]] = {}
    previous: list[Request] = []
    for _ in range(120):
        decode_only = rng.random() < 0.5
        so = random_step(pool, previous, decode_only)
        padded = padded_reqs = None
        if decode_only and rng.random() < 0.5:
            padded = padded_reqs = so.num_reqs + rng.randint(0, 4)
        want = build_step_batch(so, plain, BLOCK, num_padded_tokens=padded, num_padded_reqs=padded_reqs)
        got = build_step_batch(so, staged, BLOCK, num_padded_tokens=padded, num_padded_reqs=padded_reqs)
        for name in ("input_ids", "positions", "token_to_req", "sample_rows", "positions_cpu", "token_to_req_cpu",
                     "pending_rows", "pending_token_index"):
            assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name))), name
        for name in ("query_start_loc", "seq_lens", "num_computed_tokens", "slot_mapping", "query_start_loc_cpu",
                     "seq_lens_cpu", "num_computed_tokens_cpu", "block_table_cpu"):
            assert torch.equal(getattr(got.attn, name), getattr(want.attn, name)), name
        width = want.attn.block_table.shape[1]
        assert got.attn.block_table.shape == (want.attn.num_reqs, MAX_BLOCKS)   # full width on a device
        assert torch.equal(got.attn.block_table[:, :width], want.attn.block_table)
        assert torch.equal(got.attn.block_table, staged.block_table.cpu[:want.attn.num_reqs])
        # Inputs of one padded size always lie at the same device addresses (as CUDA graphs need).
        views = [got.input_ids, got.positions, got.token_to_req, got.attn.slot_mapping, got.attn.query_start_loc,
                 got.attn.seq_lens, got.attn.num_computed_tokens, got.attn.block_table]
        key = (want.num_padded_tokens, want.attn.num_reqs)
        assert addresses.setdefault(key, list(map(_address, views))) == list(map(_address, views))
        previous = so.requests


def _run_engine(model_dir: str, staged: bool) -> tuple[dict[str, list[int]], int]:
    config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu", max_model_len=128,
                                      max_num_seqs=6, async_scheduling=True)
    llm = LLM.from_config(config)
    runner = llm.engine.runner
    if staged:
        runner.buffers = StepBuffers(runner.max_num_batched_tokens, runner.max_num_reqs,
                                     math.ceil(runner.max_model_len / runner.block_size), CPU, use_staging=True)
    fed = 0
    feed = runner._feed_pending_tokens

    def counting_feed(*args):
        nonlocal fed
        fed += 1
        return feed(*args)
    runner._feed_pending_tokens = counting_feed
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        prompt = torch.randint(5, 400, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10 + 3 * i, ignore_eos=True)
        llm.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens, fed


def test_engine_stepping_ahead_gives_the_same_tokens_staged(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    want, _ = _run_engine(model_dir, staged=False)
    got, fed = _run_engine(model_dir, staged=True)
    assert fed > 0, "no step took its input ids from the device"
    assert got == want and len(got) == 5
