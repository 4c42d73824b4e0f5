"""Requests are independent: a random mix of every kind of request (greedy with logprobs, seeded sampling with
penalties, n > 1, traces that save and edit, router bans, structured outputs, token constraints), run together
on a mixture-of-experts engine squeezed into chunked prefill, preemption and prefix-cache hits, gives each
request exactly what it gets alone on a roomy engine: the same tokens, logprobs and saves (float32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from pellucid import LLM, SamplingParams, StructuredOutputsParams
from pellucid.tracing import Add, Apply, Save, Scale, TracePlan
from tests.reference import relative_error

VOCAB = 500
NUM_EXPERTS = 8
SQUEEZED = dict(max_num_batched_tokens=24, num_kv_blocks=16, max_num_seqs=5, block_size=8)
ROOMY = dict(num_kv_blocks=256, max_num_seqs=8)


def _halve_last_row(rows: torch.Tensor) -> torch.Tensor:
    return rows * 0.5


def _request(rng: random.Random, index: int, prefix: list[int]) -> tuple[list[int], SamplingParams, dict | None]:
    """A random request of one of eight kinds; half of the prompts start with the shared prefix."""
    length = rng.randint(1, 40)
    tokens = [rng.randrange(3, VOCAB) for _ in range(length)]
    prompt = prefix + tokens if rng.random() < 0.5 else tokens
    max_tokens = rng.randint(1, 12)
    kind = index % 8
    extras = None
    if kind == 0:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    elif kind == 1:
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=index, max_tokens=max_tokens,
                                presence_penalty=0.5, repetition_penalty=1.2, ignore_eos=True)
    elif kind == 2:
        params = SamplingParams(temperature=1.0, n=2, seed=index, max_tokens=max_tokens, ignore_eos=True)
    elif kind == 3:
        max_tokens = max(max_tokens, 2)      # the edit selects generated positions: one at least
        plan = TracePlan([Save(site="model.layers.1", name="residual"),
                          Save(site="model.layers.0.mlp.routing", name="routing", phase="prompt"),
                          Scale(site="model.layers.0.mlp", factor=0.5, phase="generated")])
        params, extras = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), {"trace": plan}
    elif kind == 4:
        ban = torch.zeros(NUM_EXPERTS)
        ban[rng.randrange(NUM_EXPERTS)] = -1e4
        plan = TracePlan([Add(site="model.layers.1.mlp.gate", value=ban),
                          Save(site="model.layers.1.mlp.routing", name="routing")])
        params = SamplingParams(temperature=0.7, seed=index, max_tokens=max_tokens, ignore_eos=True)
        extras = {"trace": plan}
    elif kind == 5:
        params = SamplingParams(temperature=0.9, seed=index, max_tokens=max_tokens + 8,
                                structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,6}( [0-9]{1,3}){0,3}"))
    elif kind == 6:
        banned = rng.randrange(3, VOCAB)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min(3, max_tokens),
                                logit_bias={banned: -100.0, rng.randrange(3, VOCAB): 3.0},
                                stop_token_ids=[rng.randrange(3, VOCAB)])
    else:
        # Positions from 5 on: the request reads the prefix cache below its first traced position only.
        plan = TracePlan([Apply(site="model.layers.0", fn=_halve_last_row, positions="last"),
                          Save(site="logits", name="logits", positions={"start": -1}),
                          Save(site="model.layers.1.self_attn", name="attn", positions={"start": min(5, len(prompt) - 1)})])
        params, extras = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), {"trace": plan}
    return prompt, params, extras


def _assert_same(expected, got, what: str) -> None:
    assert got.prompt_token_ids == expected.prompt_token_ids, what
    assert len(got.outputs) == len(expected.outputs), what
    for e, g in zip(expected.outputs, got.outputs):
        assert g.token_ids == e.token_ids, what
        assert g.text == e.text and g.finish_reason == e.finish_reason, what
        for e_pos, g_pos in zip(e.logprobs or [], g.logprobs or []):
            assert set(g_pos) == set(e_pos), what
            for token, logprob in e_pos.items():
                assert abs(g_pos[token].logprob - logprob.logprob) <= 1e-4, what
    for e_pos, g_pos in zip((expected.prompt_logprobs or [])[1:], (got.prompt_logprobs or [])[1:]):
        for token, logprob in e_pos.items():
            assert abs(g_pos[token].logprob - logprob.logprob) <= 1e-4, what
    saves = (expected.extras or {}).get("saves") or {}
    assert set((got.extras or {}).get("saves") or {}) == set(saves), what
    for name, value in saves.items():
        assert got.extras["saves"][name].shape == value.shape, f"{what}: {name}"
        assert relative_error(got.extras["saves"][name], value) <= 1e-4, f"{what}: {name}"


@pytest.mark.parametrize("seed,async_scheduling", [(0, False), (1, True)])
def test_a_random_mix_of_requests_equals_each_request_alone(tiny_model_factory, seed, async_scheduling):
    """Seed 1 also steps ahead (the next step scheduled before this one's tokens are read back)."""
    model = tiny_model_factory("qwen3-moe", num_experts=NUM_EXPERTS, num_experts_per_tok=2, num_hidden_layers=2)
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(20)]
    requests = [_request(rng, i, prefix) for i in range(24)]
    rng.shuffle(requests)
    engine = dict(dtype="float32", device="cpu", max_model_len=128)
    squeezed = LLM(model, **engine, **SQUEEZED, async_scheduling=async_scheduling)
    together = squeezed.generate([{"prompt_token_ids": p} for p, _, _ in requests], [sp for _, sp, _ in requests],
                                 use_tqdm=False, extras=[ex for _, _, ex in requests])
    stats = squeezed.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
    assert stats.prefix_cache_hits > 0
    roomy = LLM(model, **engine, **ROOMY)
    for i, ((prompt, params, extras), got) in enumerate(zip(requests, together)):
        alone = roomy.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, extras=[extras])[0]
        _assert_same(alone, got, f"request {i} ({params}, {extras})")
