"""Traced requests on steps launched ahead of the previous step's readback (async scheduling).

The reference is the same traced batch on a serial engine: every save (generated positions included),
every edit's effect on the tokens and every untraced neighbour's output must be the same, and a request
that ends while the next step already holds it keeps no row past its end."""
from __future__ import annotations

import pytest
import torch

from pellucid import SamplingParams
from tests.tracing.conftest import TOLERANCE, random_prompts, relative_error


def _traced_batch(llm, seed: int) -> tuple[list, dict[str, torch.Tensor]]:
    prompts = random_prompts(seed, [9, 17, 5, 12])
    vector = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    bias = torch.zeros(512)
    bias[123] = 30.0
    saves = {}
    with llm.trace() as tr:
        with tr.invoke(prompts[0], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)):
            saves["layer1"] = tr.model.layers[1].output.save()
            saves["tokens0"] = tr.tokens.save()
        with tr.invoke(prompts[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
            tr.model.layers[0].output.add(vector, phase="generated")
            saves["mlp0"] = tr.model.layers[0].mlp.output.save()
        with tr.invoke(prompts[2], SamplingParams(temperature=0.8, seed=seed, max_tokens=9, ignore_eos=True)):
            tr.logits.add(bias, positions={"start": -1})
            saves["logits"] = tr.logits.save(positions={"start": -1})
    steps_ahead = llm.engine.num_steps_ahead
    untraced = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    outputs = [o.outputs[0].token_ids for o in tr.outputs] + [untraced[0].outputs[0].token_ids]
    values = {name: save.value for name, save in saves.items()}
    values["steps_ahead_in_trace"] = torch.tensor(steps_ahead)
    return outputs, values


@pytest.mark.parametrize("seed", [0, 1])
def test_traced_requests_stepping_ahead_match_serial(make_llm, seed):
    serial_llm = make_llm("llama", async_scheduling=False)
    ahead_llm = make_llm("llama", async_scheduling=True)
    serial_outputs, serial_saves = _traced_batch(serial_llm, seed)
    ahead_outputs, ahead_saves = _traced_batch(ahead_llm, seed)
    assert ahead_saves.pop("steps_ahead_in_trace") > 0 and serial_saves.pop("steps_ahead_in_trace") == 0
    assert ahead_outputs == serial_outputs
    for name, value in serial_saves.items():
        assert ahead_saves[name].shape == value.shape, name
        assert relative_error(ahead_saves[name], value) <= TOLERANCE, name
    # Positions computed: prompt + generated tokens except the last, never one more.
    assert serial_saves["layer1"].shape[0] == 9 + 7 - 1
    assert ahead_llm.engine.kv_manager.block_pool.num_used_blocks == 0
