"""The Qwen3-Omni pipeline on the GPU (each stage an engine process, chunks through shared memory) against
the same pipeline on the CPU in one process: the same text tokens and talker codes, float32 tiny model."""
from __future__ import annotations

import pytest
import torch

from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.omni import OmniLLM
from pellucid.sampling_params import SamplingParams

CONVERSATIONS = [[{"role": "user", "content": "Hello there, how are you?"}],
                 [{"role": "user", "content": "Tell me about the old clock."}]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipeline_on_gpu_matches_cpu(omni_dir) -> None:
    text = SamplingParams(temperature=0, max_tokens=16)
    talker = SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=40)
    graph = qwen3_omni_graph(3, decode_chunk=8, left_context=4)
    kwargs = dict(dtype="float32", max_model_len=256)
    with OmniLLM(omni_dir, graph, device="cpu", **kwargs) as cpu:
        expected = cpu.chat(CONVERSATIONS, text, talker_params=talker)
    with OmniLLM(omni_dir, graph, device="cuda", engine_process=True, num_kv_blocks=256, **kwargs) as gpu:
        got = gpu.chat(CONVERSATIONS, text, talker_params=talker)
    for a, b in zip(got, expected):
        assert a.error is None and a.token_ids == b.token_ids and a.stage_token_ids == b.stage_token_ids
        # cuDNN may run the vocoder's convolutions in TF32.
        assert a.audio.shape == b.audio.shape and torch.allclose(a.audio, b.audio, atol=5e-3)
