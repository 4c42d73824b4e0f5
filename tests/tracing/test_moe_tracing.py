"""Router sites of mixture-of-experts models against transformers with forward hooks: saved router logits and
routing decisions, a forced or banned expert (an edit of the router logits), an ablated expert (a per-expert
scale of the routing decision), each for the traced request only."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pellucid import SamplingParams
from pellucid.tracing import Add, Save, Scale, TracePlan, op_from_json
from tests.tracing.conftest import NUM_LAYERS, TOLERANCE, hf_forward, random_prompts, relative_error

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MOE_ARCHS = ["qwen3-moe", "mixtral", "qwen2-moe"]


def _capture_router(hf: torch.nn.Module, layer: int, store: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    def hook(_module: Any, _args: Any, out: Any) -> None:
        logits, scores, indices = out
        store["logits"] = logits.detach().clone()
        store["dense"] = torch.zeros_like(logits, dtype=scores.dtype).scatter_(1, indices, scores)
    return hf.model.layers[layer].mlp.gate, hook


def _edited_router(hf: torch.nn.Module, layer: int, change: torch.Tensor) -> tuple[torch.nn.Module, Any]:
    """transformers' router with `change` added to its logits: the routing is recomputed as its forward does."""
    router = hf.model.layers[layer].mlp.gate

    def hook(_module: Any, _args: Any, out: Any) -> Any:
        logits = out[0] + change
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", True):      # Mixtral's router always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(out[1].dtype), ids
    return router, hook


def _ablated_expert(hf: torch.nn.Module, layer: int, expert: int) -> tuple[torch.nn.Module, Any]:
    """A pre-hook on transformers' experts: expert `expert` weighs 0 wherever it was chosen."""
    def pre_hook(_module: Any, args: Any) -> Any:
        hidden, ids, weights = args
        return hidden, ids, torch.where(ids == expert, torch.zeros_like(weights), weights)
    return hf.model.layers[layer].mlp.experts, pre_hook


def _hf_with(hf: torch.nn.Module, sequence: list[int], hook: tuple[torch.nn.Module, Any], pre: bool = False):
    module, fn = hook
    handle = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
    try:
        return hf_forward(hf, sequence)
    finally:
        handle.remove()


def _hf_greedy_with(hf: torch.nn.Module, prompt: list[int], hook: tuple[torch.nn.Module, Any], pre: bool,
                    steps: int) -> list[int]:
    module, fn = hook
    handle = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    finally:
        handle.remove()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_saves_equal_the_hf_gate_output_in_a_mixed_batch(make_llm, hf_model, arch):
    llm = make_llm(arch)
    hf = hf_model(arch)
    seed = MOE_ARCHS.index(arch)
    traced = random_prompts(seed, [9, 23])
    untraced = random_prompts(seed + 100, [14, 31])
    layers = [i for i, layer in enumerate(llm.engine.runner.model.model.layers) if hasattr(layer.mlp, "routing")]
    ops = [op for i in layers for op in (Save(site=f"model.layers.{i}.mlp.gate", name=f"logits{i}"),
                                         Save(site=f"model.layers.{i}.mlp.routing", name=f"routing{i}"))]
    prompts = [untraced[0], traced[0], untraced[1], traced[1]]
    extras = [None, {"trace": TracePlan(ops)}, None, {"trace": TracePlan(ops)}]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, extras=extras)
    alone = llm.generate(untraced, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outputs[i].outputs[0].token_ids for i in (0, 2)]
    num_experts = hf.config.num_experts
    for index in (1, 3):
        out = outputs[index]
        sequence = prompts[index] + out.outputs[0].token_ids[:-1]
        saves = out.extras["saves"]
        for i in layers:
            seen: dict[str, Any] = {}
            _hf_with(hf, sequence, _capture_router(hf, i, seen))
            assert saves[f"logits{i}"].shape == (len(sequence), num_experts)
            assert relative_error(saves[f"logits{i}"], seen["logits"]) <= TOLERANCE
            assert saves[f"routing{i}"].shape == (len(sequence), num_experts)
            assert relative_error(saves[f"routing{i}"], seen["dense"]) <= TOLERANCE
            assert ((saves[f"routing{i}"] != 0).sum(-1) == hf.config.num_experts_per_tok).all()


@pytest.mark.parametrize("arch,force", [("qwen3-moe", True), ("qwen3-moe", False), ("mixtral", True),
                                        ("qwen2-moe", False)])
def test_forced_or_banned_expert_equals_hf_and_leaves_batch_mates_alone(make_llm, hf_model, arch, force):
    """`add` on the router logits: +1e4 at an expert forces it for every token, -1e4 bans it."""
    llm = make_llm(arch)
    hf = hf_model(arch)
    seed = 10 + MOE_ARCHS.index(arch) + 2 * force
    prompt, *others = random_prompts(seed, [13, 8, 19])
    layer, expert = 1 if arch != "qwen2-moe" else 0, 3
    change = torch.zeros(hf.config.num_experts)
    change[expert] = 1e4 if force else -1e4
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    plan = TracePlan([Add(site=f"model.layers.{layer}.mlp.gate", value=change),
                      Save(site=f"model.layers.{layer}.mlp.routing", name="routing"),
                      Save(site="logits", name="logits")])
    outs = llm.generate([others[0], prompt, others[1]], params, use_tqdm=False,
                        extras=[None, {"trace": plan}, None])
    tokens = outs[1].outputs[0].token_ids
    hook = _edited_router(hf, layer, change)
    assert tokens == _hf_greedy_with(hf, prompt, hook, False, 7)
    ref = _hf_with(hf, prompt + tokens[:-1], hook)
    assert relative_error(outs[1].extras["saves"]["logits"], ref["logits"]) <= TOLERANCE
    chosen = outs[1].extras["saves"]["routing"][:, expert] != 0
    assert bool(chosen.all()) if force else not bool(chosen.any())
    assert relative_error(outs[1].extras["saves"]["logits"], hf_forward(hf, prompt + tokens[:-1])["logits"]) > 1e-3
    alone = llm.generate(others, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_ablated_expert_equals_hf_and_leaves_batch_mates_alone(make_llm, hf_model, arch, seed):
    """`scale` of the routing decision by a per-expert factor with 0 at one expert: that expert's
    contribution is removed, the other chosen experts keep their weights."""
    llm = make_llm(arch)
    hf = hf_model(arch)
    prompt, *others = random_prompts(20 + seed, [17, 11, 6])
    layer = NUM_LAYERS - 1 if arch != "qwen2-moe" else 0
    routing = {}
    _hf_with(hf, prompt, _capture_router(hf, layer, routing))
    expert = int((routing["dense"] != 0).sum(0).argmax())        # the expert most tokens chose
    mask = torch.ones(hf.config.num_experts)
    mask[expert] = 0.0
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with llm.trace() as tr:
        with tr.invoke(others[0], params):
            pass
        with tr.invoke(prompt, params):
            tr.model.layers[layer].mlp.routing.output.scale(mask)
            saved = tr.model.layers[layer].mlp.routing.output.save()
            logits = tr.logits.save()
        with tr.invoke(others[1], params):
            pass
    outs = tr.outputs
    tokens = outs[1].outputs[0].token_ids
    hook = _ablated_expert(hf, layer, expert)
    assert tokens == _hf_greedy_with(hf, prompt, hook, True, 6)
    ref = _hf_with(hf, prompt + tokens[:-1], hook, pre=True)
    assert relative_error(logits.value, ref["logits"]) <= TOLERANCE
    assert not bool((saved.value[:, expert] != 0).any())
    alone = llm.generate(others, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]


def test_routing_site_refuses_edits_that_would_choose_other_experts(make_llm):
    llm = make_llm("qwen3-moe")
    with pytest.raises(ValueError, match=r"mlp\.routing\.output accepts save and the edits scale, zero, apply, not add"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                     extras=[{"trace": TracePlan([Add(site="model.layers.0.mlp.routing", value=torch.ones(8))])}])
    with pytest.raises(ValueError, match="per-token shape is \\(8,\\)"):      # refused before anything runs
        with llm.trace([[5, 6, 7]]) as tr:
            tr.model.layers[0].mlp.routing.output.scale(torch.ones(5))


def test_per_unit_scale_travels_as_json():
    op = op_from_json({"op": "scale", "site": "model.layers.0.mlp.routing", "factor": [1.0, 0.0, 1.0]})
    assert isinstance(op, Scale) and torch.equal(op.factor, torch.tensor([1.0, 0.0, 1.0]))
    again = op_from_json(op.to_json())
    assert torch.equal(again.factor, op.factor)
    assert op_from_json({"op": "scale", "site": "model.layers.0", "factor": 0.5}).factor == 0.5
