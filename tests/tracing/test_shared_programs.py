"""Shared tap programs (pellucid/tracing/shared_programs.py) against a program built for each request.

A request may read a program shared with other requests only where it equals its own: at every position
it computes (0 .. limit - 1), every array of the shared program (keep, scale, coef, value slots and
ranks, the packed per-step forms, the save masks) must equal build_program's for that request. Random
op lists over two sites, some with selectors (never shared), some with one value tensor used by several
requests, on random prompt lengths and limits, in random order (so shorter requests follow longer ones
and the other way round)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pellucid.tracing import Add, Apply, MeanAblate, Save, Scale, Set, TracePlan, Zero
from pellucid.tracing.shared_programs import SharedPrograms
from pellucid.tracing.sites import SiteInfo, SiteTable
from pellucid.tracing.tap_program import build_program

HIDDEN = 6
TARGETS = [("model.layers.0", "output"), ("model.layers.1.mlp", "output")]
TABLE = SiteTable([SiteInfo(f"{m}.{p}", m, p, (HIDDEN,), torch.float32) for m, p in TARGETS], {})
ARRAYS = ("keep", "scale", "coef", "value_slot", "value_rank", "params", "value_local", "has_value")


def _random_op(rng: random.Random, site: str, vectors: list[torch.Tensor]):
    selector = {} if rng.random() < 0.7 else rng.choice([{"positions": "last"}, {"phase": "generated"},
                                                          {"positions": {"start": 2}}, {"phase": "prompt"}])
    kind = rng.choice(["save", "add", "set", "scale", "zero", "mean", "apply"])
    if kind == "save":
        return Save(site=site, **selector)
    if kind == "add":
        return Add(site=site, value=rng.choice(vectors), **selector)
    if kind == "set":
        return Set(site=site, value=rng.choice(vectors), **selector)
    if kind == "mean":
        return MeanAblate(site=site, mean=rng.choice(vectors), **selector)
    if kind == "scale":
        return Scale(site=site, factor=rng.choice([0.5, 2.0, -1.0]), **selector)
    if kind == "zero":
        return Zero(site=site, **selector)
    return Apply(site=site, fn=lambda x: x * 2, **selector)


def _same_program(shared, own, limit: int) -> None:
    if own is None or shared is None:
        assert shared is None and own is None
        return
    assert shared.edits == own.edits and shared.value_ops == own.value_ops
    for name in ARRAYS:
        got, want = getattr(shared, name), getattr(own, name)
        assert got.shape[0] > limit - 1 and np.array_equal(got[:limit], want[:limit]), name
    for stage in ("pre_saves", "post_saves"):
        got, want = getattr(shared, stage), getattr(own, stage)
        assert [i for i, _ in got] == [i for i, _ in want]
        for (_, g), (_, w) in zip(got, want):
            assert np.array_equal(g[:limit], w[:limit]), stage


@pytest.mark.parametrize("seed", range(6))
def test_shared_program_equals_the_requests_own(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vectors = [torch.randn(HIDDEN), torch.randn(1), torch.randn(HIDDEN)]
    # A few op lists, each used by several requests (one ops object per request, as a user would write them).
    shapes = []
    for _ in range(4):
        ops = []
        for _ in range(rng.randint(1, 3)):
            module, _ = rng.choice(TARGETS)
            ops.append((module, rng.randrange(10 ** 6)))
        shapes.append(ops)
    cache = SharedPrograms(capacity=rng.choice([2, 64]))
    for request in range(40):
        recipe = rng.choice(shapes)
        op_rng = random.Random(sum(token for _, token in recipe))    # the same ops for one recipe
        ops = [_random_op(op_rng, module, vectors) for module, _ in recipe]
        prompt_len = rng.randint(1, 30)
        max_total = prompt_len + rng.randint(1, 25)
        try:
            plan = TracePlan(ops).bind(prompt_len, max_total, f"r{request}", TABLE)
        except ValueError:
            continue        # e.g. a selector with nothing to select in this request
        for target in plan.module_target_list:
            try:
                own = build_program(plan, target, plan.limit)
            except ValueError as exc:
                with pytest.raises(ValueError, match=str(exc).split(" (")[0][:40]):
                    cache.program_for(plan, target)
                continue
            _same_program(cache.program_for(plan, target), own, plan.limit)
    assert cache.builds > 0


def test_one_steering_vector_is_built_once_per_longest_request():
    vector = torch.randn(HIDDEN)
    cache = SharedPrograms()
    target = TARGETS[0]
    programs = []
    for i, (prompt_len, new) in enumerate([(20, 10), (5, 3), (29, 10), (8, 8), (3, 2)]):
        plan = TracePlan([Add(site=target[0], value=vector), Save(site=target[0])]).bind(prompt_len, prompt_len + new,
                                                                                         f"r{i}", TABLE)
        programs.append(cache.program_for(plan, target))
    # Built for the first request, then for the longer third; every other request reuses.
    assert cache.builds == 2 and cache.hits == 3
    assert programs[1] is programs[0] and programs[3] is programs[2] and programs[4] is programs[2]
    # A different vector is a different program.
    plan = TracePlan([Add(site=target[0], value=torch.randn(HIDDEN)), Save(site=target[0])]).bind(4, 6, "x", TABLE)
    assert cache.program_for(plan, target) is not programs[2] and cache.builds == 3


def test_an_in_place_change_of_the_value_is_a_new_program():
    """The program carries device copies of its values (its forms): a vector changed in place between two
    requests must not reach the second through the first one's program."""
    vector = torch.randn(HIDDEN)
    cache = SharedPrograms()
    target = TARGETS[0]

    def program():
        plan = TracePlan([Add(site=target[0], value=vector)]).bind(6, 9, "r", TABLE)
        return cache.program_for(plan, target)

    first = program()
    assert program() is first
    vector.mul_(-2.0)
    assert program() is not first and cache.builds == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_sharing_programs_equal_the_per_request_path(make_llm, monkeypatch, seed):
    """A batch in which most requests share one steering vector (and so one program), of random lengths, with
    chunked prefill (a small token budget gives mixed prefill + decode steps), against the per-request path."""
    from pellucid import SamplingParams
    from tests.tracing.conftest import random_prompts

    llm = make_llm("llama", max_num_batched_tokens=48)
    hidden = llm.engine.hf_config.hidden_size
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 40, (9,), generator=g).tolist()
    prompts = random_prompts(seed, lens)
    vector = torch.randn(hidden, generator=g)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def plans() -> list[dict]:
        out = []
        for i in range(len(prompts)):
            ops = [Save(site="model.layers.1", name="before"), Add(site="model.layers.1", value=vector),
                   Save(site="model.layers.1", name="after"), Save(site="model.layers.2.mlp", name="mlp")]
            if i % 4 == 3:      # not shareable: a selector
                ops[1] = Add(site="model.layers.1", value=vector, phase="generated")
            out.append({"trace": TracePlan(ops)})
        return out

    shared = llm.generate(prompts, params, use_tqdm=False, extras=plans())
    assert llm.engine.runner.tap_runtime.shared_programs.hits > 0
    monkeypatch.setattr(SharedPrograms, "program_for", lambda self, plan, target: None)
    reference = llm.generate(prompts, params, use_tqdm=False, extras=plans())
    for got, want in zip(shared, reference):
        assert got.error is None and want.error is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.extras["save_positions"] == want.extras["save_positions"]
        for name, value in want.extras["saves"].items():
            assert torch.equal(got.extras["saves"][name], value), name
