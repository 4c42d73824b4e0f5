"""Saved activations and edits against transformers' own model with forward hooks."""
from __future__ import annotations

import pytest
import torch

from pellucid import SamplingParams
from pellucid.tracing import Add, Save, TracePlan, Zero
from tests.conftest import ARCHS
from tests.tracing.conftest import NUM_LAYERS, TOLERANCE, hf_forward, random_prompts, relative_error, replace_output

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_outputs_match_transformers_in_a_mixed_batch(make_llm, hf_model, arch):
    """Every decoder layer's output, prompt and generated positions, for traced requests that share their
    batches with untraced ones; the untraced outputs equal a run without the traced requests."""
    llm = make_llm(arch)
    seed = ARCHS.index(arch)
    traced = random_prompts(seed, [9, 23])
    untraced = random_prompts(seed + 100, [14, 31, 5])
    ops = [Save(site=f"model.layers.{i}", name=f"layer{i}") for i in range(NUM_LAYERS)]
    ops.append(Save(site="model.norm", name="norm"))
    prompts = [untraced[0], traced[0], untraced[1], traced[1], untraced[2]]
    extras = [None, {"trace": TracePlan(ops)}, None, {"trace": TracePlan(ops)}, None]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, extras=extras)

    alone = llm.generate(untraced, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == \
        [outputs[i].outputs[0].token_ids for i in (0, 2, 4)]

    hf = hf_model(arch)
    for index in (1, 3):
        out = outputs[index]
        generated = out.outputs[0].token_ids
        sequence = prompts[index] + generated[:-1]          # every position the engine computed
        ref = hf_forward(hf, sequence)
        saves = out.extras["saves"]
        for i in range(NUM_LAYERS):
            assert saves[f"layer{i}"].shape == (len(sequence), 64)
            assert relative_error(saves[f"layer{i}"], ref["layers"][i]) <= TOLERANCE
            if i < NUM_LAYERS - 1:
                # transformers' hidden_states[i + 1] is layer i's output except for the last layer,
                # where it reports the final-normed state (model.norm.output).
                assert relative_error(saves[f"layer{i}"], ref["hidden_states"][i + 1]) <= TOLERANCE
        assert relative_error(saves["norm"], ref["hidden_states"][NUM_LAYERS]) <= TOLERANCE
        assert out.extras["save_positions"]["layer0"] == list(range(len(sequence)))


@pytest.mark.parametrize("seed", [0, 1])
def test_mlp_ablation_matches_a_transformers_hook(make_llm, hf_model, seed):
    llm = make_llm("qwen3")
    hf = hf_model("qwen3")
    prompt = random_prompts(seed, [17])[0]
    layer = 1
    with llm.trace([prompt]) as tr:
        tr.model.layers[layer].mlp.output.zero()
        logits = tr.logits.save()
    ref = hf_forward(hf, prompt, [(hf.model.layers[layer].mlp, replace_output(torch.zeros_like))])["logits"]
    clean = hf_forward(hf, prompt)["logits"]
    assert relative_error(logits[0], ref) <= TOLERANCE
    assert relative_error(logits[0], clean) > 1e-2      # the ablation did change something


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steering_vector_matches_a_transformers_hook_in_prefill_and_decode(make_llm, hf_model, seed):
    llm = make_llm("llama")
    hf = hf_model("llama")
    gen = torch.Generator().manual_seed(seed)
    vector = torch.randn(64, generator=gen) * 2.0
    prompt = random_prompts(seed, [12])[0]
    layer = 1
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with llm.trace([prompt], params) as tr:
        tr.model.layers[layer].output.add(vector)
        logits = tr.logits.save(positions={"start": -1})     # the logits each output token is sampled from
    steered = tr.outputs[0].outputs[0].token_ids
    hook = (hf.model.layers[layer], replace_output(lambda h: h + vector))
    handle = hf.model.layers[layer].register_forward_hook(hook[1])
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    finally:
        handle.remove()
    assert steered == ref_tokens
    ref_logits = hf_forward(hf, prompt + steered[:-1], [hook])["logits"][len(prompt) - 1:]
    assert logits[0].shape == ref_logits.shape
    assert relative_error(logits[0], ref_logits) <= TOLERANCE


def test_edit_restricted_to_positions_matches_a_hook_on_those_positions(make_llm, hf_model):
    llm = make_llm("qwen2")
    hf = hf_model("qwen2")
    prompt = random_prompts(5, [15])[0]
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5))
    positions = [2, 7, -1]                     # -1: the last prompt token
    with llm.trace([prompt]) as tr:
        tr.model.layers[0].self_attn.o_proj.output.add(vector, positions=positions)
        logits = tr.logits.save()

    def add_at(h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[:, [2, 7, len(prompt) - 1]] += vector
        return h
    ref = hf_forward(hf, prompt, [(hf.model.layers[0].self_attn.o_proj, replace_output(add_at))])["logits"]
    assert relative_error(logits[0], ref) <= TOLERANCE


def test_zero_input_edit_affects_only_that_module(make_llm, hf_model):
    """An input edit changes what the module sees, not the tensor its caller still uses (the residual)."""
    llm = make_llm("llama")
    hf = hf_model("llama")
    prompt = random_prompts(9, [11])[0]
    plan = TracePlan([Zero(site="model.layers.1.mlp", point="input", positions="last"),
                      Save(site="logits", name="logits")])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False,
                       extras=[{"trace": plan}])[0]

    def zero_last_input(_module, args):
        x = args[0].clone()
        x[:, -1] = 0
        return (x, *args[1:])
    handle = hf.model.layers[1].mlp.register_forward_pre_hook(zero_last_input)
    try:
        ref = hf_forward(hf, prompt)["logits"]
    finally:
        handle.remove()
    assert relative_error(out.extras["saves"]["logits"], ref) <= TOLERANCE
