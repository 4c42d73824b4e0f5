"""Vectorised taps (pellucid/tracing/taps.py) against the per-request path, on random inputs.

The per-request path (hooks.py `_run_ops`) is the reference: forcing it is a matter of making
`SharedPrograms.program_for` (where the step gets each request's tap program) decline every target. The graph path's arithmetic (static buffers, whole-value copies
gathered after replay) is checked on the CPU through a stand-in for the CUDA graphs that runs the
forward under the capture hooks instead of replaying; the real graphs are checked on a GPU.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pellucid import SamplingParams
from pellucid.runner import model_runner as model_runner_module
from pellucid.tracing import Add, Apply, MeanAblate, Save, Scale, Set, TracePlan, Zero
from pellucid.tracing.shared_programs import SharedPrograms
from tests.tracing.conftest import random_prompts

HIDDEN = 64
SINGLE_EDIT_SEEDS = [0, 1, 2]


def single_edit_plans(seed: int, prompt_lens: list[int], max_tokens: int) -> list[TracePlan | None]:
    """One plan per request (None: untraced): saves around one edit each, random sites and selectors."""
    g = torch.Generator().manual_seed(seed)
    layer = lambda: int(torch.randint(0, 3, (1,), generator=g))  # noqa: E731
    vec = lambda: torch.randn(HIDDEN, generator=g)  # noqa: E731
    plans: list[TracePlan | None] = []
    for i, n in enumerate(prompt_lens):
        k = layer()
        site = f"model.layers.{k}"
        kind = i % 7
        if kind == 0:
            ops = [Save(site=site, name="a"), Add(site=site, value=vec()), Save(site=site, name="b")]
        elif kind == 1:
            ops = [Set(site=f"{site}.mlp", value=torch.randn(4, HIDDEN, generator=g), positions=[1, 3, -1, n + 1]),
                   Save(site=f"{site}.mlp", name="a")]
        elif kind == 2:
            ops = [Scale(site=site, factor=float(torch.rand(1, generator=g)) * 2, phase="generated"),
                   Save(site=site, name="a", positions={"start": 2})]
        elif kind == 3:
            ops = [Save(site=site, point="input", name="a"), Zero(site=site, point="input", positions="last")]
        elif kind == 4:
            ops = [MeanAblate(site=f"{site}.self_attn", mean=vec(), phase=[0, 2]),
                   Save(site="model.norm", name="a")]
        elif kind == 5:
            plans.append(None)      # untraced, in the same batch
            continue
        else:
            ops = [Save(site=site, name="a", positions=slice(0, None, 2))]
        plans.append(TracePlan(ops))
    return plans


def run(llm: Any, prompts: list[list[int]], plans: list[TracePlan | None], max_tokens: int) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    extras = [None if p is None else {"trace": p} for p in plans]
    return llm.generate(prompts, params, use_tqdm=False, extras=extras)


def per_request_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SharedPrograms, "program_for", lambda self, plan, target: None)


def assert_same(taps: list[Any], reference: list[Any], exact: bool = True) -> None:
    for t, r in zip(taps, reference):
        assert t.error is None and r.error is None
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        assert (t.extras or {}).get("save_positions") == (r.extras or {}).get("save_positions")
        for name, value in (r.extras or {}).get("saves", {}).items():
            got = t.extras["saves"][name]
            assert got.dtype == value.dtype and got.shape == value.shape
            if exact:
                assert torch.equal(got, value), name
            else:
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SINGLE_EDIT_SEEDS)
def test_taps_equal_the_per_request_path_bit_for_bit(make_llm, monkeypatch, seed):
    llm = make_llm("llama")
    lens = torch.randint(5, 20, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(seed, lens)
    tapped = run(llm, prompts, single_edit_plans(seed, lens, 5), 5)
    per_request_only(monkeypatch)
    reference = run(llm, prompts, single_edit_plans(seed, lens, 5), 5)
    assert_same(tapped, reference)
    # Untraced requests of the batch are unaffected by their traced neighbours.
    alone = run(llm, [prompts[5]], [None], 5)
    assert tapped[5].outputs[0].token_ids == alone[0].outputs[0].token_ids


@pytest.mark.parametrize("seed", [3, 4])
def test_composed_edits_match_the_per_request_path(make_llm, monkeypatch, seed):
    """Several edits composing on one target (scale then add, add then scale, zero then add, edits on
    disjoint positions) equal the sequential per-request edits up to float rounding."""
    g = torch.Generator().manual_seed(seed)
    v1, v2 = torch.randn(HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    plans = [
        TracePlan([Scale(site="model.layers.1", factor=0.5), Add(site="model.layers.1", value=v1),
                   Save(site="model.layers.1", name="a")]),
        TracePlan([Save(site="model.layers.0.mlp", name="a"), Add(site="model.layers.0.mlp", value=v1),
                   Scale(site="model.layers.0.mlp", factor=-1.5, phase="prompt")]),
        TracePlan([Zero(site="model.layers.2", positions=[0, 1, 2]), Add(site="model.layers.2", value=v2),
                   Set(site="model.layers.1", value=v1, positions=[0]),
                   Add(site="model.layers.1", value=v2, positions={"start": 1})]),
        None,
    ]
    prompts = random_prompts(seed, [9, 13, 11, 7])
    tapped = run(llm := make_llm("qwen3"), prompts, plans, 4)
    per_request_only(monkeypatch)
    reference = run(llm, prompts, [None if p is None else TracePlan(p.ops) for p in plans], 4)
    assert_same(tapped, reference, exact=False)


def test_ops_that_are_not_taps_share_a_target_with_taps(make_llm, monkeypatch):
    """An `apply` request (per-request path) and tap requests at the same site, in one batch."""
    llm = make_llm("llama")
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    plans = [TracePlan([Apply(site="model.layers.1", fn=lambda x: x * 2.0), Save(site="model.layers.1")]),
             TracePlan([Add(site="model.layers.1", value=vector), Save(site="model.layers.1")]),
             TracePlan([Save(site="model.layers.1", point="input"), Save(site="model.layers.1")])]
    prompts = random_prompts(6, [8, 12, 10])
    mixed = run(llm, prompts, plans, 4)
    per_request_only(monkeypatch)
    assert_same(mixed, run(llm, prompts, [TracePlan(p.ops) for p in plans], 4))


class GraphStandIn:
    """Runs a 'replay' as an eager forward under the capture hooks: the graph path's arithmetic on CPU."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.hooks: dict[tuple[int, Any], Any] = {}
        self.replays: list[Any] = []
        self.batch: Any = None

    def size_for(self, so: Any, handled_extras_keys: Any = ()) -> int | None:
        if so.total_num_scheduled_tokens != so.num_reqs:
            return None
        if any(req.extras and "trace" in req.extras and "trace" not in handled_extras_keys for req in so.requests):
            return None
        return so.num_reqs

    def ensure_variant(self, size: int, key: Any, hooks: Any, kv_caches: Any) -> bool:
        self.hooks.setdefault((size, key), hooks)
        return True

    def replay(self, size: int, key: Any, extras: Any = None, max_seq_len: int | None = None) -> torch.Tensor:
        self.replays.append(key)
        if not key:
            return self.runner._forward(self.batch, extras)
        with self.hooks[(size, key)](size):
            return self.runner._forward(self.batch, extras)


def install_graph_stand_in(llm: Any, monkeypatch: Any) -> GraphStandIn:
    """Make the engine's decode steps go through a GraphStandIn, which sees each step's batch."""
    runner = llm.engine.runner
    stand_in = GraphStandIn(runner)
    build = model_runner_module.build_step_batch

    def build_and_keep(*args: Any, **kwargs: Any) -> Any:
        stand_in.batch = build(*args, **kwargs)
        return stand_in.batch
    monkeypatch.setattr(model_runner_module, "build_step_batch", build_and_keep)
    monkeypatch.setattr(runner, "cuda_graphs", stand_in)
    return stand_in


@pytest.mark.parametrize("seed", [0, 1])
def test_graph_tap_path_equals_the_eager_tap_path(make_llm, monkeypatch, seed):
    llm = make_llm("llama")
    lens = torch.randint(5, 20, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(seed + 10, lens)
    eager = run(llm, prompts, single_edit_plans(seed, lens, 6), 6)

    stand_in = install_graph_stand_in(llm, monkeypatch)
    graphed = run(llm, prompts, single_edit_plans(seed, lens, 6), 6)
    assert any(stand_in.replays), "no decode step replayed with taps"
    assert_same(graphed, eager)


def test_a_value_that_does_not_fit_is_refused_before_anything_runs(make_llm):
    llm = make_llm("llama")
    prompts = random_prompts(7, [6, 9])
    cases = [(TracePlan([Add(site="model.layers.0", value=torch.ones(HIDDEN + 1))]),
              ["does not fit", f"({HIDDEN + 1},)"]),
             (TracePlan([Set(site="model.layers.0", value=torch.ones(3, HIDDEN), positions=[0, 1])]),
              ["3 rows", "selects 2 positions"]),
             (TracePlan([Scale(site="model.layers.0", factor=torch.ones(2, HIDDEN))]),
              ["scale factor", "does not fit"])]
    for plan, words in cases:
        with pytest.raises(ValueError) as info:
            run(llm, prompts, [None, plan], 3)      # the untraced request is not queued either
        assert all(word in str(info.value) for word in words), str(info.value)
        assert not llm.engine.has_unfinished_requests()
    fits = TracePlan([Set(site="model.layers.0", value=torch.ones(2, HIDDEN), positions=[0, 1]),
                      Scale(site="model.layers.0", factor=torch.ones(1))])
    assert all(out.error is None for out in run(llm, prompts, [None, fits], 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_with_taps_matches_eager(tiny_model_factory):
    from pellucid import LLM
    from tests.tracing.conftest import NUM_LAYERS

    path = tiny_model_factory("llama", num_hidden_layers=NUM_LAYERS)
    prompts = random_prompts(8, [9, 17, 12, 30, 5])
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(8))

    def plans() -> list[TracePlan | None]:
        return [TracePlan([Save(site="model.layers.1", name="h")]),
                TracePlan([Add(site="model.layers.1", value=vector), Save(site="model.layers.2", name="h")]),
                None,
                TracePlan([Scale(site="model.layers.0.mlp", factor=0.5), Save(site="model.norm", name="h")]),
                TracePlan([Save(site="model.layers.1", name="h", phase="generated")])]

    results = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", enforce_eager=eager, num_kv_blocks=256)
        results[eager] = run(llm, prompts, plans(), 8)
        if not eager:
            graphs = llm.engine.runner.cuda_graphs
            assert graphs is not None and graphs.num_tap_replays > 0
        del llm
    assert_same(results[False], results[True], exact=False)
