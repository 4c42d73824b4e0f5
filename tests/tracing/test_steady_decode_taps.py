"""Steady decode steps reuse the last step's tap state until some request's ops change (taps.py
`_DecodeLayout`): edits and saves that start, stop or alternate in the middle of decoding must still
match the per-request path (the reference) exactly, eager and through the graph path's arithmetic."""
from __future__ import annotations

import pytest
import torch

from pellucid.tracing import Add, Save, Scale, Set, TracePlan, Zero
from tests.tracing.conftest import random_prompts
from tests.tracing.test_taps import HIDDEN, assert_same, install_graph_stand_in, per_request_only, run

MAX_TOKENS = 12


def changing_plans(seed: int, prompt_lens: list[int]) -> list[TracePlan | None]:
    """Per request: ops whose selection begins, ends or alternates during the decode steps."""
    g = torch.Generator().manual_seed(seed)
    vec = lambda: torch.randn(HIDDEN, generator=g)  # noqa: E731
    shared = vec()          # one steering vector shared by several requests (one value table row)
    plans: list[TracePlan | None] = []
    for i, n in enumerate(prompt_lens):
        site = f"model.layers.{i % 3}"
        mid = n + int(torch.randint(1, MAX_TOKENS - 2, (1,), generator=g))
        kind = i % 6
        if kind == 0:       # a steering vector switched on mid-decode, every position saved
            ops = [Add(site=site, value=shared, positions={"start": mid}), Save(site=site, name="a")]
        elif kind == 1:     # switched off mid-decode; saves of every third position before it
            ops = [Save(site=site, name="a", positions=slice(0, None, 3)),
                   Add(site=site, value=shared, positions={"stop": mid})]
        elif kind == 2:     # a value with one row per selected position (changes every step)
            ops = [Set(site=site, value=torch.randn(3, HIDDEN, generator=g), positions=[n, mid, mid + 1]),
                   Save(site=site, name="a", positions={"start": mid - 1})]
        elif kind == 3:     # scale then zero on later positions, saves in between edits' reach
            ops = [Save(site=site, point="input", name="a", positions=[mid, mid + 2]),
                   Scale(site=site, point="input", factor=float(torch.rand(1, generator=g)) + 0.5,
                         positions={"start": n + 1, "stop": mid + 1}),
                   Zero(site=site, point="input", positions=[mid + 1])]
        elif kind == 4:
            plans.append(None)      # untraced, in the same batch
            continue
        else:               # the shared vector on every position (a steady step from the first decode)
            ops = [Add(site=site, value=shared), Save(site=site, name="a", positions={"start": mid})]
        plans.append(TracePlan(ops))
    return plans


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_steps_with_changing_ops_equal_the_per_request_path(make_llm, monkeypatch, seed):
    llm = make_llm("llama")
    lens = torch.randint(4, 12, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(seed + 20, lens)
    tapped = run(llm, prompts, changing_plans(seed, lens), MAX_TOKENS)
    per_request_only(monkeypatch)
    reference = run(llm, prompts, changing_plans(seed, lens), MAX_TOKENS)
    assert_same(tapped, reference)


def test_graph_path_with_changing_ops_equals_the_eager_tap_path(make_llm, monkeypatch):
    llm = make_llm("llama")
    lens = [5, 9, 7, 11, 6, 8]
    prompts = random_prompts(31, lens)
    eager = run(llm, prompts, changing_plans(3, lens), MAX_TOKENS)
    stand_in = install_graph_stand_in(llm, monkeypatch)
    graphed = run(llm, prompts, changing_plans(3, lens), MAX_TOKENS)
    assert sum(1 for key in stand_in.replays if key) >= MAX_TOKENS - 2, "decode steps did not replay with taps"
    assert_same(graphed, eager)
