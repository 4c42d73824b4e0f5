"""A checkpoint's calibrated KV-cache scales: per attention layer, one scale for its keys and one for its values.

Checkpoints quantized for an FP8 KV cache store them beside each attention module (`model.layers.i.self_attn`), in
the names vLLM reads:
- `<attention>.k_scale` and `<attention>.v_scale` (llm-compressor / compressed-tensors with a `kv_cache_scheme`);
- `<attention>.k_proj.output_scale` and `<attention>.v_proj.output_scale` (NVIDIA ModelOpt, older exports);
- `<attention>.kv_scale`, one scale for both (AutoFP8).

The loader (pellucid.models.loader) hands each to the Attention op of that module (pellucid.attention.layer), and an
FP8 cache stores keys / k_scale and reads them back times k_scale (pellucid.attention.kv_dtype). A cache in the
model's dtype does not use them. Scales per head or per channel are refused by name: one scale per tensor is what
the kernels apply.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.attention.kv_dtype import KvScales, is_fp8
from pellucid.attention.layer import Attention
from pellucid.logger import get_logger
from pellucid.models.quantized_checkpoint import read_quantization_config

logger = get_logger(__name__)

_SUFFIXES = ((".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"), (".k_scale", "k"), (".v_scale", "v"),
             (".kv_scale", "kv"))


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """(the attention module's name, "k", "v" or "kv") for a KV-cache scale's checkpoint name; else None."""
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


class KvScaleReader:
    """Collects a checkpoint's KV-cache scales while the loader reads its tensors, then sets them on the model's
    Attention ops."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.scales: dict[str, dict[str, float]] = {}      # Attention op name -> {"k": ..., "v": ...}

    def take(self, name: str, stored: Any) -> bool:
        """Read `name` if it is a KV-cache scale of one of the model's attention layers (True); else leave it."""
        target = kv_scale_name(name)
        if target is None:
            return False
        module_name, which = target
        op_name = next((n for n in (f"{module_name}.attn", module_name)
                        if isinstance(self.modules.get(n), Attention)), None)
        if op_name is None:
            return False
        tensor = stored.read().float()
        if tensor.numel() != 1:
            raise NotImplementedError(
                f"tensor {name!r} in {stored.path} holds {tensor.numel()} KV-cache scales (shape "
                f"{tuple(tensor.shape)}): Pellucid applies one scale per layer's keys and one per its values. Serve "
                f"without an FP8 KV cache, or with a checkpoint calibrated per tensor")
        for key in ("k", "v") if which == "kv" else (which,):
            self.scales.setdefault(op_name, {})[key] = float(tensor.reshape(()))
        return True

    def apply(self) -> int:
        """Set every collected layer's scales (a layer given only one of them keeps 1.0 for the other); returns
        how many layers got scales."""
        for op_name, scales in self.scales.items():
            try:
                self.modules[op_name].kv_scales = KvScales(**scales)
            except ValueError as exc:
                raise ValueError(f"{op_name}: {exc}") from None
        return len(self.scales)


def check_kv_cache_scales(model: nn.Module, model_dir: str, kv_dtype: torch.dtype) -> None:
    """Say what a cache of `kv_dtype` does with the checkpoint's KV-cache scales, and refuse a calibration an FP8
    cache cannot apply (an integer or other-width `kv_cache_scheme`)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    scaled = sum(m.kv_scales is not None for m in layers)
    scheme = (read_quantization_config(model_dir) or {}).get("kv_cache_scheme")
    cache = str(kv_dtype).removeprefix("torch.")
    if not is_fp8(kv_dtype):
        if scaled or scheme:
            logger.info("the checkpoint is calibrated for an FP8 KV cache; this cache holds %s and needs no scales "
                        "(--kv-cache-dtype fp8 applies them)", cache)
        return
    if isinstance(scheme, dict) and (scheme.get("type", "float"), scheme.get("num_bits", 8)) != ("float", 8):
        raise ValueError(f"the checkpoint's kv_cache_scheme calibrates a {scheme.get('num_bits')}-bit "
                         f"{scheme.get('type')} KV cache, whose scales an FP8 cache cannot apply; serve it with "
                         f"--kv-cache-dtype auto")
    if scaled:
        logger.info("the %s KV cache applies the checkpoint's calibrated scales in %d of %d attention layers%s",
                    cache, scaled, len(layers), "" if scaled == len(layers) else " (the others: scale 1.0)")
    elif scheme:
        logger.warning("the checkpoint declares a kv_cache_scheme but holds no KV-cache scales Pellucid reads "
                       "(<attention>.k_scale / .v_scale, .k_proj / .v_proj.output_scale, .kv_scale): the %s cache "
                       "stores keys and values unscaled (scale 1.0)", cache)
