"""Async scheduling (step N+1 scheduled and launched before step N is read back) keeps the serial semantics.

The reference is the same engine run serially on the same random model. Requests that can step ahead
(Request.can_step_ahead) must end with exactly the serial outputs, and every streamed report must extend
the previous one; when a request that cannot step ahead (penalties, min_tokens) is present, the engine
only overlaps output processing, and every report of every step equals the serial engine's. The cases
stepping ahead makes new get their own checks: a request ending (EOS, stop string, abort) while the next
step already holds it (that token is dropped, never reported, blocks freed), preemption, which a step
scheduled ahead never does, and ids fed on the device.
"""
from __future__ import annotations

import pytest
import torch

from pellucid.config import EngineConfig
from pellucid.engine.engine_core import EngineCore
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from pellucid.structured import StructuredOutputsParams


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


def _engine(model_dir: str, async_scheduling: bool, **kwargs) -> LLM:
    """An LLM stepped by hand, its engine core in this thread (`llm.engine`)."""
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, async_scheduling=async_scheduling,
               **kwargs)


def _core_requests(llm: LLM, request_id: str) -> list:
    """The engine core's Request objects of a request just added (one per sequence)."""
    return [llm.engine.scheduler.requests[c] for c in llm.output_processor.child_ids(request_id)]


def _prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 400, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def _snapshot(out) -> tuple:
    return (out.request_id, out.finished, out.error,
            tuple((c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
                   None if c.logprobs is None else len(c.logprobs)) for c in out.outputs))


def _run(engine: LLM, requests: list[tuple[str, list[int], SamplingParams, bool]]) -> list[list[tuple]]:
    for rid, prompt, params, stream in requests:
        engine.add_request(rid, prompt, params, stream=stream)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(sorted(_snapshot(o) for o in engine.step()))
    return steps


def _requests(seed: int, stop: list[str], last_two: list[SamplingParams]
              ) -> list[tuple[str, list[int], SamplingParams, bool]]:
    """Greedy, seeded n=2, a stop string, logprobs + prompt logprobs, then `last_two`; every other one streams."""
    prompts = _prompts(seed, 4 + len(last_two))
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop),
        SamplingParams(temperature=0.7, seed=seed + 7, max_tokens=10, logprobs=2, prompt_logprobs=1),
        *last_two,
    ]
    return [(f"r{i}", prompt, p, i % 2 == 0) for i, (prompt, p) in enumerate(zip(prompts, params))]


def _mixed_requests(seed: int, stop: list[str]) -> list[tuple[str, list[int], SamplingParams, bool]]:
    """Ends with three requests that cannot step ahead (min_tokens, a penalty, a structured output)."""
    return _requests(seed, stop, [
        SamplingParams(temperature=0.0, max_tokens=14, min_tokens=4, stop=stop, include_stop_str_in_output=True),
        SamplingParams(temperature=0.9, seed=seed + 3, top_k=20, max_tokens=11, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=seed + 5, max_tokens=12,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}( [0-9]{1,3}){1,4}"))])


def _stop_strings_from_serial(model_dir: str, seed: int) -> list[str]:
    """Stop strings that the greedy stop-string request really produces a few tokens in."""
    engine = _engine(model_dir, async_scheduling=False)
    prompt = _prompts(seed, 6)[2]
    engine.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    assert len(text) > 8, f"the tiny model decoded too little text to place a stop string: {text!r}"
    return [text[5:8]]


def _final_outputs(steps: list[list[tuple]]) -> dict[str, tuple]:
    """The last report of each request, checking on the way that each report extends the one before."""
    last: dict[str, tuple] = {}
    for step in steps:
        for snap in step:
            rid, previous = snap[0], last.get(snap[0])
            if previous is not None:
                assert not previous[1], f"{rid} reported after it finished"
                for before, after in zip(previous[3], snap[3]):
                    assert after[2][:len(before[2])] == before[2], f"{rid}: a report dropped tokens"
            last[rid] = snap
    return last


def _step_ahead_requests(seed: int, stop: list[str]) -> list[tuple[str, list[int], SamplingParams, bool]]:
    """Every request can step ahead; one ends after its first token."""
    return _requests(seed, stop, [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.9, seed=seed + 3, top_k=20, top_p=0.9, max_tokens=11)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stepping_ahead_ends_with_the_serial_outputs(model_dir, seed):
    stop = _stop_strings_from_serial(model_dir, seed)
    serial = _final_outputs(_run(_engine(model_dir, async_scheduling=False), _step_ahead_requests(seed, stop)))
    llm = _engine(model_dir, async_scheduling=True)
    requests = _step_ahead_requests(seed, stop)
    r1 = []
    original_add = llm.add_request

    def add_and_keep(rid, *args, **kwargs):
        original_add(rid, *args, **kwargs)
        if rid == "r1":
            r1.extend(_core_requests(llm, rid))
    llm.add_request = add_and_keep
    ahead = _final_outputs(_run(llm, requests))
    assert ahead == serial
    assert llm.engine.num_steps_ahead > 0
    assert llm.engine.block_pool.num_used_blocks == 0
    assert len(r1) == 2 and all(r.num_pending_tokens == 0 for r in r1)


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_that_cannot_step_ahead_keep_every_step_serial(model_dir, seed):
    stop = _stop_strings_from_serial(model_dir, seed)
    serial = _run(_engine(model_dir, async_scheduling=False), _mixed_requests(seed, stop))
    overlapped_engine = _engine(model_dir, async_scheduling=True)
    overlapped = _run(overlapped_engine, _mixed_requests(seed, stop))
    assert overlapped == serial
    assert overlapped_engine.engine.num_steps_ahead == 0
    assert overlapped_engine.engine.block_pool.num_used_blocks == 0
    assert not overlapped_engine.has_unfinished_requests()


@pytest.mark.parametrize("seed", [3, 4])
def test_preemption_under_async_scheduling_matches_serial(model_dir, seed):
    # A pool this small makes the later requests preempt and recompute.
    requests = [(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), True)
                for i, prompt in enumerate(_prompts(seed, 5))]
    serial_engine = _engine(model_dir, async_scheduling=False, num_kv_blocks=12, block_size=16)
    serial = _final_outputs(_run(serial_engine, requests))
    overlapped_engine = _engine(model_dir, async_scheduling=True, num_kv_blocks=12, block_size=16)
    overlapped = _final_outputs(_run(overlapped_engine, requests))
    assert serial_engine.engine.scheduler.num_preemptions > 0
    assert overlapped_engine.engine.scheduler.num_preemptions > 0
    assert overlapped_engine.engine.num_steps_ahead > 0
    assert overlapped == serial
    assert overlapped_engine.engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("seed", [0, 5])
def test_stop_string_found_while_next_step_in_flight(model_dir, seed):
    stop = _stop_strings_from_serial(model_dir, seed)
    prompt = _prompts(seed, 6)[2]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop)
    llm = _engine(model_dir, async_scheduling=True)
    engine = llm.engine
    llm.add_request("s", prompt, params, stream=True)
    request = _core_requests(llm, "s")[0]
    reports = []
    while llm.has_unfinished_requests():
        reports += llm.step()
        if reports and reports[-1].finished and engine._in_flight is not None:
            # The step launched before the stop string was found still holds the request; its blocks
            # are already free, and collecting that step must not add its token.
            assert engine.block_pool.num_used_blocks == 0
            tokens_at_stop = list(request.output_token_ids)
    final = reports[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop[0]
    assert engine.num_discarded_tokens == 1            # the in-flight token of the stopped request
    assert request.output_token_ids == tokens_at_stop  # nothing appended after the stop
    assert len(reports) == len(final.outputs[0].token_ids)   # one report per kept token, none after the end
    assert stop[0] not in final.outputs[0].text
    assert engine.block_pool.num_used_blocks == 0
    # The same tokens as the serial engine, which never schedules past the stop.
    serial = _engine(model_dir, async_scheduling=False)
    serial.add_request("s", prompt, params, stream=True)
    serial_final = None
    while serial.has_unfinished_requests():
        serial_final = next((o for o in serial.step() if o.finished), serial_final)
    assert _snapshot(serial_final) == _snapshot(final)
    assert serial.engine.num_discarded_tokens == 0
    assert engine.stats().generation_tokens_total == serial.engine.stats().generation_tokens_total


@pytest.mark.parametrize("seed", [0, 1])
def test_abort_while_step_in_flight(model_dir, seed):
    prompts = _prompts(seed, 2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = _engine(model_dir, async_scheduling=True)
    engine = llm.engine
    llm.add_request("keep", prompts[0], params, stream=True)
    llm.add_request("gone", prompts[1], params, stream=True)
    gone = _core_requests(llm, "gone")[0]
    reported_gone = []
    for _ in range(3):
        reported_gone += [o for o in llm.step() if o.request_id == "gone"]
    assert engine._in_flight is not None and gone in engine._in_flight.so.requests
    tokens_before_abort = list(gone.output_token_ids)
    blocks_before = engine.block_pool.num_used_blocks
    llm.abort_request("gone")
    assert engine.block_pool.num_used_blocks < blocks_before        # freed at once, step still in flight
    keep_reports = []
    while llm.has_unfinished_requests():
        outs = llm.step()
        reported_gone += [o for o in outs if o.request_id == "gone"]
        keep_reports += [o for o in outs if o.request_id == "keep"]
    last = reported_gone[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert list(last.outputs[0].token_ids) == tokens_before_abort == gone.output_token_ids
    assert engine.num_discarded_tokens == 1
    assert engine.block_pool.num_used_blocks == 0
    # The other request is untouched by the abort: the same tokens as alone on a serial engine.
    serial = _engine(model_dir, async_scheduling=False)
    serial.add_request("keep", prompts[0], params, stream=True)
    serial_final = None
    while serial.has_unfinished_requests():
        serial_final = next((o for o in serial.step() if o.finished), serial_final)
    assert _snapshot(keep_reports[-1]) == _snapshot(serial_final)


def test_async_scheduling_defaults_off_on_the_cpu(model_dir):
    # On the CPU a launch is the computation itself: nothing would overlap. CUDA devices default to on.
    config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu", max_model_len=128)
    assert EngineCore(config).async_scheduling is False


def test_sampling_metadata_reused_only_for_the_same_static_params(model_dir):
    from pellucid.engine.request import Request
    from pellucid.runner.sampling_metadata_builder import build_sampling_metadata

    runner = _engine(model_dir, async_scheduling=False).engine.runner
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5)
    seeded = SamplingParams(temperature=0.8, seed=3)
    reqs = [Request(f"q{i}", [1, 2, 3], p) for i, p in enumerate([greedy, hot, greedy])]
    first = runner._sampling_metadata(reqs)
    assert runner._sampling_metadata(list(reqs)) is first                     # steady batch: reused
    swapped = runner._sampling_metadata([reqs[1], reqs[0], reqs[2]])          # same objects, other rows
    assert swapped is not first
    fresh = build_sampling_metadata([reqs[1], reqs[0], reqs[2]], "cpu")
    for name in ("temperature", "top_k", "top_p"):
        assert torch.equal(getattr(swapped, name), getattr(fresh, name))
    assert runner._sampling_metadata(reqs[:2]) is not swapped                 # a row left
    with_seed = [Request("s", [1, 2], seeded)] + reqs
    a = runner._sampling_metadata(with_seed)
    assert runner._sampling_metadata(with_seed) is not a                      # per-step generators: rebuilt
