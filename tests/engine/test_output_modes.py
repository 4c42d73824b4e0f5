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


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_that_stops_a_sequence_is_not_shown(llm, stream):
    """EOS or a stop token id ends the text without showing, even with special tokens shown, unless
    include_stop_str_in_output asks for it (vLLM's rule); the token stays in token_ids."""
    eos = sorted(llm.engine.eos_token_ids)[0]
    word = llm.tokenizer("hello")["input_ids"][0]
    for k, (end, extra) in enumerate(((eos, {}), (7, {"stop_token_ids": [7]}))):
        # The first token is `word` (the end is banned until min_tokens), then the end token.
        base = dict(max_tokens=6, min_tokens=1, allowed_token_ids=[word, end], logit_bias={end: 50.0}, **extra)
        for skip, include in ((True, False), (False, False), (False, True)):
            params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include, **base)
            out = _run(llm, "The little prompt", params, stream, f"end-{stream}-{k}-{skip}-{include}")[-1].outputs[0]
            assert out.token_ids == [word, end] and out.finish_reason == "stop"
            shown = llm.tokenizer.decode([word, end], skip_special_tokens=skip)
            assert out.text == (shown if include else llm.tokenizer.decode([word]))
