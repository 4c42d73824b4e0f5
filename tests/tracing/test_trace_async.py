"""Tracing through AsyncLLM: the extras path, streaming, multi-invoke traces and failures."""
from __future__ import annotations

import asyncio
import operator

import pytest
import torch

from pellucid import SamplingParams
from pellucid.engine.async_llm import AsyncLLM, RequestFailedError
from pellucid.tracing import Apply, Save, TraceError, TracePlan, async_trace
from tests.tracing.conftest import TOLERANCE, random_prompts, relative_error

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(model_dir):
    offline_kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=256)
    from pellucid import LLM
    llm = LLM(model_dir("qwen3"), **offline_kwargs)
    async_llm = AsyncLLM(model_dir("qwen3"), **offline_kwargs)
    yield llm, async_llm
    async_llm.shutdown()


def test_streamed_outputs_carry_saves_at_the_end(engines):
    llm, async_llm = engines
    prompt = random_prompts(1, [13])[0]
    plan = TracePlan([Save(site="model.layers.1", name="h"), Save(site="tokens", name="tokens")])

    async def run():
        outs = []
        async for out in async_llm.generate(prompt, PARAMS, extras={"trace": plan}):
            outs.append(out)
        return outs
    outs = asyncio.run(run())
    assert outs[-1].finished and all("saves" not in o.extras for o in outs[:-1])
    saves = outs[-1].extras["saves"]
    offline = llm.generate([prompt], PARAMS, use_tqdm=False, extras=[{"trace": plan}])[0]
    assert relative_error(saves["h"], offline.extras["saves"]["h"]) <= TOLERANCE
    assert saves["tokens"].tolist() == outs[-1].outputs[0].token_ids == offline.outputs[0].token_ids


def test_async_multi_invoke_runs_every_invoke_with_its_own_saves(engines):
    llm, async_llm = engines
    prompts = random_prompts(2, [8, 15, 11])
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))

    def build(tr):
        shared = tr.model.layers[0].output.save()
        handles = []
        for i, prompt in enumerate(prompts):
            with tr.invoke(prompt, PARAMS):
                if i == 1:
                    tr.model.layers[1].output.add(vector)
                handles.append(tr.model.layers[2].output.save())
        return shared, handles

    async def run():
        async with async_trace(async_llm) as tr:
            result = build(tr)
        return tr, result
    tr_async, (shared_async, handles_async) = asyncio.run(run())
    with llm.trace() as tr_offline:
        shared_offline, handles_offline = build(tr_offline)
    assert len(tr_async.outputs) == 3
    for i in range(3):
        assert relative_error(shared_async[i], shared_offline[i]) <= TOLERANCE
        assert relative_error(handles_async[i].value, handles_offline[i].value) <= TOLERANCE
        assert tr_async.outputs[i].outputs[0].token_ids == tr_offline.outputs[i].outputs[0].token_ids
    with llm.trace([prompts[1]], PARAMS) as tr:
        unedited = tr.model.layers[2].output.save()
    assert relative_error(handles_async[1].value, unedited.value) > 1e-2     # invoke 1's edit applied
    assert relative_error(handles_async[2].value, handles_offline[2].value) <= TOLERANCE


def test_async_failure_fails_only_that_request(engines):
    _, async_llm = engines
    prompts = random_prompts(3, [9, 9])
    bad_view = operator.methodcaller("view", 7)     # picklable (the engine runs in another process); raises there

    async def run():
        async with async_trace(async_llm) as tr:
            with tr.invoke(prompts[0], PARAMS):
                tr.model.layers[1].output.apply(bad_view)
            with tr.invoke(prompts[1], PARAMS):
                good = tr.model.layers[1].output.save()
        return good
    with pytest.raises(TraceError) as info:
        asyncio.run(run())
    assert list(info.value.failures) == [0] and "shape" in info.value.failures[0][0]
    assert info.value.outputs[1].finished and info.value.outputs[1].error is None

    async def direct():
        with pytest.raises(RequestFailedError, match="shape"):
            async for _ in async_llm.generate(prompts[0], PARAMS,
                                              extras={"trace": [Apply(site="model.norm", fn=bad_view)]}):
                pass
    asyncio.run(direct())


def test_async_trace_with_a_value_that_cannot_fit_runs_nothing(engines):
    """Refused when its requests are added: the block raises, and the trace's other requests, already
    running, are aborted before it does rather than left running unobserved."""
    _, async_llm = engines
    prompts = random_prompts(4, [9, 9])

    async def main() -> tuple[list[str], bool]:
        with pytest.raises(ValueError, match=r"add value of shape \(7,\) does not fit"):
            async with async_trace(async_llm) as tr:
                with tr.invoke(prompts[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)):
                    tr.model.layers[1].output.save()
                with tr.invoke(prompts[1], PARAMS):
                    tr.model.layers[1].output.add(torch.ones(7))
        pending = [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                   if not t.done() and "async_trace.__aexit__" in t.get_coro().__qualname__]
        for _ in range(200):
            stats = async_llm.get_stats()
            if stats.num_running == stats.num_waiting == 0:
                return pending, True
            await asyncio.sleep(0.05)
        return pending, False
    pending, settled = asyncio.run(main())
    assert pending == [] and settled
