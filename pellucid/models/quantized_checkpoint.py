"""Quantized checkpoints: which formats load, and their weights dequantized as they are read.

A checkpoint whose config.json has a `quantization_config` stores some weights as 8-bit codes with scales.
Two families load, both symmetric 8-bit weights, dequantized as code * the scale of the code's block:
- `quant_method: "fp8"` (transformers' FineGrainedFP8; the official Qwen3-*-FP8, DeepSeek-V3 style): weight
  `X.weight` in float8, [..., N, K], scales `X.weight_scale_inv`, [..., ceil(N / bn), ceil(K / bk)] for
  `weight_block_size` [bn, bk].
- `quant_method: "compressed-tensors"` (llm-compressor's FP8-dynamic / W8A8 checkpoints) in the formats
  "float-quantized", "int-quantized" or "naive-quantized" with 8-bit symmetric weights: `X.weight` in float8 or
  int8, scales `X.weight_scale` per tensor ([1]), per output channel ([N, 1]), per group ([N, K / g]) or per
  block (the config's `block_structure`).

The loader dequantizes each such weight to float32 on the device the model is built on, and the parameter's
copy rounds it to the model's dtype, which is what transformers' dequantizing loaders compute. Weights the
checkpoint left in full precision (the router, the LM head, ...) have no scales and load as they are.
Activation scales (`input_scale`, ...) are for 8-bit compute and are skipped: the model runs in its dtype. KV-cache
scales (`k_scale`, `v_scale`, ...) go to the attention layers (pellucid.models.kv_cache_scales), for an FP8 KV cache.

So a quantized checkpoint serves with the memory and speed of its full-precision original, with one
exception: a block-wise FP8 checkpoint (quant_method "fp8") keeps its quantized projections (pellucid.models.
fp8_linear) and its mixture of experts' weights (pellucid.models.fp8_experts) in FP8 where their blocks allow, and
the kernels dequantize them as they read them. The loader's warning says how much stays in FP8. Every other format (AWQ, GPTQ, 4-bit packs, zero points,
sparsity, rotations, ...) is refused by name, and a weight stored in an 8-bit or integer type without its
scales is an error, never a silent cast of the raw codes.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from pellucid.models.config_file import read_config_json

# safetensors dtype names a parameter may be copied from as stored.
FLOAT_DTYPE_NAMES = ("F64", "F32", "F16", "BF16")
# Tensors of 8-bit compute (activation and KV-cache scales): not weights of a model that runs in its dtype.
_COMPUTE_SCALE_SUFFIXES = (".input_scale", ".activation_scale", ".output_scale", ".k_scale", ".v_scale",
                           ".q_scale", ".prob_scale")
_COMPRESSED_TENSORS_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


class WeightDequantizer:
    """Pairs a checkpoint's 8-bit weights with their scales (`name + scale_suffix`) and dequantizes them when
    read."""

    def __init__(self, scale_suffix: str, block: tuple[int, int] | None, scale_paths: dict[str, str],
                 device: torch.device | str, read_tensor: Callable[[str, str], torch.Tensor]) -> None:
        self.scale_suffix = scale_suffix
        self.block = block
        self.scale_paths = scale_paths          # scale tensor name -> its file
        self.device = torch.device(device)
        self.read_tensor = read_tensor          # (file, tensor name) -> the tensor as stored

    def skips(self, name: str) -> bool:
        """True for a tensor that is not a weight of the model: a weight's scales, a compute scale."""
        return name.endswith(self.scale_suffix) or name.endswith(_COMPUTE_SCALE_SUFFIXES)

    def wrap(self, name: str, stored: Any) -> Any:
        """The stored tensor as the loader should read it: dequantized when it has scales."""
        scale_name = name + self.scale_suffix
        if scale_name not in self.scale_paths:
            return stored
        return _DequantizedTensor(stored, self, self.scale_paths[scale_name], scale_name)


class _DequantizedTensor:
    """A quantized checkpoint weight read as float32: code * the scale of its block. Has the loader's read API."""

    def __init__(self, stored: Any, dequantizer: WeightDequantizer, scale_path: str, scale_name: str) -> None:
        self.stored, self.dequantizer, self.scale_path, self.scale_name = stored, dequantizer, scale_path, scale_name
        self.path, self.name, self.shape = stored.path, stored.name, stored.shape
        self.dtype_name = "F32"

    def read(self) -> torch.Tensor:
        device = self.dequantizer.device
        scale = self.dequantizer.read_tensor(self.scale_path, self.scale_name)
        return dequantize_blockwise(self.stored.read().to(device), scale.to(device), self.dequantizer.block,
                                    f"{self.name!r} in {self.path}")

    def read_slices(self, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        # Shard boundaries need not fall on scale blocks (an expert's 768 rows over 3 ranks), so the whole
        # tensor is dequantized and then cut.
        full = self.read()
        return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def dequantize_blockwise(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                         what: str) -> torch.Tensor:
    """float32 [..., N, K]: quantized[..., n, k] * scale[..., n // bn, k // bk]. `block` is used when the scale
    grid is ceil(N / bn) x ceil(K / bk); otherwise the block is read off a grid that divides the weight
    (per-channel scales [N, 1], per-group [N, K / g]). One scale of one element scales the whole tensor."""
    if scale.numel() == 1:
        return quantized.float() * scale.float().reshape(())
    if quantized.dim() < 2 or scale.dim() != quantized.dim():
        raise ValueError(f"quantized weight {what} has shape {tuple(quantized.shape)} and scales of shape "
                         f"{tuple(scale.shape)}: expected one scale or a grid of block scales with the same number "
                         f"of dimensions")
    rows, cols = quantized.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:]
    leading_match = tuple(scale.shape[:-2]) == tuple(quantized.shape[:-2])
    if block is None or (scale_rows, scale_cols) != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        if not leading_match or rows % scale_rows or cols % scale_cols:
            expected = "" if block is None else f"; blocks of {list(block)} need {math.ceil(rows / block[0])} x " \
                                                f"{math.ceil(cols / block[1])}"
            raise ValueError(f"quantized weight {what} of shape {tuple(quantized.shape)} does not divide into "
                             f"the grid of its scales, of shape {tuple(scale.shape)}{expected}")
        block = (rows // scale_rows, cols // scale_cols)
    elif not leading_match:
        raise ValueError(f"quantized weight {what} of shape {tuple(quantized.shape)} has scales of shape "
                         f"{tuple(scale.shape)}")
    expanded = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block[1], dim=-1)[..., :cols]
    return quantized.float() * expanded


def read_quantization_config(model_dir: str) -> dict[str, Any] | None:
    """config.json's quantization_config (None for a full-precision checkpoint)."""
    quantization = (read_config_json(model_dir) or {}).get("quantization_config")
    return quantization if isinstance(quantization, dict) else None


def checkpoint_dequantizer(model_dir: str, files: dict[str, list[str]], device: torch.device | str,
                           read_tensor: Callable[[str, str], torch.Tensor]) -> WeightDequantizer | None:
    """The dequantizer of a quantized checkpoint (None when it is not quantized); a clear error for a format
    that does not load. `files`: file path -> tensor names (loader.checkpoint_files); weights dequantize on
    `device`."""
    quantization = read_quantization_config(model_dir)
    if quantization is None:
        return None
    where = os.path.join(model_dir, "config.json")
    method = quantization.get("quant_method")
    if method == "fp8":
        scale_suffix, block = "_scale_inv", _block_size(quantization.get("weight_block_size"), where)
    elif method == "compressed-tensors":
        scale_suffix, block = "_scale", _compressed_tensors_block(quantization, where)
    else:
        raise NotImplementedError(
            f"{where} is quantized with quant_method {method!r}, which Pellucid does not load; supported: fp8 "
            f"(block-wise FP8) and compressed-tensors with 8-bit symmetric weights, both dequantized at load. "
            f"Serve the full-precision checkpoint instead")
    scale_paths = {name: path for path, names in files.items() for name in names if name.endswith(scale_suffix)}
    return WeightDequantizer(scale_suffix, block, scale_paths, device, read_tensor)


def _block_size(block: Any, where: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{where}: the weight block size must be two positive integers, got {block!r}")
    return tuple(block)


def _compressed_tensors_block(quantization: dict[str, Any], where: str) -> tuple[int, int] | None:
    """Check that every quantized group is an 8-bit symmetric weight format this loader dequantizes; the
    block structure of block-quantized groups (None when no group is, or they differ: the grid says then)."""
    def refuse(why: str) -> NotImplementedError:
        return NotImplementedError(f"{where}: compressed-tensors checkpoint with {why}, which Pellucid does not "
                                   f"load (it dequantizes 8-bit symmetric weights: formats "
                                   f"{', '.join(_COMPRESSED_TENSORS_FORMATS)}). Serve the full-precision checkpoint "
                                   f"instead")
    if quantization.get("sparsity_config"):
        raise refuse("a sparsity config (compressed sparse weights)")
    if quantization.get("transform_config"):
        raise refuse("a transform config (rotated weights)")
    groups = quantization.get("config_groups") or {}
    if not groups and not quantization.get("kv_cache_scheme"):     # only KV-cache scales: full-precision weights
        raise refuse("no config_groups")
    blocks = set()
    for group_name, group in groups.items():
        weights = (group or {}).get("weights")
        if not weights:
            continue        # activations only: no weight to dequantize
        group_format = group.get("format") or quantization.get("format")
        if group_format not in _COMPRESSED_TENSORS_FORMATS:
            raise refuse(f"format {group_format!r} (group {group_name})")
        if weights.get("num_bits") != 8 or weights.get("type") not in ("float", "int"):
            raise refuse(f"{weights.get('num_bits')}-bit {weights.get('type')} weights (group {group_name})")
        if not weights.get("symmetric", True):
            raise refuse(f"asymmetric weights with zero points (group {group_name})")
        if weights.get("strategy") not in ("tensor", "channel", "group", "block"):
            raise refuse(f"weight strategy {weights.get('strategy')!r} (group {group_name})")
        if weights.get("strategy") == "block":
            blocks.add(_block_size(weights.get("block_structure"), where))
    return blocks.pop() if len(blocks) == 1 else None


def check_fp8_codes(name: str, stored: Any, param: torch.Tensor) -> None:
    """A tensor read as stored into a parameter kept in FP8 (fp8_experts.py, fp8_linear.py): float8 e4m3 codes into
    an FP8 weight, float scales into its scales. Anything else would be a wrong cast of the values."""
    dtype_name = getattr(stored, "dtype_name", None)
    expected = ("F8_E4M3",) if param.dtype == torch.float8_e4m3fn else FLOAT_DTYPE_NAMES
    if dtype_name is not None and dtype_name not in expected:
        what = "float8 e4m3 codes" if param.dtype == torch.float8_e4m3fn else "float block scales"
        raise ValueError(f"tensor {name!r} in {stored.path} is stored as {dtype_name}, but its parameter keeps the "
                         f"checkpoint's {what} (a block-wise FP8 checkpoint); set PELLUCID_FP8_EXPERTS=0 (experts) or "
                         f"PELLUCID_FP8_LINEAR=0 (projections) to dequantize them at load instead")


def refuse_raw_codes(name: str, stored: Any) -> None:
    """A tensor in an 8-bit or integer type that reached the loader undequantized has lost its scales: copying
    it would cast the raw codes to the model's dtype, which is not the weight."""
    dtype_name = getattr(stored, "dtype_name", None)
    if dtype_name is not None and dtype_name not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"tensor {name!r} in {stored.path} is stored as {dtype_name} without its scales (no scale "
                         f"tensor for it, or config.json has no quantization_config that names its format): it "
                         f"cannot be read as weights")
