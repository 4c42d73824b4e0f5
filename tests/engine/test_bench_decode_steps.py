"""`pellucid bench latency` times only decode steps that run the whole batch: with a chunked prefill the first requests
start (and finish) earlier, and the steps after the first finish decode a smaller batch."""
from __future__ import annotations

import pytest

from pellucid.bench.latency import _run_batch
from pellucid.llm import LLM


def test_only_steps_of_the_whole_batch_are_timed(tiny_model_factory):
    # A 32-token budget prefills the four 40-token prompts over five steps, so the requests start apart.
    llm = LLM(tiny_model_factory("qwen3"), device="cpu", max_model_len=128, num_kv_blocks=64,
              max_num_batched_tokens=32)
    decoding: list[int] = []        # per step after every request has its first token: how many it runs
    step = llm.step

    def counting_step():
        running = llm.engine.scheduler.running
        if running and all(r.num_output_tokens > 0 for r in running) and not llm.engine.scheduler.num_waiting:
            decoding.append(len(running))
        return step()

    llm.step = counting_step
    _, steps = _run_batch(llm, 4, 40, 12, seed=0)
    assert len(steps) == decoding.count(4) - 1 > 0      # the whole batch's steps, but the last
    assert min(decoding) < 4                            # the steps after the first request finished are left out
    with pytest.raises(ValueError, match="no decode step ran all 4 requests"):
        _run_batch(llm, 4, 40, 2, seed=1)


def test_a_prefill_timing_has_no_decode_steps(tiny_model_factory):
    """`--prefill-len` times one request with one output token: its prefill alone, no decode step to refuse."""
    llm = LLM(tiny_model_factory("qwen3"), device="cpu", max_model_len=128, num_kv_blocks=64,
              max_num_batched_tokens=32)
    prefill, steps = _run_batch(llm, 1, 90, 1, seed=2)
    assert prefill > 0 and steps == [] and not llm.has_unfinished_requests()
