"""Scheduler driven by a fake runner over random workloads.

The fake runner keeps a simulated KV cache: every slot holds a fingerprint of the whole prefix that
produced it. Each step it writes the scheduled tokens' fingerprints into the slots their block tables
name, then checks every position each request attends to holds that request's own prefix. Block
tables, prefix hits, preemption and freeing are thereby checked against what the tokens are, not
against the scheduler's own bookkeeping. Sampled tokens are a hash of (request id, position), so the
expected output of every request is known independently of scheduling.
"""
from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass

import pytest

from pellucid.config import CacheConfig, SchedulerConfig
from pellucid.engine.block_pool import NULL_BLOCK_ID, BlockPool
from pellucid.engine.kv_cache_manager import KVCacheManager
from pellucid.engine.request import Request, RequestStatus
from pellucid.engine.scheduler import Scheduler
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.runner.output import ModelRunnerOutput
from pellucid.sampling_params import SamplingParams

VOCAB = 40
EOS = 0
MAX_MODEL_LEN = 256


def fake_token(request_id: str, position: int) -> int:
    digest = hashlib.sha256(f"{request_id}@{position}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % VOCAB


def expected_generation(request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What the request must produce: fake tokens until a stop condition, evaluated from scratch."""
    limit = min(MAX_MODEL_LEN, len(prompt) + params.max_tokens)
    out: list[int] = []
    while True:
        token = fake_token(request_id, len(prompt) + len(out))
        out.append(token)
        if len(prompt) + len(out) >= limit:
            return out, "length"
        if len(out) >= params.min_tokens and (token == EOS and not params.ignore_eos
                                              or token in params.stop_token_ids):
            return out, "stop"


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.fingerprints: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}   # tokens whose KV the request has in cache, as we saw it
        self.chunks: dict[str, list[int]] = {}
        self.fail_ids: set[str] = set()
        self.drop_token_ids: set[str] = set()

    def _prefix_fingerprints(self, request: Request) -> list[int]:
        fps = self.fingerprints.setdefault(request.request_id, [])
        for token in request.all_token_ids[len(fps):]:
            fps.append(hash((fps[-1] if fps else None, token)))
        return fps

    def _slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.preempted_request_ids | so.finished_request_ids:
            self.computed.pop(rid, None)
        assert len({r.request_id for r in so.requests}) == so.num_reqs
        rows = list(zip(so.requests, so.num_scheduled_tokens, so.num_computed_tokens, so.samples))
        # Like every attention layer: all of the step's KV is written before anything is read.
        for request, n, start, samples in rows:
            rid = request.request_id
            assert n >= 1 and request.num_computed_tokens == start + n <= request.num_tokens
            assert samples == (start + n == request.num_tokens)
            if rid in self.computed:
                assert start == self.computed[rid], "chunks of a running request must be contiguous"
            else:
                assert start % self.block_size == 0, "a (re)admitted request starts after whole cached blocks"
            assert len(request.block_ids) == -(-(start + n) // self.block_size), "blocks must cover the tokens"
            assert NULL_BLOCK_ID not in request.block_ids
            fps = self._prefix_fingerprints(request)
            for position in range(start, start + n):
                self.slots[self._slot(request, position)] = fps[position]
            self.computed[rid] = start + n
            self.chunks.setdefault(rid, []).append(n)
        out = ModelRunnerOutput()
        for request, n, start, samples in rows:
            fps = self._prefix_fingerprints(request)
            for position in range(start + n):
                assert self.slots[self._slot(request, position)] == fps[position], \
                    f"{request.request_id} reads wrong KV at position {position}"
            rid = request.request_id
            if rid in self.fail_ids:
                out.errors[rid] = "intervention failed"
            elif samples and rid not in self.drop_token_ids:
                out.sampled_token_ids[rid] = fake_token(rid, request.num_tokens)
        return out


@dataclass
class Setup:
    scheduler: Scheduler
    runner: FakeRunner
    pool: BlockPool


def build(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_num_seqs: int = 8,
          chunked: bool = True, prefix: bool = True) -> Setup:
    pool = BlockPool(num_blocks, prefix)
    kv = KVCacheManager(pool, block_size, prefix)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          enable_chunked_prefill=chunked),
                          CacheConfig(block_size=block_size, enable_prefix_caching=prefix), kv, MAX_MODEL_LEN)
    return Setup(scheduler, FakeRunner(num_blocks, block_size), pool)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, arrival: float = 0.0, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids={EOS},
                   arrival_time=arrival, max_model_len=MAX_MODEL_LEN)


def step(setup: Setup) -> tuple[SchedulerOutput, list[Request]]:
    s = setup.scheduler
    so = s.schedule()
    assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert so.num_reqs <= s.max_num_seqs and s.num_running <= s.max_num_seqs
    if s.has_unfinished_requests():
        assert not so.is_empty, "requests are pending but nothing was scheduled"
    changed = s.update_from_output(so, setup.runner.execute(so)) if not so.is_empty else []
    return so, changed


def run_to_completion(setup: Setup, arrivals: list[tuple[int, Request]], max_steps: int = 5000) -> None:
    pending = sorted(arrivals, key=lambda item: item[0])
    t = 0
    while pending or setup.scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= t:
            setup.scheduler.add_request(pending.pop(0)[1])
        if setup.scheduler.has_unfinished_requests():
            step(setup)
        t += 1
        assert t < max_steps


def assert_all_blocks_free(setup: Setup) -> None:
    assert setup.pool.num_used_blocks == 0
    assert setup.pool.num_free_blocks == setup.pool.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in setup.pool.blocks)


def random_workload(rng: random.Random, num_requests: int, max_prompt: int, max_tokens: int,
                    shared_prefixes: bool) -> list[tuple[int, Request]]:
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    workload = []
    for i in range(num_requests):
        length = rng.randint(1, max_prompt)
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        if shared_prefixes and rng.random() < 0.6:
            prompt = (rng.choice(prefixes) + prompt)[:max_prompt]
        stop_ids = [rng.randrange(1, VOCAB)] if rng.random() < 0.5 else None
        tokens = rng.randint(1, max_tokens)
        arrival = rng.randint(0, 25)
        workload.append((arrival, make_request(f"req{i}", prompt, max_tokens=tokens, arrival=float(arrival),
                                               min_tokens=rng.randint(0, tokens), stop_token_ids=stop_ids)))
    return workload


CONFIGS = {
    "chunked+prefix": dict(num_blocks=80, budget=16, chunked=True, prefix=True),
    "chunked": dict(num_blocks=80, budget=16, chunked=True, prefix=False),
    "whole-prompt+prefix": dict(num_blocks=80, budget=48, chunked=False, prefix=True),
    "tight-pool+prefix": dict(num_blocks=17, budget=24, chunked=True, prefix=True),
    "tight-pool-whole-prompt": dict(num_blocks=17, budget=40, chunked=False, prefix=False),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_completes_with_expected_tokens(config: str, seed: int) -> None:
    rng = random.Random(seed * 100 + len(config))
    setup = build(max_num_seqs=rng.choice([2, 5, 8]), **CONFIGS[config])
    # Every request fits alone: 40 prompt + 24 output tokens = 16 blocks of 4 <= 16 usable blocks.
    workload = random_workload(rng, num_requests=30, max_prompt=40, max_tokens=24, shared_prefixes=True)
    run_to_completion(setup, workload)
    for _, request in workload:
        tokens, reason = expected_generation(request.request_id, request.prompt_token_ids, request.sampling_params)
        assert request.output_token_ids == tokens, request.request_id
        assert request.finish_reason == reason and request.error is None
        assert request.num_cached_tokens >= 0 and request.block_ids == []
    assert_all_blocks_free(setup)
    s = setup.scheduler
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.total_scheduled_tokens == sum(sum(c) for c in setup.runner.chunks.values())
    if config.startswith("tight"):
        assert s.num_preemptions > 0
        assert sum(r.num_preemptions for _, r in workload) == s.num_preemptions
    if "prefix" in config:
        assert s.prefix_cache_hit_tokens > 0
    else:
        assert s.prefix_cache_hit_tokens == 0 and all(r.num_cached_tokens == 0 for _, r in workload)


def test_chunked_prefill_splits_long_prompt_after_decodes() -> None:
    setup = build(budget=32, prefix=False)
    short = make_request("short", list(range(5)), max_tokens=20)
    setup.scheduler.add_request(short)
    step(setup)
    long = make_request("long", list(range(1, 101)), max_tokens=2)
    setup.scheduler.add_request(long)
    so, _ = step(setup)
    assert [r.request_id for r in so.requests] == ["short", "long"]
    assert so.num_scheduled_tokens == [1, 31] and so.samples == [True, False]
    while not long.is_finished:
        step(setup)
    assert setup.runner.chunks["long"] == [31, 31, 31, 7, 1]
    assert long.output_token_ids == expected_generation("long", long.prompt_token_ids, long.sampling_params)[0]


def test_without_chunking_a_prompt_waits_for_room_in_the_budget() -> None:
    setup = build(budget=20, chunked=False, prefix=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        setup.scheduler.add_request(make_request("huge", list(range(21))))
    a, b = make_request("a", list(range(15))), make_request("b", list(range(10)))
    setup.scheduler.add_request(a)
    setup.scheduler.add_request(b)
    so, _ = step(setup)
    assert [r.request_id for r in so.requests] == ["a"] and setup.scheduler.num_waiting == 1
    so, _ = step(setup)
    assert [r.request_id for r in so.requests] == ["a", "b"] and so.num_scheduled_tokens == [1, 10]


def test_max_num_seqs_caps_the_batch() -> None:
    setup = build(max_num_seqs=3, prefix=False)
    for i in range(5):
        setup.scheduler.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=4, ignore_eos=True))
    so, _ = step(setup)
    assert [r.request_id for r in so.requests] == ["r0", "r1", "r2"]
    for _ in range(3):
        so, _ = step(setup)
    assert [r.request_id for r in so.requests] == ["r0", "r1", "r2"]
    so, _ = step(setup)    # the first three finish after 4 tokens; the others take their places
    assert [r.request_id for r in so.requests] == ["r3", "r4"]


@pytest.mark.parametrize("first_finished", [False, True])
def test_shared_prefix_schedules_only_uncached_tokens(first_finished: bool) -> None:
    bs = 4
    setup = build(block_size=bs, budget=64)
    rng = random.Random(int(first_finished))
    prefix = [rng.randrange(1, VOCAB) for _ in range(3 * bs)]
    a = make_request("a", prefix + [1, 2, 3], max_tokens=3, ignore_eos=True)
    setup.scheduler.add_request(a)
    step(setup)
    while first_finished and not a.is_finished:
        step(setup)
    b = make_request("b", prefix + [5, 6, 7, 8, 9], max_tokens=3)
    setup.scheduler.add_request(b)
    so, _ = step(setup)
    row = so.requests.index(b)
    assert so.num_computed_tokens[row] == 3 * bs and so.num_scheduled_tokens[row] == 5
    assert b.num_cached_tokens == 3 * bs and a.num_cached_tokens == 0
    run_to_completion(setup, [])
    assert b.output_token_ids == expected_generation("b", b.prompt_token_ids, b.sampling_params)[0]
    assert_all_blocks_free(setup)


def test_prefix_hit_within_the_same_step() -> None:
    setup = build(block_size=4, budget=64)
    prompt = list(range(1, 15))
    a, b = make_request("a", prompt), make_request("b", prompt)
    setup.scheduler.add_request(a)
    setup.scheduler.add_request(b)
    so, _ = step(setup)   # the runner checks b reads the KV a writes in this very step
    assert so.num_scheduled_tokens == [14, 2] and b.num_cached_tokens == 12


def test_read_prefix_cache_false_gets_no_hits() -> None:
    setup = build(block_size=4, budget=64)
    prompt = list(range(1, 18))
    setup.scheduler.add_request(make_request("a", prompt))
    step(setup)
    b = make_request("b", prompt)
    b.read_prefix_cache = False
    setup.scheduler.add_request(b)
    so, _ = step(setup)
    assert so.num_scheduled_tokens[so.requests.index(b)] == len(prompt) and b.num_cached_tokens == 0


def test_publish_prefix_cache_false_publishes_nothing() -> None:
    setup = build(block_size=4, budget=64)
    prompt = list(range(1, 18))
    a = make_request("a", prompt, max_tokens=6, ignore_eos=True)
    a.publish_prefix_cache = False
    setup.scheduler.add_request(a)
    run_to_completion(setup, [])
    assert setup.pool.num_cached_blocks == 0
    b = make_request("b", prompt)
    setup.scheduler.add_request(b)
    step(setup)
    assert b.num_cached_tokens == 0


def test_preemption_recomputes_and_keeps_outputs() -> None:
    # 6 usable blocks of 4: two requests of 8-token prompts growing to 20 tokens cannot both stay.
    setup = build(num_blocks=7, block_size=4, budget=32, prefix=False)
    a = make_request("a", list(range(1, 9)), max_tokens=12, arrival=0.0, ignore_eos=True)
    b = make_request("b", list(range(11, 19)), max_tokens=12, arrival=1.0, ignore_eos=True)
    setup.scheduler.add_request(a)
    setup.scheduler.add_request(b)
    preempted = []
    while setup.scheduler.has_unfinished_requests():
        so, _ = step(setup)
        preempted += sorted(so.preempted_request_ids)
    assert preempted and set(preempted) == {"b"}   # the latest arrival is the victim
    assert b.num_preemptions == setup.scheduler.num_preemptions == len(preempted)
    for r in (a, b):
        assert r.output_token_ids == expected_generation(r.request_id, r.prompt_token_ids, r.sampling_params)[0]
    assert_all_blocks_free(setup)


def test_abort_frees_blocks_and_is_reported_next_step() -> None:
    setup = build(prefix=False)
    running = make_request("running", list(range(1, 11)), max_tokens=10)
    waiting = make_request("waiting", list(range(1, 11)), max_tokens=10)
    setup.scheduler.add_request(running)
    so, _ = step(setup)
    setup.scheduler.add_request(waiting)
    stale = setup.scheduler.schedule()
    setup.scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    setup.scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)   # no-op the second time
    assert running.finish_reason == "abort" and waiting.finish_reason == "abort"
    assert_all_blocks_free(setup)
    # Results of the step scheduled before the abort are ignored for the aborted requests.
    late = ModelRunnerOutput(sampled_token_ids={r.request_id: 7 for r in stale.requests})
    changed = setup.scheduler.update_from_output(stale, late)
    assert changed == [] and running.num_output_tokens == 1
    assert not setup.scheduler.has_unfinished_requests()
    assert setup.scheduler.schedule().finished_request_ids == {"running", "waiting"}


def test_runner_errors_end_only_that_request() -> None:
    setup = build()
    good, bad = make_request("good", list(range(1, 9))), make_request("bad", list(range(21, 29)))
    setup.scheduler.add_request(good)
    setup.scheduler.add_request(bad)
    setup.runner.fail_ids.add("bad")
    _, changed = step(setup)
    assert bad in changed and bad.finish_reason == "error" and bad.error == "intervention failed"
    run_to_completion(setup, [])
    assert good.output_token_ids == expected_generation("good", good.prompt_token_ids, good.sampling_params)[0]
    assert_all_blocks_free(setup)
    cached = set(setup.pool._cached)
    assert cached and cached <= set(good.block_hashes)   # bad's blocks were unpublished
    assert not cached & set(bad.block_hashes)


def test_missing_sampled_token_is_an_error() -> None:
    setup = build()
    r = make_request("r", [1, 2, 3])
    setup.scheduler.add_request(r)
    setup.runner.drop_token_ids.add("r")
    step(setup)
    assert r.finish_reason == "error" and "no token" in r.error
    assert_all_blocks_free(setup)


def test_request_that_outgrows_the_pool_ends_with_error() -> None:
    setup = build(num_blocks=4, block_size=4, prefix=False)    # 3 blocks = 12 tokens
    big = make_request("big", list(range(1, 14)))
    setup.scheduler.add_request(big)
    so = setup.scheduler.schedule()
    assert so.is_empty and big.finish_reason == "error" and "needs 4 KV blocks" in big.error
    assert setup.scheduler.drain_finished_unreported() == [big]
    r = make_request("r", list(range(1, 9)), max_tokens=20, ignore_eos=True)
    setup.scheduler.add_request(r)
    for _ in range(10):
        step(setup)
        if r.is_finished:
            break
    assert r.finish_reason == "error" and "KV blocks" in r.error and r.num_tokens == 13
    assert setup.scheduler.drain_finished_unreported() == [r]
    assert setup.scheduler.drain_finished_unreported() == []
    assert not setup.scheduler.has_unfinished_requests()
    assert_all_blocks_free(setup)


def test_stop_conditions() -> None:
    setup = build(prefix=False)
    rid = "stopper"
    prompt = [3, 4, 5]
    first = fake_token(rid, 3)
    second = fake_token(rid, 4)
    # EOS is ignored before min_tokens, then honoured; a stop token id sets stop_reason.
    eos_req = Request(rid, prompt, SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids={first, second},
                      max_model_len=MAX_MODEL_LEN)
    setup.scheduler.add_request(eos_req)
    run_to_completion(setup, [])
    assert eos_req.output_token_ids == [first, second] and eos_req.finish_reason == "stop"
    assert eos_req.stop_reason is None
    setup = build(prefix=False)
    stop_req = Request(rid, prompt, SamplingParams(max_tokens=10, stop_token_ids=[first]),
                       max_model_len=MAX_MODEL_LEN)
    setup.scheduler.add_request(stop_req)
    run_to_completion(setup, [])
    assert stop_req.output_token_ids == [first] and stop_req.stop_reason == first
    setup = build(prefix=False)
    ignore = Request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids={first},
                     max_model_len=MAX_MODEL_LEN)
    setup.scheduler.add_request(ignore)
    run_to_completion(setup, [])
    assert ignore.num_output_tokens == 4 and ignore.finish_reason == "length"
    setup = build(prefix=False)
    capped = Request("capped", list(range(1, 11)), SamplingParams(max_tokens=None, ignore_eos=True),
                     max_model_len=14)
    setup.scheduler.add_request(capped)
    run_to_completion(setup, [])
    assert capped.num_tokens == 14 and capped.finish_reason == "length"


class _NoShortcutKV(KVCacheManager):
    """A KV manager that offers the scheduler no call-free decodes: every step goes through allocate_slots."""

    @property
    def no_work_limits(self) -> dict[str, int]:
        return {}


def _drive(scheduler: Scheduler, arrivals: list[tuple[int, Request]], ahead: bool) -> list[tuple]:
    """Run to completion, stepping ahead (the next step scheduled before this one's tokens are applied) when
    `ahead`; sampled tokens are fake_token at the sampled position. Returns every step's schedule."""
    pending = sorted(arrivals, key=lambda item: item[0])
    log = []
    in_flight: SchedulerOutput | None = None
    t = 0
    while pending or scheduler.has_unfinished_requests() or in_flight is not None:
        while pending and pending[0][0] <= t:
            scheduler.add_request(pending.pop(0)[1])
        current, in_flight = in_flight, None
        if current is None:
            current = scheduler.schedule()
            log.append(current)
        if ahead and not scheduler.ahead_blocked:
            in_flight = scheduler.schedule(ahead=True)
            log.append(in_flight)
            in_flight = None if in_flight.is_empty else in_flight
        if not current.is_empty:
            out = ModelRunnerOutput()
            for request, n, start, samples in zip(current.requests, current.num_scheduled_tokens,
                                                  current.num_computed_tokens, current.samples):
                if samples:
                    out.sampled_token_ids[request.request_id] = fake_token(request.request_id, start + n)
            scheduler.update_from_output(current, out)
        t += 1
        assert t < 5000
    return [([r.request_id for r in so.requests], so.num_scheduled_tokens, so.num_computed_tokens, so.samples,
             sorted(so.preempted_request_ids), sorted(so.finished_request_ids)) for so in log]


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(2))
def test_decode_shortcut_schedules_like_allocate_slots(config: str, seed: int, ahead: bool) -> None:
    """The scheduler's call-free decode path (KVCacheManager.no_work_limits) against the same scheduler
    calling allocate_slots for every request: the same steps, tokens, preemptions and prefix-cache hits."""
    results = []
    for kv_class in (KVCacheManager, _NoShortcutKV):
        rng = random.Random(seed * 1000 + len(config))
        options = dict(CONFIGS[config])
        pool = BlockPool(options["num_blocks"], options["prefix"])
        kv = kv_class(pool, 4, options["prefix"])
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 5, 8]),
                                              max_num_batched_tokens=options["budget"],
                                              enable_chunked_prefill=options["chunked"]),
                              CacheConfig(block_size=4, enable_prefix_caching=options["prefix"]), kv, MAX_MODEL_LEN)
        workload = random_workload(rng, num_requests=30, max_prompt=40, max_tokens=24, shared_prefixes=True)
        if ahead:   # only requests that can step ahead: no min_tokens
            for _, request in workload:
                request.sampling_params.min_tokens = 0
        log = _drive(scheduler, workload, ahead)
        for _, request in workload:
            tokens, reason = expected_generation(request.request_id, request.prompt_token_ids, request.sampling_params)
            assert request.output_token_ids == tokens and request.finish_reason == reason
            assert request.num_pending_tokens == 0
        results.append((log, [(r.output_token_ids, r.num_cached_tokens, r.num_preemptions) for _, r in workload],
                        scheduler.num_preemptions, scheduler.prefix_cache_hit_tokens, scheduler.total_prompt_tokens,
                        scheduler.total_generated_tokens, kv.prefix_cache_hits, pool.num_cached_blocks))
    assert results[0] == results[1]


@pytest.mark.parametrize("seed", range(3))
def test_streaming_inputs_wait_without_steps_and_keep_their_blocks(seed: int) -> None:
    """Requests whose inputs arrive bit by bit (a pipeline stage's): never computed past input_limit, passed
    over while blocked without losing their blocks or blocking the others, the engine told to sleep only when
    nothing else can run; every request still produces exactly the tokens it would alone."""
    rng = random.Random(seed)
    setup = build(num_blocks=128, block_size=4, budget=16, max_num_seqs=4)
    s = setup.scheduler
    requests = [make_request(f"r{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 12))],
                             max_tokens=rng.randint(2, 8), arrival=float(i)) for i in range(7)]
    streamed = {r.request_id for r in requests[::2]}
    for r in requests:
        if r.request_id in streamed:
            r.input_limit = 0
        s.add_request(r)
    saw_sleep = False
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        for r in requests:          # inputs arrive now and then; at some point the stream ends
            if r.request_id in streamed and r.input_limit != sys.maxsize and rng.random() < 0.3:
                r.input_limit = sys.maxsize if rng.random() < 0.15 else r.input_limit + rng.randint(1, 4)
                s.inputs_changed()
        blocks_before = {r.request_id: list(r.block_ids) for r in s.running}
        so = s.schedule()
        for r, computed, n in zip(so.requests, so.num_computed_tokens, so.num_scheduled_tokens):
            assert computed + n <= r.input_limit
        scheduled = {r.request_id for r in so.requests}
        for r in s.running:
            if r.request_id not in scheduled and r.request_id in blocks_before:
                assert r.block_ids == blocks_before[r.request_id]      # passed over, blocks kept
        if so.is_empty:
            blocked = all(r.input_limit <= r.num_computed_tokens for r in s.running) and \
                all(r.input_limit == 0 for r in s.waiting)
            assert s.waiting_for_inputs == blocked and s.has_runnable_requests() != blocked
            saw_sleep |= blocked
            continue
        s.update_from_output(so, setup.runner.execute(so))
    assert not s.has_unfinished_requests()
    assert saw_sleep
    for r in requests:
        tokens, _ = expected_generation(r.request_id, r.prompt_token_ids, r.sampling_params)
        assert r.output_token_ids == tokens
    assert_all_blocks_free(setup)
