"""Shared by the GPU engine tests that compare an engine keeping FP8 weights with the same checkpoint dequantized
at load: greedy runs with log-probabilities, teacher-forced scores, and freeing an engine's GPU memory."""
from __future__ import annotations

import gc
from typing import Callable

import torch


def release(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def teacher_forced_logprobs(llm, sequences: list[list[int]]) -> torch.Tensor:
    """Each sequence's tokens after the first, scored by one prefill (their prompt log-probabilities)."""
    from pellucid.sampling_params import SamplingParams
    outputs = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([pos[token].logprob for seq, o in zip(sequences, outputs)
                         for token, pos in zip(seq[1:], o.prompt_logprobs[1:])])


def assert_fp8_engine_matches_dequantized(make_engine: Callable[[bool], object], prompts: list[list[int]],
                                          dtype: str, float32_tolerance: float) -> None:
    """`make_engine(fp8)` builds the engine keeping FP8 weights (True) or dequantizing them (False). Greedy runs with
    CUDA graphs: in float32 the same tokens and log-probabilities within `float32_tolerance`; in bfloat16, where the
    kernels sum in another order, both engines score the dequantized engine's sequences within bf16's precision."""
    from pellucid.sampling_params import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    runs = {}
    for fp8 in (True, False):
        llm = make_engine(fp8)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.runner.cuda_graphs.num_replays > 0
        runs[fp8] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                     for o in outputs]
        release(llm)
    if dtype == "float32":
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs[True], runs[False]):
            assert tokens == want_tokens
            for got, want in zip(logprobs, want_logprobs):
                assert got.keys() == want.keys() and all(abs(got[t] - want[t]) <= float32_tolerance for t in got)
        return
    sequences = [prompt + tokens for prompt, (tokens, _) in zip(prompts, runs[False])]
    scores = {}
    for fp8 in (True, False):
        llm = make_engine(fp8)
        scores[fp8] = teacher_forced_logprobs(llm, sequences)
        release(llm)
    difference = (scores[True] - scores[False]).abs()
    assert difference.max() <= 0.08 and difference.mean() <= 0.01, (difference.max(), difference.mean())
