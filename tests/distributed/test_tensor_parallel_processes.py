"""Tensor-parallel processes on the CPU: ranks started by torchrun (env:// rendezvous) serve as the engine's
own workers do; a worker killed mid-generation fails the requests in flight with an error naming it and
ends the engine (no process left behind); a configuration no rank can run is a clear start-up error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pellucid import LLM, SamplingParams
from pellucid.bench.serve import child_pids
from pellucid.engine.core_client import EngineDeadError, EngineStartupError
from tests.server.server_harness import REPO_ROOT, cmdline, free_port, wait_gone

ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64)


@pytest.mark.parametrize("busy", [True, False], ids=["generating", "idle"])
def test_a_killed_worker_fails_the_requests_and_ends_the_engine(tiny_model_factory, busy):
    """Killed mid-generation: the requests in flight fail with the cause. Killed while the engine idles: the
    engine ends by itself at once (its watchdog), and the next request fails with the cause."""
    llm = LLM(tiny_model_factory("qwen3", num_hidden_layers=2), tensor_parallel_size=2, **ENGINE)
    engine = llm.client.pid
    workers = [pid for pid in child_pids(engine)
               if "pellucid.distributed.worker" in cmdline(pid)]
    assert len(workers) == 1
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    outcome: dict[str, BaseException] = {}

    def generate() -> None:
        try:
            llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
        except BaseException as exc:
            outcome["error"] = exc
    thread = threading.Thread(target=generate)
    deadline = time.monotonic() + 30
    if busy:
        thread.start()
        while llm.client.latest_stats.generation_tokens_total == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    os.kill(workers[0], signal.SIGKILL)
    if not busy:
        while llm.client.dead_reason is None:     # reported by the engine process before it exits
            assert time.monotonic() < deadline
            time.sleep(0.01)
        thread.start()
    thread.join(30)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, EngineDeadError), error
    assert "tensor-parallel worker rank 1 was killed by SIGKILL" in str(error)
    wait_gone([engine, *workers], timeout=20)
    llm.shutdown()


def test_a_model_the_ranks_cannot_split_is_a_startup_error(tiny_model_factory):
    # 4 attention heads over 3 ranks: every rank refuses to build its shard, and says why.
    with pytest.raises(EngineStartupError, match=r"num_attention_heads \(4\) must be divisible by "
                                                 r"tensor_parallel_size \(3\)"):
        LLM(tiny_model_factory("qwen3", num_hidden_layers=2), tensor_parallel_size=3, **ENGINE)


def test_ranks_launched_by_torchrun_generate_as_tp1(tiny_model_factory):
    """`torchrun --nproc-per-node 2 -m pellucid generate ... --tensor-parallel-size 2`: rank 0 runs the
    engine, rank 1 becomes its worker; both exit 0 and the text equals the one-process engine's."""
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    prompts = ["the quick brown fox", "hello world"]
    flags = ["--model", model, "--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64",
             "--max-tokens", "8", "--ignore-eos"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "pellucid", "generate", *prompts, *flags,
                           "--tensor-parallel-size", "2"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = LLM(model, **ENGINE).generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                             use_tqdm=False)
    for prompt, out in zip(prompts, expected):
        assert f"--- prompt: {prompt!r} (8 tokens, finish: length)\n{out.outputs[0].text}\n" in done.stdout
    assert done.stdout.count("--- prompt:") == len(prompts)      # printed by rank 0 only


def test_torchrun_nodes_with_other_pellucid_settings_are_a_startup_error(tiny_model_factory):
    """Two torchrun "nodes" (on this machine), the second started with PELLUCID_MERGED_PROJ=0: its rank would
    compute its shard with other kernels than rank 0, so rank 0's command fails at start-up, naming the variable."""
    model = tiny_model_factory("qwen3", num_hidden_layers=2)
    port = free_port()
    base = {name: value for name, value in os.environ.items() if not name.startswith("PELLUCID_")}
    base["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    nodes = []
    # The log level may differ between ranks; merged projections may not.
    for node_rank, extra in ((0, {}), (1, {"PELLUCID_MERGED_PROJ": "0", "PELLUCID_LOG_LEVEL": "DEBUG"})):
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "pellucid", "generate",
             "hello", "--model", model, "--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64",
             "--max-tokens", "4", "--tensor-parallel-size", "2"],
            cwd=REPO_ROOT, env=dict(base, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert nodes[0].returncode != 0, outputs[0][1][-3000:]
    expected = "PELLUCID_MERGED_PROJ: rank 0 has 'unset', this rank '0'"
    assert expected in outputs[0][1], outputs[0][1][-3000:]        # rank 0's engine reports rank 1's error
    assert "PELLUCID_LOG_LEVEL:" not in outputs[0][1]
    assert "--- prompt:" not in outputs[0][0]
