"""The FlashHead asset: a versioned safetensors file holding one head's clustering.

Tensors: `centroids` [C, H] float32 (mean raw row per cluster) and `token_ids` [C, S] int64 (-1 = padding).
Metadata: format version, C, S, vocab, hidden, and a fingerprint of the head it was built for. Loading
checks version and fingerprint and refuses a mismatch, naming both values: a stale clustering would still
run but retrieve the wrong tokens, which is exactly the silent failure this file exists to prevent.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from pellucid.heads.flashhead.clustering import PAD_TOKEN, Clustering

FORMAT_VERSION = "1"
ASSET_DIRNAME = "flashhead"
ASSET_FILENAME = "flashhead.safetensors"
_HASH_CHUNK_ROWS = 8192


class AssetMismatchError(ValueError):
    """The asset was built for another head, or by an incompatible version of this code."""


@dataclass
class FlashHeadAsset:
    centroids: torch.Tensor   # [C, H] float32
    token_ids: torch.Tensor   # [C, S] int64
    vocab_size: int
    hidden_size: int
    fingerprint: str

    @property
    def num_clusters(self) -> int:
        return self.token_ids.shape[0]

    @property
    def cluster_size(self) -> int:
        return self.token_ids.shape[1]


def head_fingerprint(weight: torch.Tensor) -> str:
    """sha256 over the head's shape and its rows rounded to bfloat16.

    Rounding to bf16 first makes the fingerprint the same whether the checkpoint is loaded in float32 or
    bfloat16 (bf16 -> fp32 is exact, and fp32 -> bf16 rounds the same way everywhere), so one asset serves
    a model on CPU and GPU alike; a change smaller than bf16 precision cannot change the clustering anyway.
    """
    digest = hashlib.sha256()
    digest.update(f"flashhead-head:vocab={weight.shape[0]}:hidden={weight.shape[1]}".encode())
    for start in range(0, weight.shape[0], _HASH_CHUNK_ROWS):
        block = weight[start:start + _HASH_CHUNK_ROWS].detach().to(torch.bfloat16).contiguous().cpu()
        digest.update(block.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def default_asset_path(model_dir: str) -> str:
    return os.path.join(model_dir, ASSET_DIRNAME, ASSET_FILENAME)


def resolve_asset_path(path: str) -> str:
    """A directory means the default file name inside it."""
    return os.path.join(path, ASSET_FILENAME) if os.path.isdir(path) else path


def save_asset(path: str, clustering: Clustering, weight: torch.Tensor) -> str:
    """Write to `path` (a .safetensors file, or a directory that gets the default file name)."""
    if not path.endswith(".safetensors"):
        path = os.path.join(path, ASSET_FILENAME)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    metadata = {"format": "pellucid-flashhead", "format_version": FORMAT_VERSION,
                "num_clusters": str(clustering.token_ids.shape[0]),
                "cluster_size": str(clustering.token_ids.shape[1]),
                "vocab_size": str(weight.shape[0]), "hidden_size": str(weight.shape[1]),
                "fingerprint": head_fingerprint(weight),
                "mean_similarity": f"{clustering.mean_similarity:.6f}"}
    save_file({"centroids": clustering.centroids.float().contiguous().cpu(),
               "token_ids": clustering.token_ids.to(torch.int64).contiguous().cpu()}, path, metadata=metadata)
    return path


def _read_metadata(path: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return dict(handle.metadata() or {})


def load_asset(path: str, weight: torch.Tensor) -> FlashHeadAsset:
    """Load and verify against the head weight it will serve; raises AssetMismatchError on any mismatch."""
    path = resolve_asset_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"FlashHead asset not found at {path}; build it with "
                                f"`pellucid flashhead build MODEL --out DIR` or pass head_options={{'asset': PATH}}")
    meta = _read_metadata(path)
    version = meta.get("format_version")
    if meta.get("format") != "pellucid-flashhead" or version != FORMAT_VERSION:
        raise AssetMismatchError(f"FlashHead asset {path} has format version {version!r} but this Pellucid "
                                 f"reads version {FORMAT_VERSION!r}; rebuild it with `pellucid flashhead build`")
    expected = head_fingerprint(weight)
    if meta.get("fingerprint") != expected:
        raise AssetMismatchError(f"FlashHead asset {path} was built for another head: asset fingerprint "
                                 f"{meta.get('fingerprint')} (vocab {meta.get('vocab_size')}, hidden "
                                 f"{meta.get('hidden_size')}) != model head fingerprint {expected} (vocab "
                                 f"{weight.shape[0]}, hidden {weight.shape[1]}); rebuild it for this model")
    tensors = load_file(path)
    asset = FlashHeadAsset(centroids=tensors["centroids"], token_ids=tensors["token_ids"],
                           vocab_size=int(meta["vocab_size"]), hidden_size=int(meta["hidden_size"]),
                           fingerprint=expected)
    _check_consistent(asset, path)
    return asset


def _check_consistent(asset: FlashHeadAsset, path: str) -> None:
    """Every token exactly once, padding only as PAD_TOKEN, shapes matching the metadata."""
    ids = asset.token_ids
    if asset.centroids.shape != (asset.num_clusters, asset.hidden_size):
        raise AssetMismatchError(f"FlashHead asset {path}: centroids shape {tuple(asset.centroids.shape)} "
                                 f"!= ({asset.num_clusters}, {asset.hidden_size})")
    real = ids[ids != PAD_TOKEN]
    if real.numel() != asset.vocab_size or not torch.equal(real.sort().values, torch.arange(asset.vocab_size)):
        raise AssetMismatchError(f"FlashHead asset {path}: token_ids do not cover each of the "
                                 f"{asset.vocab_size} tokens exactly once")
