"""The final RequestOutput is the only owner of a request's feature outputs (saves, positions, errors).

Finished requests stay referenced by engine internals after their last step (the persistent batch rows,
until a later batch reuses them); saves left in them would outlive the outputs. Every check here runs
with the cyclic GC off: the saves must die by reference counting, as soon as the application drops them."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref
from typing import Iterator

import pytest
import torch

from pellucid import SamplingParams
from pellucid.engine.async_llm import AsyncLLM
from pellucid.engine.core_client import OutputMailbox
from pellucid.pipeline.async_omni import AsyncOmni
from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.tracing import Save, TracePlan
from tests.tracing.conftest import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan() -> TracePlan:
    return TracePlan([Save(site="model.layers.0"), Save(site="logits", positions={"start": -2}),
                      Save(site="tokens", name="tokens")])


def _save_refs(outputs) -> list[weakref.ref]:
    refs = [weakref.ref(t) for out in outputs for t in out.extras["saves"].values()]
    assert refs and all(r() is not None for r in refs)
    return refs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_saves_die_with_the_outputs(make_llm, async_scheduling):
    llm = make_llm("llama", async_scheduling=async_scheduling)
    prompts = random_prompts(5, [9, 14, 6])
    with no_cyclic_gc():
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False, extras=[{"trace": _plan()} for _ in prompts])
        refs = _save_refs(outputs)
        del outputs
        assert all(r() is None for r in refs)
        # Through the trace API: the handles hold the values.
        with llm.trace(prompts[:2], PARAMS) as tr:
            handle = tr.model.layers[1].output.save()
        refs = [weakref.ref(handle[0]), weakref.ref(handle[1])]
        del tr, handle
        assert all(r() is None for r in refs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_idle_runner_keeps_no_finished_request(make_llm, async_scheduling):
    """Once everything is read back, the runner's last sampled ids and last decode trace (which hold the
    step's requests) are dropped; the engine's next step needs neither."""
    llm = make_llm("llama", async_scheduling=async_scheduling)
    prompts = random_prompts(6, [7, 11])
    first = llm.generate(prompts, PARAMS, use_tqdm=False, extras=[{"trace": _plan()} for _ in prompts])
    runner = llm.engine.runner
    assert runner._last_sampled is None and runner.tap_runtime.last_trace is None
    assert all("outputs" not in r.extras for r in _requests_in(runner.buffers.row_owner))
    # The next batch (traced, then untraced) runs as before: same tokens and saves.
    again = llm.generate(prompts, PARAMS, use_tqdm=False, extras=[{"trace": _plan()} for _ in prompts])
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for name, value in a.extras["saves"].items():
            assert torch.equal(value, b.extras["saves"][name]), name
    plain = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in first]


def _requests_in(rows: list) -> list:
    return [r for r in rows if r is not None]


def test_final_output_takes_the_feature_outputs(make_llm):
    """Streamed outputs of a traced request carry no saves; the final one takes them over from the engine's
    request, which keeps no reference to them."""
    llm = make_llm("llama")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    llm.add_request("traced", random_prompts(7, [5])[0], params, extras={"trace": _plan()}, stream=True)
    request = llm.engine.scheduler.requests["traced"]
    outputs = []
    while llm.has_unfinished_requests():
        outputs.extend(llm.step())
    assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert all(not o.extras for o in outputs[:-1]) and "saves" in outputs[-1].extras
    assert request.is_finished and request.feature_outputs is None


@pytest.mark.parametrize("engine_process", [True, False])
def test_async_llm_saves_die_with_the_outputs(model_dir, monkeypatch, engine_process):
    """The thread that hands the final report to the frontend (the engine process's receiver, or the engine
    thread) lingers after the hand-over here, as a descheduled thread would: it must hold nothing by then."""
    put = OutputMailbox.put

    def put_then_linger(self: OutputMailbox, report: list) -> None:
        final = any(out.finish_reason is not None for out in report[0].outputs)
        put(self, report)
        if final:
            time.sleep(0.5)
    monkeypatch.setattr(OutputMailbox, "put", put_then_linger)
    async_llm = AsyncLLM(model_dir("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                         engine_process=engine_process)
    try:
        prompt = random_prompts(8, [10])[0]

        async def run():
            return [out async for out in async_llm.generate(prompt, PARAMS, extras={"trace": _plan()})]
        with no_cyclic_gc():
            outputs = asyncio.run(run())
            assert outputs[-1].finished and all("saves" not in o.extras for o in outputs[:-1])
            refs = _save_refs(outputs[-1:])
            del outputs
            assert all(r() is None for r in refs)
    finally:
        async_llm.shutdown()


def test_async_omni_saves_die_with_the_outputs(omni_dir):
    """The same for the speech pipeline's thinker: its stage reader must not keep the last report it read
    (the thinker sends none after its last token while the talker still speaks). Stages in threads: the
    reader is the same with stages in processes, whose hand-off the AsyncLLM test above covers."""
    omni = AsyncOmni(omni_dir, qwen3_omni_graph(3, decode_chunk=6, left_context=3), engine_process=False,
                     device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256)
    try:
        prompt = omni.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                                    add_generation_prompt=True)
        plan = TracePlan([Save(site="thinker.model.layers.1", name="h")])

        async def run():
            stream = await omni.add_request("traced", prompt, PARAMS, extras={"trace": plan})
            return [out async for out in stream]
        with no_cyclic_gc():
            outputs = asyncio.run(run())
            assert outputs[-1].finished and sum(len(out.audio) for out in outputs) > 0
            refs = _save_refs([out.text for out in outputs if out.text is not None and "saves" in out.text.extras])
            del outputs
            assert all(r() is None for r in refs)
    finally:
        omni.shutdown()
