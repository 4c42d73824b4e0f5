"""Ops, selectors and tensors in JSON; selector resolution against a brute-force reference."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pellucid import SamplingParams
from pellucid.tracing import (Add, Apply, MeanAblate, Save, Scale, Set, TracePlan, Zero, b64_to_tensors,
                              op_from_json, ops_from_json, ops_to_json, tensors_to_b64)
from pellucid.tracing.selectors import Selector
from tests.tracing.conftest import random_prompts


def _ops(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [
        Save(site="model.layers.0", name="h0", positions=[1, -1]),
        Set(site="model.layers.1.mlp", point="input", value=torch.randn(3, 64, generator=gen), positions=slice(0, 3)),
        Add(site="model.layers.1", value=torch.randn(64, generator=gen).to(torch.bfloat16), phase="generated"),
        Scale(site="model.layers.0.self_attn.o_proj", factor=0.5, positions={"start": -2, "step": 1}),
        Zero(site="model.layers.2.mlp", phase=[0, 2]),
        MeanAblate(site="model.norm", mean=torch.randn(64, generator=gen), positions="last"),
        Save(site="logits", positions={"start": -1}),
        Save(site="tokens"),
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ops_round_trip_through_json(seed):
    ops = _ops(seed)
    text = json.dumps(ops_to_json(ops))
    back = ops_from_json(json.loads(text))
    assert len(back) == len(ops)
    for a, b in zip(ops, back):
        assert type(a) is type(b) and a.site == b.site and a.point == b.point and a.selector == b.selector
        for name in ("value", "mean"):
            if hasattr(a, name):
                assert getattr(a, name).dtype == getattr(b, name).dtype
                assert torch.equal(getattr(a, name), getattr(b, name))
        if isinstance(a, Save):
            assert a.name == b.name
        if isinstance(a, Scale):
            assert a.factor == b.factor


def test_json_plan_runs_like_the_python_plan(make_llm):
    llm = make_llm("llama")
    prompt = random_prompts(1, [10])[0]
    vector = torch.randn(64, generator=torch.Generator().manual_seed(2))
    ops = [Add(site="model.layers.1", value=vector), Save(site="model.layers.2", name="h"),
           Save(site="logits", positions="last", name="logits")]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    direct, via_json = llm.generate([prompt, prompt], params, use_tqdm=False,
                                    extras=[{"trace": TracePlan(ops)},
                                            {"trace": json.loads(json.dumps(ops_to_json(ops)))}])
    for name in ("h", "logits"):
        assert torch.equal(direct.extras["saves"][name], via_json.extras["saves"][name])
    assert direct.outputs[0].token_ids == via_json.outputs[0].token_ids
    # Saved tensors travel back the same way.
    decoded = b64_to_tensors(tensors_to_b64(direct.extras["saves"]))
    assert decoded.keys() == direct.extras["saves"].keys()
    assert all(torch.equal(decoded[k], v) for k, v in direct.extras["saves"].items())


def test_plain_number_lists_are_accepted_as_values():
    op = op_from_json({"op": "add", "site": "model.layers.0", "value": [0.5] * 64})
    assert op.value.shape == (64,) and op.value.dtype == torch.float32


@pytest.mark.parametrize("body, message", [
    ({"op": "apply", "site": "model.layers.0"}, "offline only"),
    ({"op": "explode", "site": "model.layers.0"}, "unknown op 'explode'"),
    ({"op": "save"}, "needs a 'site'"),
    ({"op": "save", "site": "model.norm", "colour": "red"}, "no field"),
    ({"op": "add", "site": "model.norm"}, "needs a 'value'"),
    ({"op": "add", "site": "model.norm", "value": "not base64!"}, "base64"),
    ({"op": "add", "site": "model.norm", "value": "aGVsbG8="}, "safetensors"),
    ({"op": "add", "site": "model.norm", "value": [["a"]]}, "list of numbers"),
    ({"op": "scale", "site": "model.norm"}, "needs a 'factor'"),
    ({"op": "scale", "site": "model.norm", "factor": "big"}, "factor must be a number"),
    ({"op": "save", "site": "model.norm", "point": "middle"}, "point must be"),
    ({"op": "save", "site": "model.norm", "phase": "later"}, "phase must be"),
    ({"op": "save", "site": "model.norm", "positions": {"start": 0, "stride": 2}}, "unknown keys"),
    ({"op": "save", "site": "model.norm", "positions": [1.5]}, "integers"),
    ({"op": "set", "site": "tokens", "value": [1.0]}, "supports only save"),
    ({"op": "save", "site": "logits", "point": "input"}, "only an output"),
    ("save", "JSON object"),
])
def test_malformed_ops_name_the_problem(body, message):
    with pytest.raises(ValueError, match=message):
        ops_from_json([body])


def test_apply_does_not_serialize():
    with pytest.raises(ValueError, match="offline only"):
        ops_to_json([Apply(site="model.norm", fn=lambda x: x)])


def _brute_force(selector: Selector, prompt_len: int, limit: int) -> list[int]:
    def position_ok(p: int) -> bool:
        spec = selector.positions
        if spec is None:
            ok = True
        elif spec == "last":
            ok = p == prompt_len - 1
        elif isinstance(spec, tuple):
            ok = p in {q if q >= 0 else prompt_len + q for q in spec}
        else:
            start = 0 if spec.start is None else (spec.start if spec.start >= 0 else prompt_len + spec.start)
            stop = None if spec.stop is None else (spec.stop if spec.stop >= 0 else prompt_len + spec.stop)
            ok = p >= start and (stop is None or p < stop) and (p - start) % spec.step == 0
        phase = selector.phase
        if phase == "prompt":
            ok = ok and p < prompt_len
        elif phase == "generated":
            ok = ok and p >= prompt_len
        elif isinstance(phase, tuple):
            step = 0 if p < prompt_len else p - prompt_len + 1
            ok = ok and step in phase
        return ok
    return [p for p in range(limit) if position_ok(p)]


@pytest.mark.parametrize("seed", range(5))
def test_selectors_resolve_like_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(200):
        prompt_len = rng.randint(1, 20)
        limit = prompt_len + rng.randint(0, 10)
        positions = rng.choice([
            None, "last",
            sorted({rng.randint(-prompt_len, limit - 1) for _ in range(rng.randint(1, 4))}),
            slice(rng.choice([None, rng.randint(-prompt_len, limit)]), rng.choice([None, rng.randint(-prompt_len, limit + 3)]),
                  rng.choice([None, 1, 2, 3])),
        ])
        phase = rng.choice(["all", "prompt", "generated", sorted(rng.sample(range(8), rng.randint(1, 3)))])
        selector = Selector.make(positions, phase)
        got = selector.resolve(prompt_len, limit)
        assert got.dtype == np.int64
        assert got.tolist() == _brute_force(selector, prompt_len, limit), (positions, phase, prompt_len, limit)
