"""Tensor-parallel ranks as Ray actors on the CPU (gloo): the engine process starts a local Ray cluster,
places rank 1 in an actor, and generates as TP=1 does; a killed actor fails the requests in flight with an
error naming its rank and ends the engine; after either end no process of the engine (Ray's included) is
left."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pellucid import LLM, SamplingParams
from pellucid.bench.serve import child_pids
from pellucid.engine.core_client import EngineDeadError, EngineStartupError
from tests.reference import random_prompts
from tests.server.server_harness import alive, cmdline, wait_gone

pytest.importorskip("ray", reason="the ray backend needs Ray (in the test extras)")

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=16,
              max_num_seqs=4)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if alive(child):
                found.append(child)
                todo.append(child)
    return found


def _rank_actor(ancestor: int) -> int:
    """The process of rank 1's actor, among the descendants of the process that started the Ray cluster: Ray
    titles an actor's process ray::RankActor.run while it runs `run` (the idle actor that holds rank 0's bundle
    is ray::RankActor)."""
    for pid in _descendants(ancestor):
        if "ray::RankActor.run" in cmdline(pid):
            return pid
    raise AssertionError(f"no ray::RankActor process under process {ancestor}")


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_ray_ranks_generate_as_tp1_and_leave_nothing_behind(tiny_model_factory):
    """Greedy tokens and seeded samples identical to the one-process engine, under chunked prefill and
    preemption; shutdown ends the actor, the local Ray cluster and the engine process."""
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    prompts = random_prompts(11, [37, 5, 22, 41, 12], vocab=500)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=s, max_tokens=10) for s in range(len(prompts))]
    tp1 = LLM(model, **ENGINE)
    expected = [[o.outputs[0].token_ids for o in tp1.generate(prompts, p, use_tqdm=False)] for p in (greedy, seeded)]
    tp2 = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    engine = tp2.client.pid
    assert _rank_actor(engine)
    try:
        got = [[o.outputs[0].token_ids for o in tp2.generate(prompts, p, use_tqdm=False)] for p in (greedy, seeded)]
    finally:
        processes = [engine, *_descendants(engine)]
        tp2.shutdown()
    assert got == expected
    wait_gone(processes, timeout=60)


def test_a_killed_ray_worker_fails_the_requests_and_ends_the_engine(tiny_model_factory):
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    engine = llm.client.pid
    processes = [engine, *_descendants(engine)]
    outcome: dict[str, BaseException] = {}

    def generate() -> None:
        try:
            llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
        except BaseException as exc:
            outcome["error"] = exc
    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 60
    while llm.client.latest_stats.generation_tokens_total == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(_rank_actor(engine), signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, EngineDeadError), error
    assert "tensor-parallel worker rank 1" in str(error) or "tensor-parallel rank 1" in str(error), str(error)
    llm.shutdown()
    wait_gone(processes, timeout=60)


def test_ray_ranks_get_the_engines_pellucid_settings(tiny_model_factory, monkeypatch):
    """On a cluster that was running before the engine (here: one this test process starts), a rank's process
    is started by the cluster, not by the engine, yet it must run with the engine's PELLUCID_ settings (which
    kernels, which log level), or ranks would differ silently."""
    import ray
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    prompt = random_prompts(12, [9], vocab=500)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = LLM(model, **ENGINE).generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for name in [name for name in os.environ if name.startswith("PELLUCID_")]:
        monkeypatch.delenv(name)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        settings = {"PELLUCID_MERGED_PROJ": "0", "PELLUCID_LOG_LEVEL": "WARNING"}
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        try:
            environment = _environment(_rank_actor(os.getpid()))
            got = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
    assert {name: environment.get(name) for name in settings} == settings
    assert got == expected


def test_a_cluster_without_the_resources_is_a_startup_error(tiny_model_factory):
    """More ranks than the local cluster has CPUs: refused before any rank starts, saying what is missing."""
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    with pytest.raises(EngineStartupError, match=r"tensor_parallel_size=512 needs 512 CPUs in the Ray cluster, "
                                                 r"it has \d+"):
        LLM(model, tensor_parallel_size=512, distributed_executor_backend="ray", **ENGINE)
