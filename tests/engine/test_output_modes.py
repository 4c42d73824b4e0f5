"""Final-only outputs (LLM.generate) and streamed outputs (AsyncLLM, server) describe the same result."""
from __future__ import annotations

import pytest

from pellucid import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(tiny_model_factory("qwen2"), dtype="float32", device="cpu")


def _run(llm: LLM, prompt: str, params: SamplingParams, stream: bool, rid: str):
    llm.add_request(rid, prompt, params, stream=stream)
    reports = []
    while llm.has_unfinished_requests():
        reports += [o for o in llm.step() if o.request_id == rid]
    return reports


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_and_final_only_outputs_agree(llm, seed):
    cases = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=seed, max_tokens=16, ignore_eos=True, n=2),
             SamplingParams(temperature=0.9, seed=seed, max_tokens=24, ignore_eos=True, stop=[" t", "e"])]
    for k, params in enumerate(cases):
        streamed = _run(llm, "The little prompt", params, True, f"s-{seed}-{k}")
        final_only = _run(llm, "The little prompt", params, False, f"f-{seed}-{k}")
        assert len(final_only) == 1 and final_only[0].finished        # reported exactly once, at the end
        assert streamed[-1].finished and not any(o.finished for o in streamed[:-1])
        if params.max_tokens > 1 and not params.stop_strings:
            assert len(streamed) == params.max_tokens                  # one report per generated token
        for a, b in zip(streamed[-1].outputs, final_only[0].outputs):
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
                   (b.text, b.token_ids, b.finish_reason, b.stop_reason)
        # every streamed snapshot's text is a prefix of the final text: nothing is ever retracted
        for snap in streamed:
            for c, final in zip(snap.outputs, streamed[-1].outputs):
                assert final.text.startswith(c.text)
