"""Output format, resume, and bad input: clear errors, nothing written lost or corrupted, resumable."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from pellucid.extraction import ExtractionError, HiddenStatesDataset, read_manifest
from pellucid.extraction.writer import model_fingerprint
from tests.extraction.conftest import DiskFillsUp, random_prompts, relative_error

LAYERS = [0, 2, -1]


def _records(seed: int, count: int) -> list[dict]:
    lengths = torch.Generator().manual_seed(seed)
    sizes = torch.randint(5, 40, (count,), generator=lengths).tolist()
    return [{"id": f"s{seed}-{i}", "prompt_token_ids": p} for i, p in enumerate(random_prompts(seed, sizes))]


def _by_id(out_dir) -> dict[str, dict]:
    return {item["id"]: item for item in HiddenStatesDataset(str(out_dir))}


def _assert_complete_and_equal(out_dir, reference_dir, records) -> None:
    entries = read_manifest(str(out_dir))
    assert sorted(e["id"] for e in entries) == sorted(r["id"] for r in records)      # no gaps, no duplicates
    names = set(os.listdir(out_dir))
    assert not [n for n in names if n.endswith(".tmp")]
    assert {n for n in names if n.endswith(".safetensors")} == {e["file"] for e in entries}
    got, want = _by_id(out_dir), _by_id(reference_dir)
    for record in records:
        a, b = got[record["id"]], want[record["id"]]
        assert a["input_ids"].tolist() == record["prompt_token_ids"]
        assert a["hidden_states"].shape == b["hidden_states"].shape
        assert relative_error(a["hidden_states"], b["hidden_states"]) <= 1e-5


@pytest.fixture(scope="module")
def llm(make_ext_llm):
    return make_ext_llm("llama")


@pytest.fixture(scope="module")
def reference(llm, tmp_path_factory):
    """One uninterrupted run over all records, to compare interrupted-and-resumed runs with."""
    records = _records(1, 12)
    out = tmp_path_factory.mktemp("reference")
    llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(out), progress=False)
    return records, out


def test_file_format_and_header(llm, tmp_path, ext_model_dir):
    records = _records(2, 5)
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), shard_size=2, progress=False)
    assert len(summary.files) == 3 and summary.num_samples == 5
    entries = read_manifest(str(tmp_path))
    for name in summary.files:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            meta = f.metadata()
            assert json.loads(meta["layers"]) == LAYERS
            assert meta["dtype"] == "float32" and meta["model"] == ext_model_dir("llama")
            assert meta["fingerprint"] == model_fingerprint(ext_model_dir("llama"))
            ids = json.loads(meta["sample_ids"])
            for j, sample_id in enumerate(ids):
                entry = next(e for e in entries if e["id"] == sample_id)
                assert entry["file"] == name and entry["prefix"] == f"{j}/"
                assert f.get_tensor(f"{j}/hidden_states").shape == (entry["num_tokens"], 3, 64)
                assert f.get_tensor(f"{j}/input_ids").dtype == torch.int64
                assert int(f.get_tensor(f"{j}/prompt_length")) == entry["num_tokens"]


def test_resume_skips_samples_in_the_manifest(llm, reference, tmp_path):
    records, ref_dir = reference
    first = llm.extract_hidden_states(records[:5], layers=LAYERS, output_dir=str(tmp_path), progress=False)
    assert first.num_samples == 5
    second = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), progress=False)
    assert second.num_already_done == 5 and second.num_samples == len(records) - 5
    _assert_complete_and_equal(tmp_path, ref_dir, records)


def test_restart_repairs_what_a_killed_job_left(llm, reference, tmp_path):
    """A torn manifest line, a data file written but never listed, a temporary file: the restarted job
    drops / removes them and rewrites those samples."""
    records, ref_dir = reference
    llm.extract_hidden_states(records[:4], layers=LAYERS, output_dir=str(tmp_path), progress=False)
    entries = read_manifest(str(tmp_path))
    last = entries[-1]
    raw = (tmp_path / "manifest.jsonl").read_bytes()
    # Kill between writing the file and completing its manifest line: the line is torn.
    (tmp_path / "manifest.jsonl").write_bytes(raw[:raw.rstrip(b"\n").rfind(b"\n") + 1] + b'{"id": "s1-')
    (tmp_path / "sample-00000099.safetensors").write_bytes(b"garbage from a killed job")
    (tmp_path / ".sample-00000100.safetensors.1234.tmp").write_bytes(b"partial")
    assert [e["id"] for e in read_manifest(str(tmp_path))] == [e["id"] for e in entries[:-1]]
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), progress=False)
    assert summary.num_already_done == 3
    assert last["id"] in [e["id"] for e in read_manifest(str(tmp_path))]
    _assert_complete_and_equal(tmp_path, ref_dir, records)


@pytest.mark.parametrize("shard_size", [1, 3])
def test_disk_full_midway_then_resume(llm, reference, tmp_path, monkeypatch, shard_size):
    import pellucid.extraction.writer as writer_module

    records, ref_dir = reference
    # Data files fail half written from the third on.
    data_file = (lambda path: ".safetensors." in path and path.endswith(".tmp"))
    monkeypatch.setattr(writer_module, "os", DiskFillsUp(2, data_file))
    with pytest.raises(ExtractionError, match="disk is full") as info:
        llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), shard_size=shard_size,
                                  progress=False)
    assert "rerun the same job to resume" in str(info.value)
    monkeypatch.undo()
    entries = read_manifest(str(tmp_path))
    assert len(entries) == 2 * shard_size
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    for item in HiddenStatesDataset(str(tmp_path)):         # what was written before the failure is intact
        assert item["hidden_states"].shape[0] == len(item["input_ids"])
    assert llm.engine.has_unfinished_requests() is False    # the failed job's requests were aborted
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), shard_size=shard_size,
                                        progress=False)
    assert summary.num_already_done == 2 * shard_size
    _assert_complete_and_equal(tmp_path, ref_dir, records)


def test_unwritable_output_directory(llm, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ExtractionError, match="not writable"):
        llm.extract_hidden_states(_records(3, 2), layers=LAYERS, output_dir=str(blocker / "out"), progress=False)


@pytest.mark.parametrize("layers, message", [([3], "out of range"), ([0, -2], "out of range"),
                                             ([1, 1], "must not repeat"), ([], "non-empty"), (["2"], "integers")])
def test_bad_layers_fail_before_anything_is_written(llm, tmp_path, layers, message):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        llm.extract_hidden_states(_records(3, 2), layers=layers, output_dir=str(out), progress=False)
    assert not out.exists()


def test_sample_longer_than_max_model_len(make_ext_llm, tmp_path):
    llm = make_ext_llm("llama", max_model_len=48)
    records = _records(4, 6)
    records[3] = {"id": "too-long", "prompt_token_ids": random_prompts(9, [60])[0]}
    with pytest.raises(ExtractionError, match="'too-long'.*60 tokens.*max_model_len=48"):
        llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), progress=False)
    assert not llm.engine.has_unfinished_requests()
    summary = llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), progress=False,
                                        skip_invalid=True)
    assert list(summary.invalid) == ["too-long"]
    assert sorted(e["id"] for e in read_manifest(str(tmp_path))) == sorted(r["id"] for r in records if r["id"] != "too-long")


def test_resume_with_other_settings_is_refused(llm, tmp_path):
    llm.extract_hidden_states(_records(5, 2), layers=LAYERS, output_dir=str(tmp_path), progress=False)
    with pytest.raises(ExtractionError, match="layers"):
        llm.extract_hidden_states(_records(5, 3), layers=[1], output_dir=str(tmp_path), progress=False)


def test_one_job_per_directory(llm, tmp_path):
    from pellucid.extraction.writer import DatasetWriter

    holder = DatasetWriter(str(tmp_path), {"layers": LAYERS}, background=False)
    try:
        with pytest.raises(ExtractionError, match="another extraction job"):
            DatasetWriter(str(tmp_path), {"layers": LAYERS}, background=False)
    finally:
        holder.close()


def test_duplicate_ids_are_refused(llm, tmp_path):
    records = [{"id": "a", "prompt": "hello"}, {"id": "a", "prompt": "world"}]
    with pytest.raises(ValueError, match="appears twice"):
        llm.extract_hidden_states(records, layers=LAYERS, output_dir=str(tmp_path), progress=False)


def test_written_files_load_with_safetensors_itself(tmp_path):
    """The writer lays out safetensors bytes itself (no serialized copy); safetensors must read them back
    bit for bit, for every dtype a sample uses."""
    from safetensors.torch import load_file

    from pellucid.extraction.writer import atomic_write, safetensors_parts

    gen = torch.Generator().manual_seed(0)
    tensors = {"hidden_states": torch.randn(7, 3, 5, generator=gen).to(torch.bfloat16),
               "h16": torch.randn(2, 3, generator=gen).half(), "h32": torch.randn(4, generator=gen),
               "input_ids": torch.randint(0, 500, (7,), generator=gen), "prompt_length": torch.tensor(4),
               "loss_mask": torch.rand(7, generator=gen) > 0.5, "empty": torch.empty(0, 5)}
    path = str(tmp_path / "x.safetensors")
    atomic_write(path, safetensors_parts(tensors, {"k": "v"}))
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"k": "v"}
