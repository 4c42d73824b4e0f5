"""Readers racing the writer, and a job killed with SIGKILL then restarted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from safetensors import safe_open

from pellucid.extraction import HiddenStatesDataset, read_manifest
from tests.extraction.conftest import random_prompts, relative_error

LAYERS = [0, -1]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(count: int) -> list[dict]:
    prompts = random_prompts(77, [8 + (i * 7) % 30 for i in range(count)])
    return [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(prompts)]


def _slow_writes(monkeypatch, seconds: float) -> None:
    """Make every data file take a while to write, so readers and kills land mid-job."""
    import pellucid.extraction.writer as writer_module

    original = writer_module.atomic_write

    def slow(path, data, **kwargs):
        if path.endswith(".safetensors"):
            time.sleep(seconds)
        original(path, data, **kwargs)
    monkeypatch.setattr(writer_module, "atomic_write", slow)


@pytest.mark.parametrize("shard_size", [1, 4])
def test_polling_reader_never_sees_a_partial_file(make_ext_llm, tmp_path, monkeypatch, shard_size):
    llm = make_ext_llm("llama")
    records = _records(24)
    lengths = {r["id"]: len(r["prompt_token_ids"]) for r in records}
    _slow_writes(monkeypatch, 0.02)
    stop = threading.Event()
    problems: list[str] = []
    opened: set[str] = set()

    def poll() -> None:
        while not stop.is_set():
            for name in os.listdir(tmp_path):
                if not name.endswith(".safetensors"):
                    continue
                try:
                    with safe_open(str(tmp_path / name), framework="pt") as f:
                        ids = json.loads(f.metadata()["sample_ids"])
                        for j, sample_id in enumerate(ids):
                            prefix = "" if shard_size == 1 else f"{j}/"
                            tokens = f.get_tensor(prefix + "input_ids").shape[0]
                            states = f.get_tensor(prefix + "hidden_states").shape[0]
                            if not tokens == states == lengths[sample_id]:
                                problems.append(f"{name}: {sample_id} has {tokens}/{states} of {lengths[sample_id]}")
                    opened.add(name)
                except FileNotFoundError:
                    pass            # listed, then replaced: never partial
                except Exception as exc:  # a partial or corrupt file
                    problems.append(f"{name}: {type(exc).__name__}: {exc}")
            for entry in read_manifest(str(tmp_path)):          # a listed sample's file is always in place
                if not (tmp_path / entry["file"]).exists():
                    problems.append(f"manifest lists {entry['file']} before it exists")
            time.sleep(0.001)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), shard_size=shard_size,
                                  progress=False)
    finally:
        stop.set()
        reader.join()
    assert not problems, problems[:5]
    assert len(opened) >= 3


CHILD = textwrap.dedent("""
    import json, sys, time
    import pellucid.extraction.writer as writer_module
    from pellucid import LLM

    model_dir, out_dir, data_path, shard_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    original = writer_module.atomic_write
    def slow(path, data, **kwargs):
        if path.endswith(".safetensors"):
            time.sleep(0.05)
        original(path, data, **kwargs)
    writer_module.atomic_write = slow
    records = [json.loads(line) for line in open(data_path)]
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256, max_num_seqs=4)
    llm.extract_hidden_states(records, layers=%r, output_dir=out_dir, shard_size=shard_size, progress=False)
    print("finished")
""" % (LAYERS,))


@pytest.mark.parametrize("shard_size", [1, 3])
def test_sigkill_midway_then_restart(make_ext_llm, ext_model_dir, tmp_path, shard_size):
    records = _records(40)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    child = subprocess.Popen([sys.executable, "-c", CHILD, ext_model_dir("llama"), str(out), str(data), str(shard_size)],
                             env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(read_manifest(str(out))) < 3 * shard_size:
            assert child.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "the child made no progress"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    done_before = len(read_manifest(str(out)))
    assert done_before < len(records)

    llm = make_ext_llm("llama")
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(out), shard_size=shard_size,
                                        progress=False)
    assert summary.num_already_done == done_before
    entries = read_manifest(str(out))
    assert sorted(e["id"] for e in entries) == sorted(r["id"] for r in records)      # complete, no duplicates
    names = set(os.listdir(out))
    assert not [n for n in names if n.endswith(".tmp")]
    assert {n for n in names if n.endswith(".safetensors")} == {e["file"] for e in entries}

    reference = tmp_path / "reference"
    llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(reference), progress=False)
    want = {item["id"]: item for item in HiddenStatesDataset(str(reference))}
    for item in HiddenStatesDataset(str(out)):
        assert item["input_ids"].tolist() == want[item["id"]]["input_ids"].tolist()
        assert relative_error(item["hidden_states"], want[item["id"]]["hidden_states"]) <= 1e-5
