"""A write failure in the middle of a job is reported once, with the true number of samples listed in the
manifest, the CLI exits 1, and the data stays safe: no temporaries, every listed sample complete, and a
rerun of the same job finishes it."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import re
import resource
import subprocess
import sys
import threading
import time

import pytest

from pellucid.cli import main as cli_main
from pellucid.extraction import ExtractionError, HiddenStatesDataset, extract_hidden_states_async, read_manifest
from tests.extraction.conftest import random_prompts, relative_error

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = [0, 1, 2, -1]
COUNT = re.compile(r"The (\d+) samples listed in manifest\.jsonl are complete")


def _assert_safe(out_dir: str, records: list[dict]) -> list[dict]:
    """No temporaries, exactly the listed files, and every listed sample complete. Returns the manifest."""
    entries = read_manifest(out_dir)
    names = os.listdir(out_dir)
    assert not [n for n in names if n.endswith(".tmp")]
    assert {n for n in names if n.endswith(".safetensors")} == {e["file"] for e in entries}
    tokens = {r["id"]: r["prompt_token_ids"] for r in records}
    assert len({e["id"] for e in entries}) == len(entries)
    for item in HiddenStatesDataset(out_dir):
        assert item["input_ids"].tolist() == tokens[item["id"]]
        assert item["hidden_states"].shape[:2] == (len(tokens[item["id"]]), len(LAYERS))
    return entries


def _assert_equal_to_reference(out_dir: str, reference_dir: str, records: list[dict]) -> None:
    entries = _assert_safe(out_dir, records)
    assert sorted(e["id"] for e in entries) == sorted(r["id"] for r in records)
    want = {item["id"]: item for item in HiddenStatesDataset(reference_dir)}
    for item in HiddenStatesDataset(out_dir):
        assert relative_error(item["hidden_states"], want[item["id"]]["hidden_states"]) <= 1e-5


@pytest.fixture(scope="module")
def llm(make_ext_llm):
    return make_ext_llm("llama")


@pytest.mark.parametrize("seed", [0, 1])
def test_cli_under_a_file_size_limit_reports_once_with_the_true_count(ext_model_dir, llm, tmp_path, seed):
    """The issue's repro: `ulimit -f` lets the short samples' files through but not the long one's."""
    rng = random.Random(seed)
    lengths = [300] + [rng.randint(5, 30) for _ in range(60)]
    records = [{"id": f"s{i}", "prompt_token_ids": p} for i, p in enumerate(random_prompts(seed, lengths))]
    data = tmp_path / "io.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    argv = ["extract", ext_model_dir("llama"), "--data", str(data), "--layers", ",".join(map(str, LAYERS)),
            "--out", str(out), "--max-num-seqs", "4", "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "128", "--no-progress"]
    # 300 tokens x 4 layers x 64 floats = 300 KB: over the limit; a short sample's file is at most 30 KB.
    limit = 146 * 1024

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "pellucid", *argv], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 1, done.stderr
    reported = [line for line in done.stderr.splitlines() if not line.startswith("INFO ")]
    assert len(reported) == 1, done.stderr
    assert reported[0].startswith(f"error: writing to {str(out)!r} failed: [Errno {errno.EFBIG}]")
    assert "rerun the same job to resume" in reported[0]
    entries = _assert_safe(str(out), records)
    assert int(COUNT.search(reported[0]).group(1)) == len(entries)
    assert "s0" not in {e["id"] for e in entries}
    # The same command without the limit finishes the job; the result equals an uninterrupted run.
    assert cli_main(argv) == 0
    reference = tmp_path / "reference"
    llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(reference), progress=False)
    _assert_equal_to_reference(str(out), str(reference), records)


class _FailingWrites:
    """Stands in for the writer's atomic_write: the `fail_at`-th file fails at once, the others take a
    while, so they are still being written (and are committed later) when the job notices the failure."""

    def __init__(self, real, fail_at: int) -> None:
        self.real, self.fail_at = real, fail_at
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, path, data, sync_directory=True):
        with self.lock:
            self.calls += 1
            call = self.calls
        if call == self.fail_at:
            raise OSError(errno.EFBIG, "File too large")
        time.sleep(0.3)
        return self.real(path, data, sync_directory=sync_directory)


@pytest.mark.parametrize("driver", ["llm", "async_llm"])
@pytest.mark.parametrize("seed", [0, 1])
def test_failure_noticed_while_other_files_commit_is_reported_once_with_the_final_count(
        llm, ext_model_dir, tmp_path, monkeypatch, caplog, driver, seed):
    import pellucid.extraction.writer as writer_module

    rng = random.Random(seed)
    records = [{"id": f"r{i}", "prompt_token_ids": p}
               for i, p in enumerate(random_prompts(seed + 10, [rng.randint(4, 24) for _ in range(16)]))]
    out = str(tmp_path / "out")
    # Call 1 writes extraction.json; the data files of calls 2 and 3 are in flight when call 4 fails.
    writes = _FailingWrites(writer_module.atomic_write, fail_at=4)
    monkeypatch.setattr(writer_module, "atomic_write", writes)
    caplog.set_level(logging.INFO, logger="pellucid")
    with pytest.raises(ExtractionError) as info:
        if driver == "llm":
            llm.extract_hidden_states(records, layers=LAYERS, output_dir=out, progress=False)
        else:
            from pellucid.engine.async_llm import AsyncLLM
            # The engine core in this process: the failing writes are patched in here.
            async_llm = AsyncLLM(ext_model_dir("llama"), dtype="float32", device="cpu", num_kv_blocks=128,
                                 engine_process=False)
            try:
                asyncio.run(extract_hidden_states_async(async_llm, records, layers=LAYERS, output_dir=out))
            finally:
                async_llm.shutdown()
    monkeypatch.undo()
    message = str(info.value)
    assert "File too large" in message and "rerun the same job to resume" in message
    # Reported once: nothing else logged as an error, no second exception chained in.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    if driver == "llm":     # the engine core's writer in the caller's thread: its OSError is the cause
        assert info.value.__cause__ is not None and isinstance(info.value.__cause__, OSError)
    else:                   # the engine loop's thread answers the close with the error's message
        assert info.value.__cause__ is None
    assert info.value.__suppress_context__
    entries = _assert_safe(out, records)
    # The files started before the failure were committed after the job noticed it: they count.
    assert int(COUNT.search(message).group(1)) == len(entries) >= 2
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=out, progress=False)
    assert summary.num_already_done == len(entries) and summary.num_samples == len(records) - len(entries)
    assert sorted(e["id"] for e in _assert_safe(out, records)) == sorted(r["id"] for r in records)
