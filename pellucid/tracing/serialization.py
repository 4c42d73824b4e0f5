"""Tensors inside JSON: a safetensors file, base64-encoded, so steering vectors and saves travel over HTTP."""
from __future__ import annotations

import base64
import binascii

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save


def tensors_to_b64(tensors: dict[str, torch.Tensor]) -> str:
    """Encode named tensors (any device) as base64 safetensors bytes."""
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(safetensors_save(host)).decode("ascii")


def b64_to_tensors(text: str) -> dict[str, torch.Tensor]:
    """Decode what tensors_to_b64 produced; ValueError naming the problem for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"expected a base64 string of safetensors bytes, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"not valid base64: {exc}") from exc
    try:
        return dict(safetensors_load(raw))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"not a valid safetensors payload: {exc}") from exc
