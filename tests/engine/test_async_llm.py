"""AsyncLLM against the offline LLM on the same tiny random model: same tokens, aborts, errors, shutdown,
with the engine core in its own process (the default) and in a thread of the caller's."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from pellucid.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from tests.step_faults import failing_step

ENGINE_KWARGS = dict(device="cpu", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def async_llm(qwen3_dir):
    engine = AsyncLLM(qwen3_dir, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def threaded_llm(qwen3_dir):
    """The engine core in a thread of this process, where tests can reach its objects."""
    engine = AsyncLLM(qwen3_dir, engine_process=False, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def random_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "hello", "world", "quick", "brown", "fox", "jumps"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(count)]


async def final_output(engine: AsyncLLM, prompt, params: SamplingParams):
    last = None
    async for out in engine.generate(prompt, params):
        assert last is None or len(out.outputs[0].token_ids) >= len(last.outputs[0].token_ids)
        last = out
    assert last is not None and last.finished
    return last


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("home", ["process", "thread"])
def test_concurrent_generation_equals_llm_generate(llm, async_llm, threaded_llm, seed, home):
    async_llm = async_llm if home == "process" else threaded_llm
    prompts = random_prompts(seed, 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=seed, n=2)
    ref_greedy = llm.generate(prompts, greedy, use_tqdm=False)
    ref_sampled = llm.generate(prompts, sampled, use_tqdm=False)

    async def run():
        tasks = [final_output(async_llm, p, greedy) for p in prompts]
        tasks += [final_output(async_llm, p, sampled) for p in prompts]
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    for ref, out in zip(ref_greedy + ref_sampled, outs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        assert [c.text for c in out.outputs] == [c.text for c in ref.outputs]
        assert out.prompt_token_ids == ref.prompt_token_ids
    assert async_llm.get_stats().num_used_blocks == 0


def test_requests_are_batched_together(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    peak = 0

    async def run():
        nonlocal peak
        tasks = [asyncio.ensure_future(final_output(async_llm, p, params)) for p in random_prompts(7, 12)]
        while not all(t.done() for t in tasks):
            peak = max(peak, async_llm.get_stats().num_running)
            await asyncio.sleep(0.002)
        return [t.result() for t in tasks]

    outs = asyncio.run(run())
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert peak > 1


def test_leaving_the_stream_aborts_within_one_step(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    before = async_llm.get_stats()
    aborted_before = before.num_aborted

    async def run() -> tuple[int, int]:
        seen = 0
        stream = async_llm.generate("the quick brown fox", params)
        async for out in stream:
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                break
        await stream.aclose()       # closing the generator must abort the request, at once
        # The engine applies its inputs in order: this call's answer carries its stats as of after the abort
        # was applied (a later step at most, which no longer runs the request).
        await async_llm.call_utility("reset_prefix_cache")
        return seen, async_llm.get_stats().generation_tokens_total - before.generation_tokens_total

    seen, at_abort = asyncio.run(run())
    wait_until(lambda: async_llm.get_stats().num_aborted == aborted_before + 1)
    wait_until(lambda: async_llm.get_stats().num_running == 0 and async_llm.get_stats().num_used_blocks == 0)
    generated = async_llm.get_stats().generation_tokens_total - before.generation_tokens_total
    # No step ran the request once the abort had arrived (exact, whatever the machine's load).
    assert seen <= at_abort == generated < params.max_tokens


def test_abort_by_id_finishes_the_stream_with_abort(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        outputs = []
        async for out in async_llm.generate("hello world", params, request_id="to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                async_llm.abort("to-abort")
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    wait_until(lambda: async_llm.get_stats().num_used_blocks == 0)


def test_validation_errors_raise_before_the_first_output(async_llm):
    too_long = list(range(1, 300))          # max_model_len is 256

    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_llm.generate(too_long, SamplingParams(max_tokens=4)):
                raise AssertionError("no output may come before the error")
        with pytest.raises(ValueError, match="out of range"):
            async for _ in async_llm.generate([10**6], SamplingParams(max_tokens=4)):
                raise AssertionError("no output may come before the error")
        # The engine still serves.
        return await final_output(async_llm, "hello", SamplingParams(temperature=0.0, max_tokens=3))

    out = asyncio.run(run())
    assert len(out.outputs[0].token_ids) >= 1


def test_failing_step_fails_its_requests_and_keeps_serving(threaded_llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with failing_step(threaded_llm):
        async def run():
            with pytest.raises(RequestFailedError, match="injected step failure"):
                await final_output(threaded_llm, "the cat sat", params)
            return await final_output(threaded_llm, "the cat sat", params)

        out = asyncio.run(run())
    assert len(out.outputs[0].token_ids) == 5
    wait_until(lambda: threaded_llm.get_stats().num_used_blocks == 0)
    assert threaded_llm.get_stats().num_step_failures >= 1


def test_shutdown_ends_in_flight_requests_cleanly(qwen3_dir):
    engine = AsyncLLM(qwen3_dir, **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        got, shut = 0, False
        with pytest.raises(EngineDeadError):
            async for out in engine.generate("the quick brown fox", params):
                got = len(out.outputs[0].token_ids)
                # >= : a busy machine's reader may get the outputs of several steps in one (cumulative).
                if got >= 2 and not shut:
                    shut = True
                    # shutdown() blocks until the loop stopped; run it off the event loop thread.
                    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("hello", params):
                pass
        return got

    assert asyncio.run(run()) >= 2
    assert engine.get_stats().num_used_blocks == 0
    assert not engine.is_running


def test_stepping_ahead_defaults(qwen3_dir, async_llm):
    # An engine in a thread of the frontend's process steps serially unless asked (stepping ahead would
    # keep it from releasing the GIL to the event loop, see ThreadedClient); an explicit
    # async_scheduling=True is kept, and its outputs match the serial ones. An engine in its own process
    # steps ahead by default where it pays (CUDA), not on the CPU.
    default = AsyncLLM(qwen3_dir, engine_process=False, **ENGINE_KWARGS)
    asked = AsyncLLM(qwen3_dir, engine_process=False, async_scheduling=True, **ENGINE_KWARGS)
    try:
        assert default.info.async_scheduling is False and asked.info.async_scheduling is True
        assert async_llm.info.async_scheduling is False       # its own process, on the CPU

        async def run(engine: AsyncLLM) -> list[int]:
            final = None
            async for out in engine.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True)):
                final = out
            return list(final.outputs[0].token_ids)

        assert asyncio.run(run(asked)) == asyncio.run(run(default)) == asyncio.run(run(async_llm))
        assert asked.engine.num_steps_ahead > 0
    finally:
        default.shutdown()
        asked.shutdown()


def test_a_closed_loops_handler_does_not_fail_a_later_loops_requests(async_llm, llm):
    """A loop closed with the output handler still pending (a server thread's loop, say) leaves a task that
    Python closes (GeneratorExit) when it is collected, maybe while another loop serves: that is no failure
    of anyone's requests."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = asyncio.new_event_loop()

    async def one(prompt: str) -> list[int]:
        out = None
        async for out in async_llm.generate(prompt, params):
            pass
        return out.outputs[0].token_ids

    first.run_until_complete(one("a first loop"))
    first.close()               # not asyncio.run: the handler task is left pending, not cancelled
    stale = async_llm._handler

    async def later() -> list[int]:
        task = asyncio.ensure_future(one("the quick brown fox"))
        await asyncio.sleep(0)
        assert async_llm._handler is not stale
        stale.get_coro().close()        # what collecting the stale task does, here mid-request
        return await task

    expected = llm.generate(["the quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert asyncio.run(later()) == expected
