"""Tracing inside the engine: isolation between requests, prefix caching, chunking, preemption, errors."""
from __future__ import annotations

import pytest
import torch

from pellucid import SamplingParams
from pellucid.tracing import Add, Save, TraceError, TracePlan
from tests.tracing.conftest import NUM_LAYERS, TOLERANCE, hf_forward, random_prompts, relative_error


def test_saves_survive_later_in_place_kernels(make_llm, hf_model):
    """A fused add+norm that overwrites the residual in place (simulated by a pre-hook on the next
    layer's input norm) must not change what was saved: saves are copies, not views."""
    llm = make_llm("llama")
    model = llm.engine.runner.model

    def clobber(_module, args):
        args[0].mul_(-3.0).add_(1.0)     # in place, on the tensor that is layer 0's output
    handle = model.model.layers[1].input_layernorm.register_forward_pre_hook(clobber)
    try:
        prompt = random_prompts(3, [13])[0]
        with llm.trace([prompt]) as tr:
            out0 = tr.model.layers[0].output.save()
            in1 = tr.model.layers[1].input.save()
    finally:
        handle.remove()
    ref = hf_forward(hf_model("llama"), prompt)["layers"][0]
    assert relative_error(out0[0], ref) <= TOLERANCE
    assert relative_error(in1[0], ref) <= TOLERANCE


def test_multi_invoke_runs_every_invoke_with_its_own_ops_and_saves(make_llm):
    llm = make_llm("qwen3")
    prompts = random_prompts(11, [7, 19, 12])
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1))
    with llm.trace() as tr:
        everywhere = tr.model.layers[0].output.save()
        with tr.invoke(prompts[0]):
            a = tr.model.layers[1].output.save()
        with tr.invoke(prompts[1]):
            tr.model.layers[0].mlp.output.zero()
            b = tr.logits.save(positions="last")
        with tr.invoke(prompts[2]):
            tr.model.layers[1].output.add(vector)
            c = tr.model.layers[2].output.save()
    assert len(tr.outputs) == 3 and len(everywhere) == 3 and len(a) == len(b) == len(c) == 1
    assert [everywhere[i].shape[0] for i in range(3)] == [7, 19, 12]

    # Each invoke alone gives the same values: batching does not mix requests.
    with llm.trace([prompts[0]]) as tr:
        a_alone = tr.model.layers[1].output.save()
    with llm.trace([prompts[1]]) as tr:
        tr.model.layers[0].mlp.output.zero()
        b_alone = tr.logits.save(positions="last")
    with llm.trace([prompts[2]]) as tr:
        tr.model.layers[1].output.add(vector)
        c_alone = tr.model.layers[2].output.save()
    assert relative_error(a.value, a_alone.value) <= TOLERANCE
    assert b.value.shape == (1, 512) and relative_error(b.value, b_alone.value) <= TOLERANCE
    assert relative_error(c.value, c_alone.value) <= TOLERANCE
    # ... and the ablation really applied only to invoke 1.
    with llm.trace([prompts[1]]) as tr:
        b_clean = tr.logits.save(positions="last")
    assert relative_error(b.value, b_clean.value) > 1e-2


def test_prefix_caching_traced_requests_see_every_token_and_edited_blocks_are_not_published(make_llm, hf_model):
    llm = make_llm("llama", block_size=4, enable_prefix_caching=True)
    prompt, fresh, control = random_prompts(21, [22, 22, 22])
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 20   # the cache works

    with llm.trace([prompt]) as tr:             # cached prompt, traced: computes every position itself
        h = tr.model.layers[0].output.save()
    assert tr.outputs[0].num_cached_tokens == 0
    assert h[0].shape == (22, 64)
    assert relative_error(h[0], hf_forward(hf_model("llama"), prompt)["layers"][0]) <= TOLERANCE

    vector = torch.full((64,), 5.0)
    with llm.trace([fresh]) as tr:              # edited: its KV must not serve anyone else
        tr.model.layers[0].output.add(vector)
    later = llm.generate([fresh], plain, use_tqdm=False)[0]
    assert later.num_cached_tokens == 0
    with llm.trace([control]) as tr:            # saved only: its KV is the model's and is shared
        tr.model.layers[0].output.save()
    assert llm.generate([control], plain, use_tqdm=False)[0].num_cached_tokens == 20


@pytest.mark.parametrize("seed", [0, 1])
def test_traced_requests_read_the_prefix_cache_below_their_first_touched_position(make_llm, hf_model, seed):
    """Cached KV below the first position a trace touches is the model's: the trace reads it, and still
    sees (and edits) every position it selects; an edit there keeps its blocks out of the cache."""
    llm = make_llm("llama", block_size=4, enable_prefix_caching=True)
    prompt = random_prompts(60 + seed, [23])[0]
    first = int(torch.randint(5, 18, (1,), generator=torch.Generator().manual_seed(seed)))
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], plain, use_tqdm=False)                    # publishes 20 of the 23 tokens
    reference = hf_forward(hf_model("llama"), prompt)

    with llm.trace([prompt]) as tr:
        rows = tr.model.layers[1].output.save(positions={"start": first})
        last = tr.logits.save(positions="last")
    assert tr.outputs[0].num_cached_tokens == first // 4 * 4
    assert relative_error(rows[0], reference["layers"][1][first:]) <= TOLERANCE
    assert relative_error(last[0][0], reference["logits"][-1]) <= TOLERANCE

    with llm.trace([prompt]) as tr:                                   # only the last position: all 20 cached
        tr.model.layers[0].output.save(positions="last")
    assert tr.outputs[0].num_cached_tokens == 20

    other = prompt[:first] + random_prompts(70 + seed, [23 - first])[0]
    vector = torch.full((64,), 3.0)
    with llm.trace([other]) as tr:                                    # edits from `first` on, reads below it
        tr.model.layers[0].output.add(vector, positions={"start": first})
        edited = tr.logits.save(positions="last")
    assert tr.outputs[0].num_cached_tokens == first // 4 * 4
    with llm.trace([other]) as tr:                                    # the edit applied; nothing of it cached
        tr.model.layers[0].output.add(vector, positions={"start": first})
        again = tr.logits.save(positions="last")
    assert tr.outputs[0].num_cached_tokens == first // 4 * 4
    model = hf_model("llama")

    def add_from_first(_module, _args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        hidden[0, first:] += vector
    edited_hf = hf_forward(model, other, hooks=[(model.model.layers[0], add_from_first)])
    assert relative_error(edited[0][0], edited_hf["logits"][-1]) <= TOLERANCE
    assert relative_error(again[0][0], edited_hf["logits"][-1]) <= TOLERANCE
    clean = llm.generate([other], plain, use_tqdm=False)[0]
    assert clean.num_cached_tokens == first // 4 * 4


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_prefill_and_preemption_give_the_same_saves(make_llm, seed):
    prompts = random_prompts(seed + 40, [37, 29, 18, 33])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ops = [Save(site="model.layers.1", name="h"), Save(site="logits", positions={"start": -1}, name="logits"),
           Save(site="tokens", name="tokens")]

    def run(**engine_kwargs):
        llm = make_llm("qwen2", **engine_kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False, extras=[{"trace": TracePlan(ops)} for _ in prompts])
        return llm, outs

    _, reference = run()
    chunked_llm, chunked = run(max_num_batched_tokens=16)
    # 4 requests of ~45 tokens need ~48 blocks of 4; 20 blocks forces preemption and recompute.
    preempt_llm, preempted = run(block_size=4, num_kv_blocks=20, enable_prefix_caching=False)
    assert chunked_llm.engine.scheduler.num_preemptions == 0
    assert preempt_llm.engine.scheduler.num_preemptions > 0
    for ref, other in [(r, o) for r, o in zip(reference, chunked)] + [(r, o) for r, o in zip(reference, preempted)]:
        assert other.outputs[0].token_ids == ref.outputs[0].token_ids
        n = len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids) - 1
        assert other.extras["saves"]["h"].shape == (n, 64)
        assert other.extras["save_positions"]["h"] == list(range(n))
        assert relative_error(other.extras["saves"]["h"], ref.extras["saves"]["h"]) <= TOLERANCE
        assert relative_error(other.extras["saves"]["logits"], ref.extras["saves"]["logits"]) <= TOLERANCE
        assert other.extras["saves"]["tokens"].tolist() == ref.outputs[0].token_ids


def test_a_failing_op_fails_only_its_request(make_llm):
    llm = make_llm("llama")
    prompts = random_prompts(50, [9, 14, 11, 20])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    clean = llm.generate(prompts, params, use_tqdm=False)

    def explode(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom inside apply")

    def drop_last_unit(x: torch.Tensor) -> torch.Tensor:
        return x[:, :-1]

    with pytest.raises(TraceError) as info:
        with llm.trace() as tr:
            with tr.invoke(prompts[0], params):
                tr.model.layers[1].output.apply(drop_last_unit)        # returns the wrong shape
            with tr.invoke(prompts[1], params):
                good = tr.model.layers[1].output.save()
            with tr.invoke(prompts[2], params):
                tr.model.layers[0].mlp.output.apply(explode, phase="generated")   # fails at the first decode
            with tr.invoke(prompts[3], params):
                pass                                                    # untraced
    failures = info.value.failures
    assert sorted(failures) == [0, 2]
    assert "returned" in failures[0][0] and ", 63)" in failures[0][0]
    assert "boom inside apply" in failures[2][0] and "explode" in failures[2][1]   # the traceback
    outputs = info.value.outputs
    assert outputs[0].error and outputs[2].error and outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].token_ids == clean[1].outputs[0].token_ids
    assert outputs[3].outputs[0].token_ids == clean[3].outputs[0].token_ids
    assert good.value.shape == (14 + 4, 64)
    # The engine keeps serving and the failed requests' blocks were freed.
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in clean]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.block_pool.num_free_blocks == llm.engine.kv_manager.block_pool.num_usable_blocks
    # A value that cannot fit its site is refused before any request of the trace runs.
    with pytest.raises(ValueError, match=r"trace op 0 .*add value of shape \(63,\) does not fit"):
        with llm.trace() as tr:
            with tr.invoke(prompts[0], params):
                tr.model.layers[1].output.add(torch.ones(63))
            with tr.invoke(prompts[1], params):
                tr.model.layers[1].output.save()
    assert not llm.engine.has_unfinished_requests()


def test_logits_edit_steers_sampling_and_tokens_are_saved(make_llm):
    llm = make_llm("llama")
    prompts = random_prompts(60, [10, 10])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bias = torch.zeros(512)
    bias[77] = 1e4
    clean = llm.generate(prompts, params, use_tqdm=False)
    with llm.trace() as tr:
        with tr.invoke(prompts[0], params):
            tr.logits.add(bias, positions={"start": -1})
            tokens = tr.tokens.save()
            logits = tr.logits.save(positions={"start": -1})
        with tr.invoke(prompts[1], params):
            other = tr.tokens.save()
    assert tr.outputs[0].outputs[0].token_ids == [77] * 6
    assert tokens.value.tolist() == [77] * 6
    assert logits.value.argmax(-1).tolist() == [77] * 6
    assert tr.outputs[1].outputs[0].token_ids == clean[1].outputs[0].token_ids == other.value.tolist()


def test_activation_patching_across_two_traces(make_llm, hf_model):
    """Save a layer's output on one prompt and write it, position by position, into another."""
    llm = make_llm("mistral")
    source, target = random_prompts(70, [12, 12])
    with llm.trace([source]) as tr:
        h = tr.model.layers[1].output.save()
    with llm.trace([target]) as tr:
        tr.model.layers[1].output.set(h[0][:6], positions=slice(0, 6))
        patched = tr.logits.save()
    hf = hf_model("mistral")
    src = hf_forward(hf, source)["layers"][1]

    def patch(out):
        out = out.clone()
        out[:, :6] = src[:6]
        return out
    from tests.tracing.conftest import replace_output
    ref = hf_forward(hf, target, [(hf.model.layers[1], replace_output(patch))])["logits"]
    assert relative_error(patched[0], ref) <= TOLERANCE


def test_sites_lists_every_module_point_with_its_shape(make_llm):
    llm = make_llm("qwen3")
    sites = {s.name: s for s in llm.sites()}
    for i in range(NUM_LAYERS):
        assert sites[f"model.layers.{i}.output"].shape == (64,)
        assert sites[f"model.layers.{i}.self_attn.q_proj.output"].shape == (4 * 16,)
        assert sites[f"model.layers.{i}.self_attn.k_proj.output"].shape == (2 * 16,)
        assert sites[f"model.layers.{i}.mlp.gate_proj.output"].shape == (128,)
    assert sites["logits.output"].shape == (512,) and sites["tokens.output"].shape == ()
    assert sites["model.embed_tokens.input"].dtype == torch.int64
    assert not any("rotary_emb" in name for name in sites)     # shared by every layer: not a site
    prompt = random_prompts(80, [6])[0]
    with llm.trace([prompt]) as tr:
        handles = {name: tr._point(s.module, s.point).save() for name, s in sites.items()
                   if s.module not in ("logits", "tokens")}
    for name, handle in handles.items():
        assert tuple(handle[0].shape) == (6, *sites[name].shape), name


def test_bad_traces_fail_at_once_with_clear_messages(make_llm):
    llm = make_llm("llama")
    with pytest.raises(AttributeError, match="did you mean model.layers.0.mlp"):
        with llm.trace(["hello"]) as tr:
            tr.model.layers[0].mpl
    with pytest.raises(AttributeError, match="rotary"):
        with llm.trace(["hello"]) as tr:
            tr.model.rotary_emb.output.save()
    with pytest.raises(AttributeError, match="model.norm.output"):
        with llm.trace(["hello"]) as tr:
            tr.lm_head.input.save()
    with pytest.raises(ValueError, match="beyond what this request computes"):
        with llm.trace(["hello"]) as tr:
            tr.model.layers[0].output.save(positions=[400])
    with pytest.raises(ValueError, match="selects no position"):
        with llm.trace(["hello"]) as tr:                 # max_tokens=1: no generated token is fed back
            tr.model.layers[0].output.save(phase="generated")
    with pytest.raises(ValueError, match="n=1"):
        llm.generate(["hello"], SamplingParams(n=2), use_tqdm=False,
                     extras=[{"trace": TracePlan([Save(site="model.norm")])}])
    with pytest.raises(ValueError, match="unknown site 'model.layers.9.output'; did you mean model.layers.2.output"):
        llm.generate(["hello"], use_tqdm=False, extras=[{"trace": TracePlan([Add(site="model.layers.9",
                                                                                  value=torch.ones(64))])}])
    assert not llm.engine.has_unfinished_requests()
    # lm_head.output is the logits site.
    with llm.trace(["hello there"]) as tr:
        a = tr.lm_head.output.save()
        b = tr.logits.save()
    assert torch.equal(a[0], b[0])
