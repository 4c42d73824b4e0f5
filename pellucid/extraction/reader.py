"""Loading extracted hidden states for training: a map-style PyTorch Dataset over the manifest.

    from pellucid.extraction import HiddenStatesDataset
    ds = HiddenStatesDataset("out/")            # the samples listed in out/manifest.jsonl
    item = ds[0]   # {"id", "hidden_states" [T, L, H], "input_ids" [T], "prompt_length", "loss_mask" [T] | absent}
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=4)

Only samples in the manifest are visible, and a manifest line is written after its file is complete,
so reading a directory while a job still writes it is safe (`refresh()` picks up new samples).
Files are memory-mapped by safetensors: indexing reads one sample's bytes, not its whole shard.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from pellucid.extraction.writer import JOB_INFO, read_manifest

FIELDS = ("hidden_states", "input_ids", "prompt_length", "loss_mask")


def read_job_info(output_dir: str) -> dict[str, Any]:
    """The directory's extraction.json: model, fingerprint, dtype, layers, hidden_size, generate."""
    with open(os.path.join(output_dir, JOB_INFO), encoding="utf-8") as f:
        return json.load(f)


def load_sample(path: str, prefix: str = "", layers: list[int] | None = None,
                all_layers: list[int] | None = None) -> dict[str, Any]:
    """One sample's tensors from a file; `layers` picks a subset of the file's layers (`all_layers`)."""
    out: dict[str, Any] = {}
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        for name in FIELDS:
            key = prefix + name
            if key in names:
                out[name] = f.get_tensor(key)
    if "hidden_states" not in out:
        raise ValueError(f"{path} has no tensor {prefix}hidden_states")
    out["prompt_length"] = int(out["prompt_length"])
    if layers is not None:
        if all_layers is None:
            raise ValueError("selecting layers needs the file's layer list (all_layers)")
        missing = [layer for layer in layers if layer not in all_layers]
        if missing:
            raise ValueError(f"layers {missing} were not extracted; this data has layers {all_layers}")
        out["hidden_states"] = out["hidden_states"][:, [all_layers.index(layer) for layer in layers]]
    return out


class HiddenStatesDataset(Dataset):
    """Samples of an extraction output directory, in manifest order (optionally a subset of layers)."""

    def __init__(self, output_dir: str, layers: list[int] | None = None) -> None:
        self.output_dir = output_dir
        self.info = read_job_info(output_dir)
        self.layers = layers
        self.entries: list[dict[str, Any]] = []
        self.refresh()

    def refresh(self) -> None:
        """Re-read the manifest (a job may still be adding samples)."""
        self.entries = read_manifest(self.output_dir)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        entry = self.entries[index]
        sample = load_sample(os.path.join(self.output_dir, entry["file"]), entry["prefix"], self.layers,
                             self.info["layers"])
        sample["id"] = entry["id"]
        return sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def collate_padded(samples: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into a batch: hidden_states [B, T, L, H], input_ids [B, T],
    attention_mask [B, T], loss_mask [B, T] (0 on padding; all ones over real tokens when absent)."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    longest = max(s["input_ids"].shape[0] for s in samples)
    first = samples[0]["hidden_states"]
    hidden = first.new_zeros((len(samples), longest, *first.shape[1:]))
    input_ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((len(samples), longest), dtype=torch.bool)
    loss = torch.zeros((len(samples), longest), dtype=torch.bool)
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        hidden[i, :n] = s["hidden_states"]
        input_ids[i, :n] = s["input_ids"]
        attention[i, :n] = True
        loss[i, :n] = s["loss_mask"] if "loss_mask" in s else True
    return {"hidden_states": hidden, "input_ids": input_ids, "attention_mask": attention, "loss_mask": loss}
