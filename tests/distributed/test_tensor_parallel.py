"""Tensor parallelism at TP=2 on the CPU (gloo): generation, sampling, logprobs and traces equal TP=1 and
transformers, for a model with tied embeddings and q/k norms (Qwen3) and one with fewer KV heads than ranks
and a vocabulary that does not split evenly (Llama, 1 KV head, 509 tokens)."""
from __future__ import annotations

import pytest
import torch

from pellucid import LLM, SamplingParams, StructuredOutputsParams
from pellucid.tracing import Add, Apply, Save, Scale, TracePlan
from tests.reference import hf_forward, random_prompts, relative_error

TOLERANCE = 1e-4
# Small budgets so that prompts are chunked, batches mix prefill and decode, and requests get preempted
# (recomputed); the same schedule at TP=1 and TP=2.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=10,
              max_num_seqs=4)
MODELS = {"qwen3": dict(arch="qwen3", num_hidden_layers=2),
          "llama-kv1": dict(arch="llama", num_hidden_layers=2, num_key_value_heads=1, vocab_size=509, seed=3)}


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tiny_model_factory):
    """(model dir, TP=1 engine in this process, TP=2 engine: its core and rank 1 in two processes)."""
    spec = dict(MODELS[request.param])
    model = tiny_model_factory(spec.pop("arch"), **spec)
    tp1 = LLM(model, **ENGINE)
    tp2 = LLM(model, tensor_parallel_size=2, **ENGINE)
    yield request.param, model, tp1, tp2
    tp2.shutdown()


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_generation_equals_tp1(engines):
    """Greedy (float32) identical; seeded sampling with top-k/top-p and penalties identical; logprobs and
    prompt logprobs within 1e-4; min_tokens bans EOS on every rank; structured outputs held to their grammar on
    every rank; under chunking and preemption."""
    name, _, tp1, tp2 = engines
    vocab = 500
    prompts = random_prompts(7, [37, 5, 22, 41, 12, 3], vocab=vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=s, max_tokens=10, min_tokens=4,
                             repetition_penalty=1.3, presence_penalty=0.2) for s in range(len(prompts))]
    structured = [SamplingParams(temperature=0.8, seed=s, max_tokens=14, structured_outputs=StructuredOutputsParams(
        regex=r"[a-z]{2,5}( [0-9]{1,3}){1,4}")) for s in range(len(prompts))]
    for params in (greedy, seeded, structured):
        ref = tp1.generate(prompts, params, use_tqdm=False)
        out = tp2.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref], name
        if params is greedy:
            for r, o in zip(ref, out):
                _assert_close_logprobs(r.outputs[0].logprobs, o.outputs[0].logprobs)
                _assert_close_logprobs(r.prompt_logprobs[1:], o.prompt_logprobs[1:])
    assert tp2.client.latest_stats.num_preemptions > 0       # the budget did preempt (and recompute)


def _assert_close_logprobs(expected: list[dict], actual: list[dict]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(expected, actual):
        if a is None:
            assert b is None
            continue
        assert a.keys() == b.keys()
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) <= TOLERANCE * max(1.0, abs(a[token].logprob))


def _trace_ops(layers: int, qk_norm: bool) -> list:
    """Saves at every kind of site: sharded by heads (q/k/v, attention, q/k norms), by MLP columns (act_fn,
    down_proj.input), by vocabulary (logits), and whole (embedding, o_proj and down_proj outputs, norm)."""
    sites = ["model.embed_tokens", "model.norm", "logits"]
    for i in range(layers):
        p = f"model.layers.{i}"
        sites += [f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj", f"{p}.self_attn.attn",
                  f"{p}.self_attn.o_proj", f"{p}.mlp.act_fn", f"{p}.mlp.down_proj", p]
        if qk_norm:
            sites += [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
    ops = [Save(site=s, name=s) for s in sites]
    ops += [Save(site="model.layers.0.self_attn.o_proj", point="input", name="o_proj.input"),
            Save(site="model.layers.1.mlp.down_proj", point="input", name="down_proj.input")]
    return ops


def _edits(hidden: int, heads_dim: int, intermediate: int, seed: int) -> list:
    """Edits of sharded sites: each rank must get its own part of the edited value."""
    g = torch.Generator().manual_seed(seed)
    return [Add(site="model.layers.1.self_attn.q_proj", value=torch.randn(heads_dim, generator=g)),
            Scale(site="model.layers.0.mlp.act_fn", factor=torch.rand(intermediate, generator=g) * 2),
            Add(site="model.layers.1.self_attn.o_proj", point="input", value=torch.randn(heads_dim, generator=g),
                positions={"start": 2})]


def _fail_on_generated_rows(rows: torch.Tensor) -> torch.Tensor:
    """An `apply` function (module-level: the ops travel to the workers) that fails on a decode step."""
    if rows.shape[0] == 1:
        raise RuntimeError("generated rows are refused")
    return rows * 1.5


def test_traces_and_edits_equal_tp1_and_transformers(engines):
    """Saved values of sharded sites are the full tensors (gathered), equal to TP=1 and, for the q/k/v
    projections, to transformers' modules; edits of sharded sites change generation exactly as at TP=1; a
    failing function fails its own request only."""
    name, model_dir, tp1, tp2 = engines
    cfg = tp1.info
    hf = _hf(model_dir)
    qk_norm = name == "qwen3"
    ops = _trace_ops(2, qk_norm)
    heads_dim = hf.config.num_attention_heads * hf.config.head_dim
    edits = _edits(cfg.hidden_size, heads_dim, hf.config.intermediate_size, seed=1)
    prompts = random_prompts(11, [19, 6, 8], vocab=500)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # The third request's function fails at a sharded site, on every rank: that request fails alone.
    failing = [Apply(site="model.layers.1.self_attn.k_proj", fn=_fail_on_generated_rows)]
    extras = [{"trace": TracePlan(ops)}, {"trace": TracePlan(ops + edits)}, {"trace": TracePlan(failing)}]
    ref = tp1.generate(prompts, params, use_tqdm=False, extras=extras)
    out = tp2.generate(prompts, params, use_tqdm=False, extras=extras)
    assert "generated rows are refused" in out[2].error and ref[2].error == out[2].error
    for r, o in zip(ref[:2], out[:2]):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert set(o.extras["saves"]) == set(r.extras["saves"])
        for key, value in r.extras["saves"].items():
            got = o.extras["saves"][key]
            assert got.shape == value.shape, key
            assert relative_error(got, value) <= TOLERANCE, key
    # The unedited request's projections against transformers' own modules.
    saves = out[0].extras["saves"]
    sequence = prompts[0] + out[0].outputs[0].token_ids[:-1]
    captured = {}
    hooks = [(getattr(hf.model.layers[0].self_attn, proj), lambda _m, _a, y, proj=proj: captured.update({proj: y[0]}))
             for proj in ("q_proj", "k_proj", "v_proj")]
    reference = hf_forward(hf, sequence, hooks)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert relative_error(saves[f"model.layers.0.self_attn.{proj}"], captured[proj]) <= TOLERANCE
    assert relative_error(saves["logits"], reference["logits"]) <= TOLERANCE


def test_mixture_of_experts_equals_tp1(tiny_model_factory, tmp_path):
    """Experts sharded by intermediate columns (the fused 3D layout in layer 0, per-expert tensors in layer
    1), a sharded shared expert, the router whole: generation and the MoE sites equal TP=1."""
    from tests.models.helpers import write_fused_expert_layout
    model = str(tmp_path / "qwen2-moe")
    write_fused_expert_layout(tiny_model_factory("qwen2-moe", num_hidden_layers=2), model, layers=[0])
    tp1 = LLM(model, **ENGINE)
    tp2 = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        sites = [f"model.layers.{i}.mlp.{s}" for i in (0, 1)
                 for s in ("experts", "gate", "routing", "shared_expert.up_proj", "shared_expert")]
        ops = [Save(site=s, name=s) for s in sites] + [Save(site="model.layers.1.mlp.shared_expert.down_proj",
                                                            point="input", name="shared.down_proj.input")]
        prompts = random_prompts(13, [15, 30, 4], vocab=500)
        for params in (SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=8, ignore_eos=True)):
            extras = [{"trace": TracePlan(ops)}] * len(prompts)
            ref = tp1.generate(prompts, params, use_tqdm=False, extras=extras)
            out = tp2.generate(prompts, params, use_tqdm=False, extras=extras)
            for r, o in zip(ref, out):
                assert o.outputs[0].token_ids == r.outputs[0].token_ids
                for key, value in r.extras["saves"].items():
                    assert relative_error(o.extras["saves"][key], value) <= TOLERANCE, key
    finally:
        tp2.shutdown()


def test_embeddings_equal_tp1_and_transformers(engines):
    """Embedding requests under TP=2 with chunking and preemption: last-token and mean pooling."""
    from transformers import AutoModel

    from pellucid import PoolingParams
    from pellucid.pooling.embedder import EMBED_SAMPLING, Embedder

    _, model_dir, tp1, tp2 = engines
    backbone = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(17, [40, 3, 25, 11], vocab=500)
    ref = tp1.embed(prompts, use_tqdm=False)
    out = tp2.embed(prompts, use_tqdm=False)
    for ids, r, o in zip(prompts, ref, out):
        got = torch.tensor(o.outputs.embedding)
        assert relative_error(got, torch.tensor(r.outputs.embedding)) <= TOLERANCE
        with torch.no_grad():
            last = backbone(torch.tensor([ids])).last_hidden_state[0, -1]
        assert relative_error(got, torch.nn.functional.normalize(last, dim=0)) <= TOLERANCE
    # Mean pooling reads every prompt position, across the chunks and recomputes of this small engine.
    mean = Embedder.for_engine(tp2.info, {"pooling_type": "mean"})
    outs = tp2.generate(prompts, EMBED_SAMPLING, use_tqdm=False, extras=[mean.extras()] * len(prompts))
    for ids, got in zip(prompts, mean.embeddings(outs, PoolingParams())):
        with torch.no_grad():
            average = backbone(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
        assert relative_error(got, torch.nn.functional.normalize(average, dim=0)) <= TOLERANCE
