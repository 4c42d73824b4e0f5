"""The step's one host-to-device copy on a real device: the staging views hold the host prefixes after the
copy, and a steady CUDA-graph decode step of the engine issues exactly one host-to-device copy."""
from __future__ import annotations

import random

import pytest
import torch

from pellucid.runner.staging import StepStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "token_to_req": torch.int32,
          "slot_mapping": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
          "num_computed_tokens": torch.int32, "logits_indices": torch.int64}


def test_device_views_hold_the_host_prefixes_at_fixed_addresses() -> None:
    rng = random.Random(0)
    max_tokens, max_reqs, width = 200, 24, 33
    sources = {name: torch.zeros(max_tokens + 1, dtype=dtype) for name, dtype in DTYPES.items()}
    staging = StepStaging(sources, max_tokens, max_reqs, width, torch.device("cuda"))
    assert staging.host.is_pinned()
    first: dict[tuple[int, int], list[int]] = {}
    for _ in range(40):
        t, r = rng.choice([(1, 1), (8, 8), (200, 24), (37, 5), (24, 24)])
        for source in sources.values():
            source.copy_(torch.randint(-2**31, 2**31, source.shape))
        staging.block_table_host.copy_(torch.randint(-2**31, 2**31, staging.block_table_host.shape))
        inputs = staging.copy(t, r)
        torch.cuda.synchronize()
        rows = {"query_start_loc": r + 1, "seq_lens": r, "num_computed_tokens": r, "logits_indices": r}
        for name, source in sources.items():
            assert torch.equal(getattr(inputs, name).cpu(), source[:rows.get(name, t)]), name
        assert torch.equal(inputs.block_table.cpu(), staging.block_table_host[:r])
        addresses = [getattr(inputs, name).data_ptr() for name in (*DTYPES, "block_table")]
        assert first.setdefault((t, r), addresses) == addresses
        assert all(a % 16 == 0 for a in addresses)


def test_a_steady_graph_decode_step_copies_its_inputs_once(tiny_model_factory) -> None:
    from torch.profiler import ProfilerActivity, profile

    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    model_dir = tiny_model_factory("qwen3", num_hidden_layers=2)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              num_kv_blocks=1024, cuda_graph_sizes=[1, 2, 4])
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for i in range(3):
        llm.add_request(f"r{i}", [5 + i, 17, 33, 8, 9], params)
    for _ in range(10):     # prefill, then decode steps until the batch is steady
        llm.step()
    torch.cuda.synchronize()
    replays = core.runner.cuda_graphs.num_replays
    steps = 12
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    launched = core.runner.cuda_graphs.num_replays - replays     # each steady step replays one graph
    assert launched >= steps - 1
    copies = [e.name for e in prof.events() if "HtoD" in e.name]
    assert len(copies) == launched, copies
