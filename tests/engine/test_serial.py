"""Engine messages through msgpack: tensors and arrays come back bit-equal, large ones as side frames."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pellucid.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInput,
                                      EngineStats, FinishRequests)
from pellucid.engine.serial import MessageDecoder, MessageEncoder
from pellucid.sampling_params import SamplingParams
from pellucid.tracing import Add, Save, TracePlan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_with_tensors_and_arrays_round_trip(seed):
    g = torch.Generator().manual_seed(seed)
    saves = {"big": torch.randn(300, 64, generator=g).to(torch.bfloat16),        # a side frame
             "small": torch.randn(3, generator=g),                                # inline in the body
             "empty": torch.empty(0, 64),
             "ids": torch.randint(0, 1000, (17,), generator=g)}
    rng = np.random.default_rng(seed)
    logprobs = [(rng.integers(0, 1000, 6), rng.standard_normal(6).astype(np.float32), 3)]
    prompt = (2, (rng.integers(0, 1000, (40, 3)), rng.standard_normal((40, 3)).astype(np.float32),
                  rng.integers(1, 9, 40)))
    sent = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5, 6], new_logprobs=logprobs, prompt_logprobs=prompt, finish_reason="stop",
                                  stop_reason=7, extras={"saves": saves, "save_positions": {"big": list(range(300))}}),
                 EngineCoreOutput("r2", [9])],
        stats=EngineStats(num_running=2, lm_head_usage={"rows_fast": 3}))
    frames = MessageEncoder().encode(sent)
    assert len(frames) >= 3           # the body, then the large tensor and array as their own frames
    got = MessageDecoder(EngineCoreOutputs).decode([bytes(memoryview(f)) for f in frames])
    assert got.stats == sent.stats
    first = got.outputs[0]
    assert (first.request_id, first.new_token_ids, first.finish_reason, first.stop_reason) == ("r1", [5, 6], "stop", 7)
    for name, tensor in saves.items():
        assert first.extras["saves"][name].dtype == tensor.dtype
        assert torch.equal(first.extras["saves"][name], tensor)
    assert first.extras["save_positions"] == {"big": list(range(300))}
    ids, lps, rank = first.new_logprobs[0]
    assert np.array_equal(ids, logprobs[0][0]) and np.array_equal(lps, logprobs[0][1]) and rank == 3
    assert first.prompt_logprobs[0] == 2
    for a, b in zip(first.prompt_logprobs[1], prompt[1]):
        assert np.array_equal(a, b)
    assert got.outputs[1] == EngineCoreOutput("r2", [9])


def test_requests_carry_their_features_pickled():
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    plan = TracePlan([Add(site="model.layers.0", value=vector), Save(site="model.norm", name="n")])
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=4), 1.5,
                                stream=False, extras={"trace": plan, "cache_salt": "tenant"})
    decoder = MessageDecoder(EngineInput)
    got = decoder.decode(MessageEncoder().encode(request.with_pickled_extras())).with_unpickled_extras()
    assert got.params == request.params and got.params.stop_strings == ["x"]
    assert (got.request_id, got.prompt_token_ids, got.arrival_time, got.stream) == ("r", [1, 2, 3], 1.5, False)
    assert got.extras["cache_salt"] == "tenant"
    assert [op.kind for op in got.extras["trace"].ops] == ["add", "save"]
    assert torch.equal(got.extras["trace"].ops[0].value, vector)
    finish = decoder.decode(MessageEncoder().encode(FinishRequests(["a", "b"], "stop", [3, 4])))
    assert finish == FinishRequests(["a", "b"], "stop", [3, 4])
