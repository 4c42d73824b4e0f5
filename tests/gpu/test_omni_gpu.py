"""The Qwen3-Omni pipeline on the GPU (each stage an engine process, chunks through shared memory; or each
in a thread of one process, on a CUDA stream of its own) against
the same pipeline on the CPU in one process: the same text tokens and talker codes, float32 tiny model,
with the thinker's and talker's decode steps replaying CUDA graphs (the talker's code predictor its own);
seeded sampling gives the same with graphs as eagerly; the code predictor's graphs equal its eager loop."""
from __future__ import annotations

import pytest
import torch

from pellucid.models.loader import load_model

from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.omni import OmniLLM
from pellucid.sampling_params import SamplingParams

CONVERSATIONS = [[{"role": "user", "content": "Hello there, how are you?"}],
                 [{"role": "user", "content": "Tell me about the old clock."}]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("home", ["engine_process", "stage_threads"])
def test_pipeline_on_gpu_matches_cpu(omni_dir, home: str) -> None:
    text = SamplingParams(temperature=0, max_tokens=16)
    talker = SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=40)
    graph = qwen3_omni_graph(3, decode_chunk=8, left_context=4)
    kwargs = dict(dtype="float32", max_model_len=256)
    with OmniLLM(omni_dir, graph, device="cpu", **kwargs) as cpu:
        expected = cpu.chat(CONVERSATIONS, text, talker_params=talker)
    with OmniLLM(omni_dir, graph, device="cuda", num_kv_blocks=256, **{home: True}, **kwargs) as gpu:
        got = gpu.chat(CONVERSATIONS, text, talker_params=talker)
        _assert_graphs_replayed(gpu)
    for a, b in zip(got, expected):
        assert a.error is None and a.token_ids == b.token_ids and a.stage_token_ids == b.stage_token_ids
        # cuDNN may run the vocoder's convolutions in TF32.
        assert a.audio.shape == b.audio.shape and torch.allclose(a.audio, b.audio, atol=5e-3)


def _assert_graphs_replayed(omni: OmniLLM) -> None:
    stats = omni.pipeline.stats()
    for stage in ("thinker", "talker"):
        assert stats[stage].num_graph_steps > 0, (stage, stats[stage])
    assert stats["talker"].lm_head_usage["code_predictor_graph"] > 0, stats["talker"].lm_head_usage


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_with_graphs_equals_eager(omni_dir) -> None:
    text = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    talker = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_tokens=30, seed=9)
    graph = qwen3_omni_graph(3, decode_chunk=8, left_context=4)
    kwargs = dict(dtype="float32", max_model_len=256, device="cuda", engine_process=True, num_kv_blocks=256)
    results = []
    for eager in (True, False):
        with OmniLLM(omni_dir, graph, enforce_eager=eager, **kwargs) as omni:
            results.append(omni.chat(CONVERSATIONS, text, talker_params=talker))
            if not eager:
                _assert_graphs_replayed(omni)
    for a, b in zip(*results):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids and a.stage_token_ids == b.stage_token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_code_predictor_graphs_equal_eager(omni_dir) -> None:
    from pellucid.models.qwen3_omni.code_predictor_graphs import CodePredictorGraphs

    model, _ = load_model(omni_dir, torch.float32, "cuda", max_model_len=256, submodel="talker")
    predictor = model.talker.code_predictor
    graphs = CodePredictorGraphs(predictor, [1, 2, 4, 8], torch.float32, torch.device("cuda"))
    graphs.capture()
    hidden_size = int(predictor.config.hidden_size)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 3, 8, 5):
            hidden = torch.randn(rows, hidden_size, device="cuda", generator=g)
            first = torch.randn(rows, hidden_size, device="cuda", generator=g)
            greedy = torch.arange(rows, device="cuda") % 2 == 0
            seeds = {r: 100 + r for r in range(1, rows, 2)}
            for mask in (None, greedy):
                expected = predictor.predict(hidden, first, mask, seeds if mask is not None else {})
                got = graphs.predict(hidden, first, mask, seeds if mask is not None else {})
                assert got.tolist() == expected.tolist(), (rows, mask)
        assert graphs.predict(torch.zeros(9, hidden_size, device="cuda"), torch.zeros(9, hidden_size, device="cuda"),
                              None, {}) is None     # more rows than the largest graph: the caller runs eagerly
    assert graphs.num_rows == 2 * (1 + 3 + 8 + 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_code_predictor_on_gpu_matches_cpu(omni_dir) -> None:
    """The code predictor's CUDA path (keys and values stored by the q/k norm + rotary kernel, each code drawn in
    one launch) gives the torch path's codes on the CPU, greedy and sampling with the same noise."""
    predictors = {device: load_model(omni_dir, torch.float32, device, max_model_len=256, submodel="talker")[0]
                  .talker.code_predictor for device in ("cpu", "cuda")}
    hidden_size = int(predictors["cpu"].config.hidden_size)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 3, 8):
            hidden = torch.randn(rows, hidden_size, generator=g)
            first = torch.randn(rows, hidden_size, generator=g)
            greedy = torch.rand(rows, generator=g) < 0.4
            noise = torch.empty(predictors["cpu"].noise_shape(rows)).exponential_(generator=g)
            for mask, draws in ((None, None), (greedy, noise)):
                codes = {device: predictor.predict_codes(
                    hidden.to(device), first.to(device), mask.to(device) if mask is not None else None,
                    draws.to(device) if draws is not None else None).tolist()
                    for device, predictor in predictors.items()}
                assert codes["cuda"] == codes["cpu"], (rows, mask)
