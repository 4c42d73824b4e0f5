"""Build a registered model from a HuggingFace directory and fill it from its safetensors files.

Loading is all-or-nothing: every parameter must come from the checkpoint with the expected shape,
and any problem (missing or corrupt file, missing or unexpected tensor, wrong shape, unknown
architecture) raises an error that names the file and tensor.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pellucid.distributed.parallel_state import tensor_parallel_rank_and_size
from pellucid.logger import get_logger
from pellucid.models.fp8_experts import FP8_DTYPE, SCALE_SUFFIX, quantize
from pellucid.models.kv_cache_scales import KvScaleReader
from pellucid.models.fp8_linear import (checkpoint_fp8_block, fp8_linears_enabled, keep_fp8_linears,
                                        quantized_weight_names)
from pellucid.models.parallel_layers import checkpoint_slice
from pellucid.models.quantized_checkpoint import (check_fp8_codes, checkpoint_dequantizer, read_quantization_config,
                                                  refuse_raw_codes)
from pellucid.models.registry import get_model_class

logger = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A benchmark shape without weight files: every parameter is drawn at load time (pellucid.bench.models
# writes it for shapes too large to write to disk, e.g. Qwen3-30B-A3B's 61 GB). {"seed": int}.
RANDOM_WEIGHTS_FILE = "pellucid_random_weights.json"
# Checkpoint entries that are derived state, not weights (older exports saved rotary tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def read_hf_config(model_dir: str, overrides: dict[str, Any] | None = None) -> Any:
    """The model's transformers config, with `overrides` (vLLM's hf_overrides) set on it."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    config = AutoConfig.from_pretrained(model_dir)
    _override(config, overrides or {})
    return config


def _override(config: Any, overrides: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            _override(current, value)       # a nested config (a text_config, ...): its own fields
        else:
            setattr(config, key, value)


def _materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to_empty(device=device)`, with torch.empty in place of its torch.empty_like: empty_like of a
    meta tensor runs torch's Python reference, which imports torch.fx's symbolic shapes and sympy (about
    0.6 s of every engine process's start-up). Parameters and buffers are built contiguous, so nothing of
    their layout is lost."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device | str,
               max_model_len: int | None = None, submodel: str | None = None,
               hf_overrides: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """Return (model in eval mode on `device` with every parameter loaded, hf_config).

    `submodel`: the stage of a multi-stage checkpoint to load (Qwen3-Omni's "thinker", "talker",
    "code2wav"); its model reads only its own tensors (`checkpoint_prefixes`) and the config returned is
    the one the engine sizes itself by (`engine_hf_config`, e.g. the thinker's text config). A model may
    derive parameters from the checkpoint itself (`derived_parameters`, filled by its `finish_loading(model_dir)`
    once every other parameter is loaded)."""
    hf_config = read_hf_config(model_dir, hf_overrides)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{os.path.join(model_dir, 'config.json')} names no architecture (`architectures` is empty)")
    model_class = get_model_class(architectures[0], submodel)
    _, tp_size = tensor_parallel_rank_and_size()
    if tp_size > 1 and not getattr(model_class, "supports_tensor_parallel", False):
        raise NotImplementedError(f"{architectures[0]} does not support tensor parallelism yet "
                                  f"(tensor_parallel_size={tp_size}); serve it with tensor_parallel_size=1")
    # Build without allocating or initialising weights; every parameter is then filled from the checkpoint.
    model = model_class(hf_config, dtype=dtype, device="meta", max_model_len=max_model_len)
    random_spec = os.path.join(model_dir, RANDOM_WEIGHTS_FILE)
    drawn = os.path.isfile(random_spec)
    if checkpoint_fp8_block(hf_config) is not None:      # PELLUCID_FP8_LINEAR=1 and a block-wise FP8 checkpoint
        keep_fp8_linears(model, hf_config, None if drawn else quantized_weight_names(
            [name for names in checkpoint_files(model_dir).values() for name in names], _param_namer(model, model_dir)))
    model = _materialize(model, device)
    model.tie_weights()  # materializing gives each module its own tensor, which unties shared weights
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
    if drawn:
        _draw_random_weights(model, random_spec)
    else:
        _load_weights(model, model_dir)
    finish = getattr(model, "finish_loading", None)
    if finish is not None:
        with torch.no_grad():
            finish(model_dir)
    model.eval()
    logger.info("loaded %s%s from %s (%s, %s)", architectures[0], f" ({submodel})" if submodel else "", model_dir,
                dtype, device)
    return model, getattr(model, "engine_hf_config", hf_config)


def _param_namer(model: nn.Module, model_dir: str) -> Callable[[str], str]:
    """checkpoint tensor name -> the name of the parameter it fills (or is part of), as _load_weights maps it."""
    params = dict(model.named_parameters())
    resolve = getattr(model, "checkpoint_target", None)
    bare = _bare_backbone_prefix(model, model_dir, params) if getattr(model, "checkpoint_prefixes", None) is None else ""

    def param_name(name: str) -> str:
        if bare and name not in params:
            name = bare + name
        target = resolve(name) if resolve is not None else None
        return target[0] if target is not None else name
    return param_name


def _load_weights(model: nn.Module, model_dir: str) -> None:
    """Fill every parameter from the checkpoint. A model may place a tensor into part of a parameter
    (`checkpoint_target(name) -> (parameter name, index)`, e.g. one expert's slice of a fused expert
    tensor); a parameter counts as loaded once tensors have filled all of its elements.

    Under tensor parallelism a sharded parameter (parallel_layers.py `tp_weights`) reads only this rank's
    slice of its checkpoint tensor from the memory-mapped file; padding rows past the checkpoint's end (a
    vocabulary padded to a multiple of the rank count) are zero."""
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    modules = dict(model.named_modules())
    tied_lm_head = "lm_head.weight" not in params
    resolve = getattr(model, "checkpoint_target", None)
    # A stage of a multi-stage checkpoint reads the tensors under its prefixes only (None: every tensor).
    prefixes = getattr(model, "checkpoint_prefixes", None)
    filled: dict[str, int] = defaultdict(int)     # parameter name -> elements written
    unexpected: list[str] = []
    bare = _bare_backbone_prefix(model, model_dir, params) if prefixes is None else ""
    first_param = next(model.parameters())
    device = first_param.device
    dequantizer = checkpoint_dequantizer(model_dir, checkpoint_files(model_dir), device, read_tensor)
    if dequantizer is not None:
        _log_quantized(model, model_dir, first_param.dtype)
    kv_scales = KvScaleReader(modules)
    with torch.no_grad():
        for path, name, stored in _iter_checkpoint(model_dir, prefixes):
            if bare and name not in params:
                name = bare + name
            if name.endswith(_IGNORED_SUFFIXES) or (tied_lm_head and name == "lm_head.weight"):
                continue
            if kv_scales.take(name, stored):
                continue
            target = resolve(name) if resolve is not None else None
            # A target may name the rank's part of the tensor too: (parameter name, index, RankSlice | None).
            param_name, index, part = (*target, None)[:3] if target is not None else (name, (), None)
            param = params.get(param_name)
            if dequantizer is not None:
                if param is not None and (param.dtype == FP8_DTYPE or param_name.endswith(SCALE_SUFFIX)):
                    check_fp8_codes(name, stored, param)    # a weight kept in FP8 (fp8_experts.py, fp8_linear.py), or its scales
                elif dequantizer.skips(name):
                    continue
                else:
                    stored = dequantizer.wrap(name, stored)
            if param is None:
                unexpected.append(f"{name} (in {os.path.basename(path)})")
                continue
            if param.dtype != FP8_DTYPE:
                refuse_raw_codes(name, stored)
            dest = param[index] if index else param
            if not index:
                module_name, _, attr = param_name.rpartition(".")
                part = checkpoint_slice(modules[module_name], attr, stored.shape)
            if part is not None:
                dim, ranges = part
                tensor = stored.read_slices(dim, ranges)
                pad = dest.shape[dim] - tensor.shape[dim]
                if pad > 0:
                    dest.narrow(dim, tensor.shape[dim], pad).zero_()
                    dest = dest.narrow(dim, 0, tensor.shape[dim])
                    filled[param_name] += param.narrow(dim, 0, pad).numel()
            else:
                tensor = stored.read()
            if tuple(tensor.shape) != tuple(dest.shape):
                where = "" if param_name == name else f" (its part of {param_name!r}, shape {tuple(param.shape)})"
                if part is not None:
                    where += f" (this rank's part {part[1]} of dim {part[0]})"
                raise ValueError(f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}{where}")
            dest.copy_(tensor)
            filled[param_name] += dest.numel()
            if filled[param_name] > param.numel():
                raise ValueError(f"checkpoint in {model_dir} fills {param_name!r} more than once (last from "
                                 f"{name!r}): it holds the same weights in two layouts")
    if unexpected:
        raise ValueError(f"checkpoint in {model_dir} has tensors the model does not use (config mismatch?): "
                         f"{_first(unexpected)}")
    if kv_scales.apply():
        logger.info("%s has calibrated KV-cache scales for %d attention layers (an FP8 KV cache applies them)",
                    model_dir, len(kv_scales.scales))
    derived = getattr(model, "derived_parameters", ())
    missing = sorted(name for name, param in params.items() if filled[name] < param.numel() and name not in derived)
    if bare and missing == ["lm_head.weight"]:
        # The backbone alone with an untied config (Qwen3-Embedding-8B ships so): an embedding model, served
        # without an LM head (heads/none.py), which refuses every request that would read its tokens.
        model.lm_head = None
        logger.warning("%s holds the backbone alone and its config does not tie the LM head to the input "
                       "embeddings: there is no LM head, so the engine serves embeddings only", model_dir)
        missing = []
    if missing:
        partial = [f"{n} ({filled[n]} of {params[n].numel()} elements)" if filled[n] else n for n in missing]
        raise ValueError(f"checkpoint in {model_dir} is missing tensors: {_first(partial)}")


def _log_quantized(model: nn.Module, model_dir: str, dtype: torch.dtype) -> None:
    total = sum(p.numel() for name, p in model.named_parameters() if not name.endswith(SCALE_SUFFIX))
    projections = sum(m.weight.numel() for m in model.modules() if getattr(m, "weight_scale", None) is not None)
    experts = sum(p.numel() for p in model.parameters() if p.dtype == FP8_DTYPE) - projections
    kept = []
    if projections:
        kept.append(f"its projections ({100.0 * projections / max(total, 1):.1f}% of the parameters, "
                    f"pellucid/models/fp8_linear.py)")
    if experts:
        w8a8 = any(getattr(module, "fp8_activations", False) for module in model.modules())
        kept.append(f"its mixture of experts' weights ({100.0 * experts / max(total, 1):.1f}%, fp8_experts.py"
                    f"{', multiplying FP8 activations: W8A8' if w8a8 else ''})")
    hint = ""
    if not projections and not fp8_linears_enabled() and (read_quantization_config(model_dir) or {}).get(
            "quant_method") == "fp8":
        hint = ("; PELLUCID_FP8_LINEAR=1 keeps its projections in FP8 too: half their memory, a dense model's "
                "batch-1 decode faster, but batched decode slower (pellucid/models/fp8_linear.py)")
    if kept:
        logger.warning("%s is a quantized checkpoint: %s stay in FP8, dequantized as the kernels read them; every "
                       "other 8-bit weight is dequantized to %s as it loads (activations stay in %s; the KV cache "
                       "too unless --kv-cache-dtype says otherwise)%s", model_dir, " and ".join(kept), dtype, dtype, hint)
    else:
        logger.warning("%s is a quantized checkpoint: its 8-bit weights are dequantized to %s as they load, so it "
                       "serves with the memory and speed of the full-precision model (FP8 is kept only for "
                       "block-wise FP8 checkpoints, where its blocks allow: pellucid/models/fp8_linear.py and "
                       "fp8_experts.py; activations stay in %s too, and the KV cache unless --kv-cache-dtype says "
                       "otherwise)%s", model_dir, dtype, dtype, hint)


def _bare_backbone_prefix(model: nn.Module, model_dir: str, params: dict[str, nn.Parameter]) -> str:
    """"model." when the checkpoint was saved from the backbone alone (transformers' `*Model`, as embedding
    models are published) and names its tensors without the backbone's prefix; else ""."""
    prefix = getattr(model, "backbone_path", "model") + "."
    names = [name for file_names in checkpoint_files(model_dir).values() for name in file_names]
    if any(name.startswith(prefix) for name in names):
        return ""
    return prefix if any(prefix + name in params for name in names) else ""


def _draw_random_weights(model: nn.Module, spec_path: str) -> None:
    """Random weights for a benchmark shape: norm weights near 1, every other parameter normal with std
    1/sqrt(fan in) (activations stay O(1) through the layers), from the file's seed."""
    with open(spec_path, encoding="utf-8") as f:
        seed = int(json.load(f).get("seed", 0))
    logger.warning("%s: drawing random weights (seed %d); this directory is a benchmark shape, not a model",
                   os.path.dirname(spec_path), seed)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(SCALE_SUFFIX) and params.get(name[:-len(SCALE_SUFFIX)]) is not None:
                continue        # drawn with its FP8 weight
            noise = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
            if param.dim() == 1:
                param.copy_(1.0 + 0.05 * noise)
            elif param.dtype == FP8_DTYPE:      # FP8 experts: the drawn weight quantized, as a checkpoint stores it
                scale = params[name + SCALE_SUFFIX]
                block = (param.shape[-2] // scale.shape[-2], param.shape[-1] // scale.shape[-1])
                codes, scales = quantize(noise * param.shape[-1] ** -0.5, block)
                param.copy_(codes)
                scale.copy_(scales)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)


def _first(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def checkpoint_files(model_dir: str) -> dict[str, list[str]]:
    """file path -> tensor names in it, from the index (sharded) or the single file."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read the shard index {index_path}: {exc}") from exc
        files: dict[str, list[str]] = defaultdict(list)
        for name, shard in weight_map.items():
            files[os.path.join(model_dir, shard)].append(name)
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {path} listed in {index_path} does not exist")
        return dict(files)
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        with _open_safetensors(single) as f:
            return {single: list(f.keys())}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in model directory {model_dir!r}")


class _StoredTensor:
    """A checkpoint tensor not read yet: all of it, or a slice (only that slice leaves the mapped file)."""

    def __init__(self, handle: Any, path: str, name: str) -> None:
        self.handle, self.path, self.name = handle, path, name
        try:
            self._slice = handle.get_slice(name)
            self.shape = tuple(self._slice.get_shape())
            self.dtype_name = self._slice.get_dtype()      # safetensors' name: "BF16", "F8_E4M3", ...
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): {exc}") from exc

    def read(self) -> torch.Tensor:
        return _get_tensor(self.handle, self.path, self.name)

    def read_slices(self, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The ranges [start, stop) of dim, concatenated along it."""
        parts = []
        for start, stop in ranges:
            index = (slice(None),) * dim + (slice(start, stop),)
            try:
                parts.append(self._slice[index])
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"cannot read {self.name!r}[{start}:{stop} of dim {dim}] from {self.path} "
                                 f"(truncated or corrupt?): {exc}") from exc
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _iter_checkpoint(model_dir: str, prefixes: tuple[str, ...] | None = None
                     ) -> Iterator[tuple[str, str, _StoredTensor]]:
    for path, names in checkpoint_files(model_dir).items():
        if prefixes is not None and not any(name.startswith(prefixes) for name in names):
            continue        # a shard of another stage: not even opened
        with _open_safetensors(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"tensor {name!r} is listed for {path} in the index but the file lacks it")
            for name in sorted(present):
                if prefixes is None or name.startswith(prefixes):
                    yield path, name, _StoredTensor(f, path, name)


def read_tensors(model_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors (CPU) from a single-file or sharded checkpoint: in their stored dtype, except
    the FP8 weights of a quantized checkpoint, which come dequantized to float32."""
    files = checkpoint_files(model_dir)
    location = {name: path for path, file_names in files.items() for name in file_names}
    missing = [name for name in names if name not in location]
    if missing:
        raise KeyError(f"checkpoint in {model_dir} has no tensor(s) {', '.join(missing)}")
    dequantizer = checkpoint_dequantizer(model_dir, files, "cpu", read_tensor)
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        with _open_safetensors(location[name]) as f:
            stored = _StoredTensor(f, location[name], name)
            if dequantizer is not None:
                stored = dequantizer.wrap(name, stored)
            refuse_raw_codes(name, stored)
            tensors[name] = stored.read()
    return tensors


def read_rows(model_dir: str, name: str, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of checkpoint tensor `name` ([len(rows), ...], CPU, stored dtype): only those rows leave the
    file."""
    location = {n: path for path, names in checkpoint_files(model_dir).items() for n in names}
    if name not in location:
        raise KeyError(f"checkpoint in {model_dir} has no tensor {name!r}")
    with _open_safetensors(location[name]) as f:
        stored = _StoredTensor(f, location[name], name)
        refuse_raw_codes(name, stored)
        return torch.cat([stored.read_slices(0, [(row, row + 1)]) for row in rows])


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors file (CPU, stored dtype)."""
    with _open_safetensors(path) as f:
        return _get_tensor(f, path, name)


class _open_safetensors:
    """safe_open that re-raises corrupt/truncated-file errors naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> Any:
        try:
            self._handle = safe_open(self.path, framework="pt", device="cpu")
            return self._handle.__enter__()
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read safetensors file {self.path} (truncated or corrupt?): {exc}") from exc

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.__exit__(*exc_info)


def _get_tensor(handle: Any, path: str, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): {exc}") from exc


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json as a dict ({} when the model has none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as exc:
        raise ValueError(f"cannot parse {path}: {exc}") from exc


def read_eos_token_ids(model_dir: str, hf_config: Any | None = None) -> set[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id, else config.json's (int or list)."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    if eos is None:
        config = hf_config if hf_config is not None else read_hf_config(model_dir)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}
