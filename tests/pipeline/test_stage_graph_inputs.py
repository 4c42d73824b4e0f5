"""What lets the Qwen3-Omni stages replay CUDA graphs, checked on the CPU (the graphs themselves need CUDA:
tests/gpu/test_omni_gpu.py):

- one talker graph serves every step: embedding a step's rows from the fixed graph buffers (both
  projections computed, codes padded with -1, stale padding rows) equals embedding the step's own inputs;
- the code predictor's rows are independent of their batch-mates, so a graph padded to a larger row
  count gives each real row the codes of an unpadded run, greedy and seeded sampling alike;
- the thinker's stage rows come from fixed buffers the forward writes (no clone per step), and a forward
  larger than buffers fixed for graphs is a clear error.
"""
from __future__ import annotations

import pytest
import torch

from pellucid.models.loader import load_model
from pellucid.models.qwen3_omni.talker import PROJECT_HIDDEN, PROJECT_TEXT, TALKER_INPUTS_KEY, TalkerStepInputs


@pytest.fixture(scope="module")
def talker(omni_dir):
    model, _ = load_model(omni_dir, torch.float32, "cpu", max_model_len=256, submodel="talker")
    return model


def _step_inputs(model, rows: int, seed: int) -> TalkerStepInputs:
    g = torch.Generator().manual_seed(seed)
    omni = model.omni
    groups, vocab = omni.num_code_groups, int(omni.talker_text.vocab_size)
    width = int(omni.talker.thinker_hidden_size)
    projection = torch.randint(0, 2, (rows,), generator=g)
    codes = torch.randint(0, min(vocab, omni.code_predictor.vocab_size), (rows, groups), generator=g)
    codes[torch.rand(rows, groups, generator=g) < 0.3] = -1
    return TalkerStepInputs(torch.randn(rows, width, generator=g), projection, codes,
                            any_hidden=bool((projection == PROJECT_HIDDEN).any()),
                            any_codes=bool((codes >= 0).any()))


def test_one_talker_graph_serves_every_step(talker):
    talker.prepare_cuda_graphs(max_graph_size=16, max_num_tokens=64)
    embed = talker.talker.embed_inputs
    for seed, rows, size in ((0, 5, 8), (1, 8, 8), (2, 3, 16), (3, 1, 1)):
        step = _step_inputs(talker, rows, seed)
        if seed == 3:     # text projection only, no codes: the host flags spare work the graph always does
            step = TalkerStepInputs(step.thinker_vectors, torch.full((1,), PROJECT_TEXT), torch.full_like(step.codes, -1),
                                    any_hidden=False, any_codes=False)
        talker.load_graph_step_extras(size, {TALKER_INPUTS_KEY: step})
        fixed = talker.graph_step_extras(size)[TALKER_INPUTS_KEY]
        assert fixed.projection.shape[0] == size
        torch.testing.assert_close(embed(fixed)[:rows], embed(step), rtol=1e-6, atol=1e-6)


def test_a_step_larger_than_its_graph_is_refused(talker):
    talker.prepare_cuda_graphs(max_graph_size=4, max_num_tokens=64)
    with pytest.raises(RuntimeError, match="does not fit a graph of 2"):
        talker.load_graph_step_extras(2, {TALKER_INPUTS_KEY: _step_inputs(talker, 3, 0)})


@pytest.mark.parametrize("sampling", [False, True])
def test_code_predictor_rows_do_not_depend_on_padding(talker, sampling):
    predictor = talker.talker.code_predictor
    hidden_size = int(predictor.config.hidden_size)
    g = torch.Generator().manual_seed(7)
    rows, padded = 3, 8
    hidden, first = torch.randn(padded, hidden_size, generator=g), torch.randn(padded, hidden_size, generator=g)
    greedy = torch.tensor([True, False, False, True, False, True, False, False]) if sampling else None
    seeds = {1: 11, 2: 12} if sampling else {}
    with torch.inference_mode():
        expected = predictor.predict(hidden[:rows], first[:rows], None if greedy is None else greedy[:rows], seeds)
        noise = None
        if sampling:
            noise = torch.ones(predictor.noise_shape(padded))      # padding rows keep whatever is there
            predictor.draw_noise(rows, hidden.device, seeds, out=noise[:rows])
        got = predictor.predict_codes(hidden, first, greedy, noise)[:rows]
    assert got.tolist() == expected.tolist()
    if sampling:      # the seeded rows sampled (not all argmax): the noise took part
        with torch.inference_mode():
            argmax = predictor.predict(hidden[:rows], first[:rows], None, {})
        assert got[1:].tolist() != argmax[1:].tolist()


def test_thinker_stage_rows_come_from_fixed_buffers(omni_dir):
    model, _ = load_model(omni_dir, torch.float32, "cpu", max_model_len=256, submodel="thinker")
    model.set_stage_capture(True)
    hf = _hf_hidden_states(omni_dir, model)
    model.prepare_cuda_graphs(max_graph_size=4, max_num_tokens=8)
    buffers = {name: t.data_ptr() for name, t in model._capture_buffers.items()}
    ids = torch.randint(5, 200, (6,), generator=torch.Generator().manual_seed(0))
    outputs = _run_prefill(model, ids)
    assert {name: t.data_ptr() for name, t in model._capture_buffers.items()} == buffers
    embed, hidden = hf(ids)
    torch.testing.assert_close(outputs["embed"], embed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["hidden"], hidden, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="exceeds the 'embed' capture buffer"):
        _run_prefill(model, torch.randint(5, 200, (9,)))


def _hf_hidden_states(omni_dir, model):
    """transformers' thinker: (hidden_states[0], hidden_states[accept layer]) of a prompt."""
    import transformers

    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    layer = model.omni.talker.accept_hidden_layer

    def run(ids):
        with torch.no_grad():
            out = hf.thinker(input_ids=ids[None], output_hidden_states=True)
        return out.hidden_states[0][0], out.hidden_states[layer][0]
    return run


def _run_prefill(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One prefill forward of `ids` on a fresh paged cache (outside inference mode, as tests run models);
    the thinker's stage outputs of it."""
    from types import SimpleNamespace

    from tests.models.helpers import PagedModelRunner

    PagedModelRunner(model, block_size=16).step([("r", ids.tolist())])
    return {k: v.clone() for k, v in model.stage_outputs(SimpleNamespace(num_tokens=len(ids)), None).items()}
