"""Layers shared by the decoder models: RMSNorm, rotary embedding, the gated SiLU MLP, merged projections.

Plain torch with HuggingFace-equivalent numerics. On CUDA (pellucid.kernels.fused_kernels_enabled)
`rms_norm`, `add_rms_norm`, `RotaryEmbedding.forward`, `qk_norm_rotary` and `GatedMLP.forward` run
fused Triton kernels that round at the same points; the CPU always runs the torch code.

Linear layers (`Linear`, `MergedLinear`) run decode-sized products (few rows) as skinny Triton GEMMs on
CUDA (pellucid.kernels.skinny_gemm); `Linear` still is the module that runs, so its site is untouched.

Fast paths skip module calls (a merged GEMM instead of gate_proj and up_proj, a fused kernel instead of
act_fn), so each one runs only while `is_observed` says no hook watches the modules it skips; otherwise
the module-by-module path runs and every HuggingFace site fires with its exact value.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from pellucid.attention.fused_kv_store import FusedKVStore
from pellucid.kernels import fused_kernels_enabled

# Rope types whose frequencies do not depend on the sequence being processed. "dynamic" (NTK) and
# "longrope" switch frequencies with the batch's length, which has no per-request meaning in a
# continuous batch, so they are refused rather than approximated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def is_observed(*modules: nn.Module) -> bool:
    """True when a forward (pre-)hook, the module's own or a global one, watches any of `modules`.

    Tracing (pellucid.tracing) observes a site by hooking its module, for eager forwards and CUDA-graph
    captures alike, so this is the one test every fast path uses before skipping a module call.
    """
    from torch.nn.modules import module as module_impl
    if module_impl._global_forward_hooks or module_impl._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def merged_projections_enabled() -> bool:
    """PELLUCID_MERGED_PROJ=0 runs q/k/v and gate/up as separate GEMMs (to measure what merging buys)."""
    setting = os.environ.get("PELLUCID_MERGED_PROJ", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"PELLUCID_MERGED_PROJ must be 0 or 1, got {setting!r}")
    return setting == "1"


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor, kernel: str, k: int, silu_mul: bool = False) -> bool:
    """True when `kernel` (a skinny GEMM) is enabled for x's device and its shapes are decode-sized.

    Depends on shapes, dtypes and strides only, so a CUDA-graph capture records the same choice each time.
    """
    if x.dim() != 2 or not fused_kernels_enabled(x, kernel):
        return False
    from pellucid.kernels.skinny_gemm import SUPPORTED_DTYPES, pick_config
    return (x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype and x.stride(-1) == 1
            and weight.is_contiguous() and weight.shape[1] == k
            and pick_config(x.shape[0], weight.shape[0], k, silu_mul) is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """nn.functional.linear; on CUDA a decode-sized x (few rows) runs the skinny GEMM instead of cuBLAS. With
    `scale`, weight holds float8 codes with these block scales (pellucid.models.fp8_linear)."""
    if scale is not None:
        from pellucid.models.fp8_linear import fp8_linear
        return fp8_linear(x, weight, scale, bias)
    if skinny_gemm_applies(x, weight, "skinny_gemm", x.shape[-1]) and (bias is None or bias.is_contiguous()):
        from pellucid.kernels.skinny_gemm import linear as skinny_linear
        return skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (skinny GEMM for decode batches on CUDA).

    Same parameters, names and hooks as nn.Linear: the module still runs, so its site sees the real
    input and output. A projection of a block-wise FP8 checkpoint may keep its weight as float8 codes with a
    `weight_scale_inv` parameter of block scales (`keep_fp8`, pellucid.models.fp8_linear).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)

    @property
    def weight_scale(self) -> torch.Tensor | None:
        """The block scales of a weight kept in FP8 (None for a weight in the model's dtype)."""
        return self._parameters.get("weight_scale_inv")

    def fp8_fits(self, block: tuple[int, int]) -> bool:
        """Whether [bn, bk] blocks tile this weight, and under tensor parallelism each rank's part of it."""
        rows, cols = self.weight.shape
        if rows % block[0] or cols % block[1]:
            return False
        spec = getattr(self, "tp_weights", {}).get("weight")
        return spec is None or (len(spec) == 2 and _block_shard(spec, self.weight.shape, block) is not None)

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight as float8 e4m3 codes and float32 block scales `weight_scale_inv` [N / bn, K / bk] (on
        the weight's device: the meta device, before the model is materialized and loaded)."""
        if not self.fp8_fits(block):
            raise ValueError(f"blocks of {list(block)} do not tile a weight of shape {tuple(self.weight.shape)}")
        rows, cols = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty((rows // block[0], cols // block[1]), dtype=torch.float32,
                                                         device=device), requires_grad=False)
        spec = getattr(self, "tp_weights", {}).get("weight")
        if spec is not None:
            self.tp_weights = dict(self.tp_weights, weight_scale_inv=(spec[0], _block_shard(spec, (rows, cols), block)))

    # A kernel that computes this layer inside another (a fused SiLU + down projection) passes `local_bias`
    # and hands its result to `reduce`: a row-parallel layer (parallel_layers.RowParallelLinear) adds its
    # bias after summing the ranks' partial products instead.
    @property
    def local_bias(self) -> torch.Tensor | None:
        return self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output, before `reduce` (the output itself without tensor parallelism).
        Skips the module call: only while nothing observes the module."""
        return linear(x, self.weight, self.local_bias, self.weight_scale)


def _block_shard(spec: tuple[int, Any], shape: Sequence[int], block: tuple[int, int]) -> Any:
    """A rank's part of a weight (tp_weights spec (dim, Shard of units)) counted in scale blocks along dim, or None
    when the part does not start and end on blocks."""
    from pellucid.models.fp8_experts import scale_shard
    from pellucid.distributed.parallel_state import Shard

    dim, shard = spec
    unit = shape[dim] // shard.length
    side = block[dim]
    elements = Shard(tuple(start * unit for start in shard.starts), shard.length * unit, shard.total * unit,
                     shard.rank)
    if any(value % side for value in (*elements.starts, elements.length, elements.total)):
        return None
    return scale_shard(elements, side)


class Embedding(nn.Embedding):
    """nn.Embedding without its random initialisation. Every model is built on the meta device and then filled
    from its checkpoint (models/loader.py), so the draw is wasted, and on the meta device torch's `normal_`
    imports torch._dynamo: about a second of an engine process's start-up where nothing else imports it."""

    def reset_parameters(self) -> None:
        pass


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, written as copies into one new tensor: models are built on the meta
    device, where torch.cat (unlike empty and copy_) imports torch._dynamo, as Embedding's init would."""
    out = parts[0].new_empty((sum(part.shape[0] for part in parts), *parts[0].shape[1:]))
    offset = 0
    for part in parts:
        out[offset:offset + part.shape[0]].copy_(part)
        offset += part.shape[0]
    return out


class MergedLinear:
    """Several nn.Linear modules reading one input, stored as row blocks of one weight (and bias).

    Each linear keeps its own Parameter (so `named_parameters()` lists the HuggingFace names and the loader
    fills them as usual), but that Parameter is a view into the merged storage, so one GEMM computes
    every output. Not an nn.Module: it adds no site and no parameter name. Whoever owns the linears calls
    `merge()` again after anything that reallocates parameters (`to`, `to_empty`: see `_apply` overrides).
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        has_bias = {linear.bias is not None for linear in linears}
        if len(has_bias) != 1:
            raise ValueError("merged linears must all have a bias or all have none")
        self.linears = tuple(linears)
        self.sizes = [linear.out_features for linear in linears]
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None     # block scales of FP8 codes (pellucid.models.fp8_linear)
        self._pointers: tuple[int, ...] = ()
        self.merge()

    def merge(self) -> None:
        """Copy the linears' current values into fresh merged storage and make their parameters views of it."""
        with torch.no_grad():
            self.weight = _stacked([linear.weight for linear in self.linears])
            self.bias = _stacked([linear.bias for linear in self.linears]) if self.linears[0].bias is not None \
                else None
            scales = [getattr(linear, "weight_scale", None) for linear in self.linears]
            if any(scale is not None for scale in scales) and any(scale is None for scale in scales):
                raise ValueError("merged linears must all keep FP8 weights or none")
            self.scale = _stacked(scales) if scales[0] is not None else None
            offset = scale_offset = 0
            for linear, size in zip(self.linears, self.sizes):
                linear.weight = nn.Parameter(self.weight[offset:offset + size], linear.weight.requires_grad)
                if self.bias is not None:
                    linear.bias = nn.Parameter(self.bias[offset:offset + size], linear.bias.requires_grad)
                if self.scale is not None:
                    rows = linear.weight_scale_inv.shape[0]
                    linear.weight_scale_inv = nn.Parameter(self.scale[scale_offset:scale_offset + rows], False)
                    scale_offset += rows
                offset += size
        self._pointers = self._current_pointers()

    def _current_pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for linear in self.linears
                     for p in (linear.weight, linear.bias, getattr(linear, "weight_scale", None)) if p is not None)

    def merged_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the merged storage, after checking the linears still view it."""
        if self._current_pointers() != self._pointers:
            raise RuntimeError("a merged projection's parameters were replaced after merging (their storage moved); "
                               "call merge() on it after reassigning weights")
        return self.weight, self.bias

    def merged_output(self, x: torch.Tensor) -> torch.Tensor:
        """One GEMM's [T, sum(out_features)] result: the linears' outputs side by side."""
        return linear(x, *self.merged_parameters(), self.scale)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The linears' outputs, as column views of one GEMM's [T, sum(out_features)] result."""
        return list(self.merged_output(x).split(self.sizes, dim=-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in float32, cast back to the input dtype, then scale."""
    if fused_kernels_enabled(x, "rms_norm"):
        from pellucid.kernels.rms_norm import rms_norm as fused_rms_norm
        return fused_rms_norm(x, weight, eps)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@dataclass(frozen=True)
class TopKRows:
    """An MLP output left unsummed: token t's output is the sum of rows[t * top_k : (t + 1) * top_k] ([T * top_k,
    hidden]; a mixture of experts' weighted expert outputs). The residual add + RMSNorm after it sums them.
    `partial`: under tensor parallelism, this rank's part, which the ranks' all-reduce sums too."""

    rows: torch.Tensor
    top_k: int
    partial: bool = False

    def summed(self) -> torch.Tensor:
        """[T, hidden]: each token's rows added in float32 in row order, rounded once (as the fused kernels do)."""
        rows = self.rows.view(-1, self.top_k, self.rows.shape[-1])
        total = rows[:, 0].to(torch.float32)
        for j in range(1, self.top_k):
            total = total + rows[:, j].to(torch.float32)
        return total.to(self.rows.dtype)


class TopKRowsMlp(nn.Module):
    """An MLP whose output is a per-token sum of top_k rows and that can hand over the rows unsummed.

    A decoder layer whose residual add + RMSNorm follows the MLP asks `top_k_rows_apply(x, fused_reduction)`;
    when it says yes, it calls `forward_top_k_rows(x)` instead of the module, and the add + norm kernel sums the
    rows (pellucid.kernels.add_rms_norm.add_top_k_rms_norm): the MLP's own top-k sum launch is gone. Under
    tensor parallelism the rows are this rank's part (`TopKRows.partial`), and only the fused all-reduce + add +
    norm (`fused_reduction`: parallel_layers.fused_reduction_applies) may take them. An implementation says
    yes only while no hook observes a module the call skips (its own output included).
    """

    def top_k_rows_apply(self, x: torch.Tensor, fused_reduction: bool = False) -> bool:
        raise NotImplementedError

    def forward_top_k_rows(self, x: torch.Tensor) -> TopKRows:
        raise NotImplementedError


def add_rms_norm(x: torch.Tensor | TopKRows, residual: torch.Tensor, norm: RMSNorm, after_top_k: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, norm(residual + x)) in one kernel on CUDA, without calling `norm`'s module; x may be
    a TopKRows, summed first. `after_top_k`: x is a TopKRowsMlp's summed output (the path taken when its rows
    are observed), normed with the bits of the path that sums the rows here.

    Callers use it only while `norm` is not observed (`is_observed`); it does not fire norm's hooks.
    """
    if fused_kernels_enabled(residual, "add_rms_norm"):
        from pellucid.kernels import add_rms_norm as kernels
        if isinstance(x, TopKRows):
            return kernels.add_top_k_rms_norm(x.rows, x.top_k, residual, norm.weight, norm.variance_epsilon)
        return kernels.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, like_top_k=after_top_k)
    total = residual + (x.summed() if isinstance(x, TopKRows) else x)
    return total, rms_norm(total, norm.weight, norm.variance_epsilon)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


class GatedMLP(nn.Module):
    """down_proj(act_fn(gate_proj(x)) * up_proj(x)), the Llama/Qwen/Mistral MLP.

    `act_fn` is a module, as in HuggingFace, so `mlp.act_fn` is a traceable site; a fused
    silu-and-mul kernel must keep that site observable when it is traced. gate_proj and up_proj share
    one merged weight (`gate_up`), so unobserved they cost one GEMM.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        # Under tensor parallelism gate/up hold this rank's columns and down_proj sums the ranks' parts.
        from pellucid.models.parallel_layers import column_linear, mark_sites, row_linear, unit_shard
        factory = {"dtype": dtype, "device": device}
        what = "intermediate_size"
        self.gate_proj = column_linear(hidden_size, intermediate_size, 1, bias, **factory, what=what)
        self.up_proj = column_linear(hidden_size, intermediate_size, 1, bias, **factory, what=what)
        self.down_proj = row_linear(intermediate_size, 1, hidden_size, bias, **factory, what=what)
        self.act_fn = nn.SiLU()
        shard = unit_shard(intermediate_size, what)
        if shard is not None:
            mark_sites(self.act_fn, shard, "input", "output")
        self.gate_up = MergedLinear([self.gate_proj, self.up_proj])

    def _apply(self, fn: Any, recurse: bool = True) -> "GatedMLP":
        # `to`, `to_empty`, `half`, ... give each parameter its own new tensor: merge them again.
        super()._apply(fn, recurse)
        self.gate_up.merge()
        return self

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: under tensor parallelism, this rank's partial sums of the down projection, left for
        the caller's fused all-reduce (which then skips the `down_proj` and `mlp` calls: only while nothing
        observes them)."""
        merged = merged_projections_enabled() and not is_observed(self.gate_proj, self.up_proj)
        # Decode batches: silu(gate) * up is computed inside the down projection's GEMM, which skips the
        # `act_fn` and `down_proj` calls, so only while nothing observes either.
        if (merged and not is_observed(self.act_fn, self.down_proj)
                and skinny_gemm_applies(x, self.down_proj.weight, "skinny_silu_down", self.down_proj.in_features, True)):
            from pellucid.kernels.skinny_gemm import silu_mul_linear
            down = self.down_proj
            partial = silu_mul_linear(self.gate_up.merged_output(x), down.weight, down.local_bias)
            return down.reduce(partial) if reduce else partial
        # Otherwise silu(gate) * up can be the epilogue of the gate/up GEMM (skipping `act_fn` only).
        if (merged and not is_observed(self.act_fn)
                and skinny_gemm_applies(x, self.gate_up.weight, "skinny_gate_up_silu", x.shape[-1])):
            from pellucid.kernels.skinny_paired import gate_up_silu_linear
            return self._down(gate_up_silu_linear(x, *self.gate_up.merged_parameters()), reduce)
        if merged:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # The fused kernel skips the `act_fn` call, so it runs only while nothing observes that site.
        if fused_kernels_enabled(x, "silu_and_mul") and not is_observed(self.act_fn):
            from pellucid.kernels.silu_and_mul import silu_and_mul as fused_silu_and_mul
            return self._down(fused_silu_and_mul(gate, up), reduce)
        return self._down(self.act_fn(gate) * up, reduce)

    def _down(self, hidden: torch.Tensor, reduce: bool) -> torch.Tensor:
        return self.down_proj(hidden) if reduce else self.down_proj.partial(hidden)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim] (the neox / HF "rotate_half" layout)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rope_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32, CPU) and the cos/sin scaling, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = _head_dim(hf_config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim))
        return inv_freq, 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(attention_scaling)


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position up to `max_positions`, indexed by absolute position.

    One instance is shared by all attention layers of a model. The table is a non-persistent float32
    buffer; `rebuild_buffers()` recomputes it after the model is materialised from the meta device.
    """

    def __init__(self, hf_config: Any, max_positions: int, device: torch.device | str) -> None:
        super().__init__()
        self.inv_freq_cpu, self.attention_scaling = rope_inv_freq(hf_config)
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", self._compute_cache(torch.device("cpu")).to(device), persistent=False)

    def _compute_cache(self, device: torch.device) -> torch.Tensor:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq_cpu.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling))

    def rebuild_buffers(self) -> None:
        self.cos_sin_cache = self._compute_cache(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                kv_store: FusedKVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, heads, head_dim] and key [T, kv_heads, head_dim] at positions [T].

        On CUDA the fused kernel rotates query and key in place (they are fresh projections that only
        this call consumes) and returns them; given `kv_store` it also stores the keys and values in the
        KV cache (pellucid.attention.fused_kv_store). The torch path leaves `kv_store` unstored.
        """
        if fused_kernels_enabled(query, "rotary") and query.stride(-1) == 1 and key.stride(-1) == 1:
            from pellucid.kernels.rotary import rotary_inplace
            rotary_inplace(positions, query, key, self.cos_sin_cache, kv_store)
            return query, key
        cos = self.cos_sin_cache[0].index_select(0, positions)
        sin = self.cos_sin_cache[1].index_select(0, positions)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def qk_norm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_norm: RMSNorm,
                   k_norm: RMSNorm, rotary_emb: RotaryEmbedding, kv_store: FusedKVStore | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_emb(positions, q_norm(query), k_norm(key)); one in-place kernel on CUDA while neither norm
    is observed, which also fills `kv_store` when given. query [T, heads, D] and key [T, kv_heads, D] must
    be fresh (only this call consumes them)."""
    if (fused_kernels_enabled(query, "qk_norm_rotary") and not is_observed(q_norm, k_norm)
            and query.stride(-1) == 1 and key.stride(-1) == 1):
        from pellucid.kernels.qk_norm_rotary import qk_norm_rotary_inplace
        qk_norm_rotary_inplace(positions, query, key, q_norm.weight, k_norm.weight, q_norm.variance_epsilon,
                               k_norm.variance_epsilon, rotary_emb.cos_sin_cache, kv_store)
        return query, key
    return rotary_emb(positions, q_norm(query), k_norm(key), kv_store=kv_store)
