"""The writer with several threads: every sample lands exactly once, intact, whatever order the threads
finish in; the manifest lists exactly the files on disk."""
from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch

from pellucid.extraction import ExtractionError, HiddenStatesDataset, read_manifest
from pellucid.extraction.staging import HostStager, StagedStates
from pellucid.extraction.writer import DatasetWriter, SampleRecord
from tests.extraction.conftest import DiskFillsUp


def _records(seed: int, count: int, layers: int = 3, hidden: int = 16) -> list[SampleRecord]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(count):
        n = int(torch.randint(1, 40, (1,), generator=g))
        columns = [torch.randn(n, hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]
        ids = torch.randint(0, 1000, (n,), generator=g)
        # Alternate the three forms a record's states come in: columns, a stacked tensor, staged columns.
        states = (columns, torch.stack(columns, dim=1), HostStager().stage(columns))[i % 3]
        records.append(SampleRecord(f"s{seed}-{i}", ids, states, prompt_length=n // 2))
    return records


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shard_size", [1, 3])
def test_threads_write_each_sample_once_and_intact(tmp_path, monkeypatch, seed, shard_size):
    import pellucid.extraction.writer as writer_module

    original = writer_module.atomic_write
    delays = iter(torch.rand(1000, generator=torch.Generator().manual_seed(seed)).tolist())

    def jittered(path, data, **kwargs):    # threads finish out of submission order
        time.sleep(0.01 * next(delays))
        original(path, data, **kwargs)
    monkeypatch.setattr(writer_module, "atomic_write", jittered)

    records = _records(seed, 20)
    expected = {}
    for r in records:
        states = r.hidden_states.hidden_states if isinstance(r.hidden_states, StagedStates) else r.hidden_states
        expected[r.sample_id] = (torch.stack(states, dim=1) if isinstance(states, list) else states.clone(),
                                 r.input_ids.clone())
    writer = DatasetWriter(str(tmp_path), {"layers": [0, 1, 2]}, shard_size=shard_size, num_threads=4)
    for r in records:
        writer.add(r)
    writer.close()

    entries = read_manifest(str(tmp_path))
    assert sorted(e["id"] for e in entries) == sorted(expected)                  # each once
    files = {n for n in os.listdir(tmp_path) if n.endswith(".safetensors")}
    assert files == {e["file"] for e in entries} == set(writer.files_written)
    assert len(files) == -(-len(records) // shard_size)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    for item in HiddenStatesDataset(str(tmp_path)):
        states, ids = expected[item["id"]]
        assert torch.equal(item["hidden_states"], states)
        assert torch.equal(item["input_ids"], ids)


def test_num_threads_is_checked(tmp_path):
    with pytest.raises(ValueError, match="num_threads"):
        DatasetWriter(str(tmp_path), {"layers": [0]}, num_threads=0)


class _CannotTruncate(DiskFillsUp):
    def ftruncate(self, fd, length):
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shard_size", [1, 3])
@pytest.mark.parametrize("truncate_fails", [False, True])
def test_failed_manifest_append_leaves_whole_lines_and_the_true_count(tmp_path, monkeypatch, seed, shard_size,
                                                                       truncate_fails):
    import pellucid.extraction.writer as writer_module

    records = _records(seed, 15)
    # The third append to the manifest (and any later one) fails half written.
    manifest = (lambda path: os.path.basename(path) == "manifest.jsonl")
    monkeypatch.setattr(writer_module, "os", (_CannotTruncate if truncate_fails else DiskFillsUp)(2, manifest))
    writer = DatasetWriter(str(tmp_path), {"layers": [0, 1, 2]}, shard_size=shard_size, num_threads=3)
    try:
        for r in records:
            writer.add(r)      # raises once it notices the failure (or the failure comes later)
    except ExtractionError:
        pass
    with pytest.raises(ExtractionError, match="disk is full") as info:
        writer.close()         # as the job does: the report with the final count
    monkeypatch.undo()
    raw = (tmp_path / "manifest.jsonl").read_bytes()
    entries = read_manifest(str(tmp_path))
    if truncate_fails:
        # The half-written append stays, but no line was appended after it (read_manifest parsed every
        # line), and a rerun drops its torn end.
        assert raw.count(b"\n") == len(entries)
    else:
        assert raw.endswith(b"\n") and all(json.loads(line) for line in raw.splitlines())    # no partial line
        assert f"The {len(entries)} samples listed in manifest.jsonl" in str(info.value)
    assert 0 < len(entries) < len(records)
    # A new writer (a rerun) removes the files whose lines were cut off; the rest of the samples follow.
    writer = DatasetWriter(str(tmp_path), {"layers": [0, 1, 2]}, shard_size=shard_size, num_threads=3)
    assert writer.done_ids == {e["id"] for e in entries}
    for r in _records(seed, 15):
        if r.sample_id not in writer.done_ids:
            writer.add(r)
    writer.close()
    entries = read_manifest(str(tmp_path))
    assert sorted(e["id"] for e in entries) == sorted(r.sample_id for r in records)
    assert {n for n in os.listdir(tmp_path) if n.endswith(".safetensors")} == {e["file"] for e in entries}
    for item in HiddenStatesDataset(str(tmp_path)):
        assert item["hidden_states"].shape[0] == item["input_ids"].shape[0]
