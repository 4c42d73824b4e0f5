"""Decode CUDA graphs per longest-sequence length (AttentionBackend.decode_graph_lengths): steps whose contexts
grow across every captured length replay the graph for their length and give the tokens eager steps give."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(model_dir: str, prompts: list[list[int]], max_tokens: int, **kwargs) -> tuple[list[list[int]], object]:
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    llm = LLM(model_dir, max_model_len=1024, max_num_seqs=4, num_kv_blocks=512, device="cuda", dtype="float32",
              **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize("batch", [1, 3])
def test_steps_replay_the_graph_of_their_length_and_equal_eager(tiny_model_factory, batch):
    """float32 greedy decoding from ~100 to ~560 tokens of context (past 128, 256 and 512)."""
    model_dir = tiny_model_factory("qwen3", seed=3, num_hidden_layers=2, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(5, 500, (90 + 7 * i,), generator=g).tolist() for i in range(batch)]
    graphs_tokens, llm = _run(model_dir, prompts, 460)
    eager_tokens, _ = _run(model_dir, prompts, 460, enforce_eager=True)
    assert graphs_tokens == eager_tokens
    graphs = llm.engine.runner.cuda_graphs
    size = min(s for s in graphs.sizes if s >= batch)
    # 128, 256, 512 and 1024 tokens on a GPU of 16 SMs or more (2 KV heads, 1 or 4 requests); every one replayed
    assert graphs._lengths[size] == [128, 256, 512, 1024]
    assert sorted(n for s, n in graphs.replayed_graphs if s == size) == [128, 256, 512, 1024]
