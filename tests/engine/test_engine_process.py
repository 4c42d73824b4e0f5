"""The engine core in its own process gives exactly what the in-process engine gives: greedy and seeded
tokens, text, logprobs, n > 1, stop strings, tracing saves and extraction files, on random prompts."""
from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from pellucid.engine.async_llm import AsyncLLM
from pellucid.engine.core_client import EngineStartupError
from pellucid.extraction.writer import read_manifest
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from pellucid.tracing import Add, Save, TracePlan

ENGINE_KWARGS = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def inproc(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def mp(model_dir):
    llm = LLM(model_dir, engine_process=True, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _stop_strings(llm: LLM, prompts: list[list[int]]) -> list[str]:
    """Stop strings the greedy continuations of `prompts` contain a few tokens in (one from each)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(len(t) > 12 for t in texts), f"the tiny model decoded too little text for a stop string: {texts}"
    return [texts[0][6:9], texts[-1][8:10]]


def _describe(out) -> tuple:
    """Everything of an output but logprob values (compared by _assert_same within float rounding)."""
    completions = tuple(
        (c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
         None if c.logprobs is None else tuple(tuple(sorted((t, lp.rank, lp.decoded_token) for t, lp in pos.items()))
                                               for pos in c.logprobs))
        for c in out.outputs)
    prompt_lps = None if out.prompt_logprobs is None else tuple(
        None if pos is None else tuple(sorted((t, lp.rank) for t, lp in pos.items())) for pos in out.prompt_logprobs)
    return out.prompt_token_ids, completions, prompt_lps, out.error


def _logprob_values(out) -> list[float]:
    values = [lp.logprob for c in out.outputs for pos in (c.logprobs or []) for _, lp in sorted(pos.items())]
    values += [lp.logprob for pos in (out.prompt_logprobs or []) if pos for _, lp in sorted(pos.items())]
    return values


def _assert_same(got: list, want: list) -> None:
    """Identical tokens, text, ends, logprob ranks and alternatives; logprob values within float32 rounding
    (an engine in another process may batch its first steps differently, and float sums then round
    differently)."""
    assert [_describe(o) for o in got] == [_describe(o) for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(_logprob_values(a)), torch.tensor(_logprob_values(b)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generate_equals_in_process(inproc, mp, seed):
    prompts = _prompts(seed, 6)
    stops = _stop_strings(inproc, prompts[2:4])
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, n=3),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stops),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stops, include_stop_str_in_output=True),
        SamplingParams(temperature=0.7, seed=seed + 5, max_tokens=8, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=seed + 9, max_tokens=12, repetition_penalty=1.3, n=2),
    ]
    want = inproc.generate(prompts, params, use_tqdm=False)
    got = mp.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want)
    assert any(c.finish_reason == "stop" for o in want[2:4] for c in o.outputs)    # the stop strings did stop


def _trace(llm: LLM, prompts: list[list[int]], vector: torch.Tensor, stop: list[str]):
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop)]
    with llm.trace() as tr:
        with tr.invoke(prompts[0], params[0]):
            h = tr.model.layers[1].output.save()
            tr.model.layers[0].mlp.output.add(vector, positions="last")
            logits = tr.logits.save(positions={"start": -3})
        with tr.invoke(prompts[1], params[1]):
            h2 = tr.model.layers[0].output.save()
            tokens = tr.tokens.save()
    return [h[0], logits[0], h2[0], tokens[0]], [h.positions(0), h2.positions(0)], tr.outputs


@pytest.mark.parametrize("seed", [0, 1])
def test_trace_saves_and_edits_equal_in_process(inproc, mp, seed):
    prompts = _prompts(seed + 20, 2)
    vector = torch.randn(inproc.info.hidden_size, generator=torch.Generator().manual_seed(seed))
    stop = _stop_strings(inproc, prompts[1:])
    want, want_positions, want_outs = _trace(inproc, prompts, vector, stop)
    got, got_positions, got_outs = _trace(mp, prompts, vector, stop)
    assert got_positions == want_positions
    # The engine in another process may form its first batches differently (requests reach it while it
    # steps), so float sums may round differently: equal to float32 rounding, tokens exactly.
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    _assert_same(got_outs, want_outs)
    # A stop string ends the second request: its saves end where its output does.
    stopped = want_outs[1].outputs[0]
    assert stopped.finish_reason == "stop"
    assert want_positions[1][-1] == len(want_outs[1].prompt_token_ids) + len(stopped.token_ids) - 2


def test_extraction_files_equal_in_process(inproc, mp, tmp_path):
    rng = random.Random(3)
    data = [{"id": f"s{i}", "prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randint(4, 30))]}
            for i in range(9)]
    outs = {}
    for name, llm in (("inproc", inproc), ("mp", mp)):
        outs[name] = str(tmp_path / name)
        summary = llm.extract_hidden_states(data, layers=[0, 1, -1], output_dir=outs[name], shard_size=2,
                                            progress=False)
        assert summary.num_samples == len(data)
    manifests = {name: {e["id"]: e for e in read_manifest(path)} for name, path in outs.items()}
    assert set(manifests["mp"]) == set(manifests["inproc"]) == {d["id"] for d in data}
    for sample_id, entry in manifests["inproc"].items():
        other = manifests["mp"][sample_id]
        a = load_file(os.path.join(outs["inproc"], entry["file"]))
        b = load_file(os.path.join(outs["mp"], other["file"]))
        for key in ("input_ids", "prompt_length"):
            assert torch.equal(a[entry["prefix"] + key], b[other["prefix"] + key])
        torch.testing.assert_close(a[entry["prefix"] + "hidden_states"], b[other["prefix"] + "hidden_states"],
                                   rtol=1e-5, atol=1e-5)


def test_async_engine_in_a_thread_and_in_a_process_agree(model_dir):
    prompts = _prompts(7, 5)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=14, ignore_eos=True, n=2, logprobs=1)

    async def run(llm: AsyncLLM):
        async def one(prompt):
            final = None
            async for out in llm.generate(prompt, params):
                final = out
            return final
        return await asyncio.gather(*(one(p) for p in prompts))

    results = []
    for engine_process in (False, True):
        llm = AsyncLLM(model_dir, engine_process=engine_process, **ENGINE_KWARGS)
        try:
            results.append(asyncio.run(run(llm)))
        finally:
            llm.shutdown()
    _assert_same(results[1], results[0])


def test_bad_model_directory_is_a_clear_startup_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}')
    with pytest.raises(EngineStartupError, match="NoSuchForCausalLM"):
        AsyncLLM(str(tmp_path), **ENGINE_KWARGS)


def test_apply_ops_with_lambdas_stay_in_process(mp):
    """A Python callable that cannot be pickled cannot reach an engine in another process: a clear error
    before anything is sent, never a silent no-op."""
    with pytest.raises(ValueError, match="cannot be sent to the engine process.*module-level function"):
        with mp.trace(_prompts(1, 1)[0]) as tr:
            tr.model.layers[0].output.apply(lambda rows: rows * 2)
    assert not mp.has_unfinished_requests()
    assert mp.generate(_prompts(2, 1), SamplingParams(max_tokens=3), use_tqdm=False)[0].error is None


def test_a_dropped_engine_is_freed_at_once(model_dir):
    """No reference cycle holds an engine core: dropping the LLM frees its model and KV cache right away
    (on a GPU, several engines made one after another in a process each get the memory back)."""
    import gc
    import weakref

    llm = LLM(model_dir, **ENGINE_KWARGS)
    llm.generate(_prompts(5, 2), SamplingParams(max_tokens=4), use_tqdm=False,
                 extras=[{"trace": TracePlan([Save(site="model.layers.0", name="h")])}, None])
    core, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_caches[0])
    gc.disable()
    try:
        del llm
        assert core() is None and kv() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("engine_process", [False, True])
def test_prompt_logprobs_survive_chunked_prefill(model_dir, engine_process):
    """Every prompt position is scored, however many steps the prompt's prefill takes (chunks that sample
    nothing report their positions too), and the values equal an unchunked prefill's."""
    prompts = _prompts(11, 3)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    whole = LLM(model_dir, **ENGINE_KWARGS).generate(prompts, params, use_tqdm=False)
    chunked_llm = LLM(model_dir, engine_process=engine_process, max_num_batched_tokens=8, **ENGINE_KWARGS)
    try:
        chunked = chunked_llm.generate(prompts, params, use_tqdm=False)
    finally:
        chunked_llm.shutdown()
    for a, b in zip(chunked, whole):
        assert a.prompt_logprobs[0] is None and all(p is not None for p in a.prompt_logprobs[1:])
    _assert_same(chunked, whole)
