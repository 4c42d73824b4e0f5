"""A CUDA graph replayed outside an engine step (bench latency's "graph forward ms") must read its own
size's step inputs: the staging region is laid out per padded size, so after a smaller step's copy a
larger size's views hold other arrays' bytes until those inputs are copied again (restage_for_replay)."""
from __future__ import annotations

import torch

from pellucid.bench.latency import restage_for_replay
from pellucid.runner.staging import PACKED_ARRAYS, StepStaging

DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "token_to_req": torch.int32,
          "slot_mapping": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
          "num_computed_tokens": torch.int32, "logits_indices": torch.int64}


def _fill(sources: dict[str, torch.Tensor], staging: StepStaging, num_reqs: int, step: int) -> None:
    """Decode-step arrays of `num_reqs` requests (one token each), every array's rows distinct."""
    g = torch.Generator().manual_seed(step)
    for name, source in sources.items():
        source[:num_reqs + 1] = torch.randint(1000 * step, 1000 * step + 900, (num_reqs + 1,), generator=g)
    sources["query_start_loc"][:num_reqs + 1] = torch.arange(num_reqs + 1)
    staging.block_table_host[:num_reqs] = torch.randint(0, 50, (num_reqs, staging.block_table_width), generator=g)


def test_a_larger_size_replayed_after_a_smaller_step_reads_its_own_inputs_once_restaged():
    max_reqs, width = 256, 9
    sources = {name: torch.zeros(max_reqs + 1, dtype=dtype) for name, dtype in DTYPES.items()}
    staging = StepStaging(sources, max_reqs, max_reqs, width, torch.device("cpu"))
    _fill(sources, staging, 256, 1)
    full = staging.copy(256, 256)           # the batch's decode steps at full size (the graph's views)
    _fill(sources, staging, 64, 2)           # its last steps: the requests that got their first token last
    staging.copy(64, 64)

    def views_hold_host_rows() -> bool:
        return all(torch.equal(getattr(full, name), sources[name][:getattr(full, name).shape[0]])
                   for name, _, _ in PACKED_ARRAYS)

    assert not views_hold_host_rows()       # what the replay read before: the 64-step's arrays, shifted
    assert not torch.equal(full.seq_lens[:64], sources["seq_lens"][:64])
    restage_for_replay(staging, 256)
    assert views_hold_host_rows()
    assert torch.equal(full.block_table, staging.block_table_host[:256])
