"""The sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral), with HuggingFace's module paths.

`model.layers.N.mlp` is a `SparseMoeBlock`:

- `mlp.gate`: the router, a bias-free linear layer: normed hidden [T, hidden] -> router logits
  [T, num_experts] (transformers 5's router module returns (logits, scores, indices); its first element
  is this module's output);
- `mlp.routing`: the routing decision, Pellucid's own site (no parameters): router logits -> per token
  the weight of every expert in the MLP's output [T, num_experts], the chosen top-k experts carrying
  their routing weights and every other expert 0. It runs as a module only while something observes it;
  otherwise the routing (softmax, top-k, renormalisation) runs inside the fused kernels;
- `mlp.experts`: the experts, weights stored as transformers 5 holds them in memory: `gate_up_proj`
  [E, 2 * moe_intermediate, hidden] (gate rows, then up rows) and `down_proj` [E, hidden, moe_intermediate].
  Input: the normed hidden states; output: the routing-weighted sum of the chosen experts' outputs;
- Qwen2-MoE also has `mlp.shared_expert` (a dense gated MLP) and `mlp.shared_expert_gate` ([hidden] -> 1,
  through a sigmoid), added to the experts' output.

Routing equals transformers: softmax over the router logits in float32, `torch.topk`, optional
renormalisation of the chosen probabilities, and (Qwen) the weights rounded to the logits' dtype. The
CPU expert loop is transformers' eager one (chosen experts in increasing order, `index_add_` into the
output), so logits match to float32 rounding and ties in top-k break the same way. On CUDA the routing
and experts run as fused Triton kernels (pellucid.kernels.fused_moe) with no host sync, inside CUDA graphs.

Under tensor parallelism every rank holds every expert's share of the intermediate columns and the router
whole; `mlp.experts` all-reduces its partial sums, so every site keeps its full value (parallel_layers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pellucid.distributed.parallel_state import get_tensor_parallel
from pellucid.kernels import fused_kernels_enabled
from pellucid.models.fp8_experts import FP8_DTYPE, dequantize, fake_quantized_activations, scale_grid, scale_shard
from pellucid.models.layers import GatedMLP, Linear, TopKRows, TopKRowsMlp, is_observed
from pellucid.models.parallel_layers import unit_shard


@dataclass(frozen=True)
class MoeSpec:
    """How one architecture routes tokens to experts."""

    num_experts: int
    top_k: int
    normalize_top_k: bool           # renormalise the chosen experts' probabilities to sum to 1
    weights_in_logits_dtype: bool   # Qwen rounds the routing weights to the logits' dtype; Mixtral keeps float32

    def weights_dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        return logits_dtype if self.weights_in_logits_dtype else torch.float32


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, routing weights [T, k]) from router logits [T, E], as transformers computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(spec.weights_dtype(logits.dtype))


def dense_routing(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E]: each token's routing weight per expert (0 for the experts it did not choose)."""
    dense = torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return dense.scatter_(1, ids.long(), weights)


class TopKRouting(nn.Module):
    """`mlp.routing`: router logits [T, E] -> routing weights per expert [T, E] (0 where not chosen).

    Its output is what the experts use: the block runs, for each token, the experts with the largest
    weights in it (the chosen ones), each weighted by its value there. Edits that keep the chosen set
    (`scale` by a per-expert factor to ablate an expert, `zero`) are therefore exact; edits that would
    put weight on experts the token did not choose are refused (`site_edit_kinds`): change the choice by
    editing the router logits (`mlp.gate.output`) instead.
    """

    site_edit_kinds = {"output": ("scale", "zero", "apply")}

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(ids [T, k], weights [T, k], the fused kernels' token layout or None) without calling the module."""
        if fused_kernels_enabled(logits, "moe"):
            from pellucid.kernels.fused_moe import route_and_align
            return route_and_align(logits.contiguous(), self.spec)
        ids, weights = route(logits, self.spec)
        return ids, weights, None

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        ids, weights, _ = self.route(logits)
        return dense_routing(ids, weights, self.spec.num_experts)

    def extra_repr(self) -> str:
        s = self.spec
        return f"num_experts={s.num_experts}, top_k={s.top_k}, normalize_top_k={s.normalize_top_k}"


class FusedExperts(nn.Module):
    """`mlp.experts`: forward(hidden [T, H], expert ids [T, k], routing weights [T, k]) -> [T, H].

    `fp8_block` [bn, bk]: the weights stay float8 codes with float32 block scales (`gate_up_proj_scale_inv`,
    `down_proj_scale_inv`), as a block-wise FP8 checkpoint stores them, dequantized as they are used;
    `fp8_activations`: and they multiply float8 activations, W8A8 (pellucid.models.fp8_experts)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, fp8_block: tuple[int, int] | None = None,
                 fp8_activations: bool = False) -> None:
        super().__init__()
        if fp8_activations and fp8_block is None:
            raise ValueError("float8 activations need FP8 expert weights (fp8_block)")
        self.fp8_activations = fp8_activations
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        # Under tensor parallelism each rank holds its share of every expert's intermediate columns (gate/up
        # rows, down columns): its output is a partial sum, all-reduced in forward (parallel_layers.py).
        self.shard = unit_shard(intermediate_size, "moe_intermediate_size")
        if self.shard is not None:
            intermediate_size = self.shard.length
            self.tp_weights = {"gate_up_proj": (1, self.shard, 2), "down_proj": (2, self.shard)}
            if fp8_block is not None:   # the scales' rows and columns of this rank's codes
                self.tp_weights.update({"gate_up_proj_scale_inv": (1, scale_shard(self.shard, fp8_block[0]), 2),
                                        "down_proj_scale_inv": (2, scale_shard(self.shard, fp8_block[1]))})
        self.intermediate_size = intermediate_size
        self.fp8_block = fp8_block
        weight_dtype = FP8_DTYPE if fp8_block is not None else dtype
        gate_up_shape = (num_experts, 2 * intermediate_size, hidden_size)
        down_shape = (num_experts, hidden_size, intermediate_size)
        trainable = fp8_block is None       # float8 codes take no gradient
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up_shape, dtype=weight_dtype, device=device), trainable)
        self.down_proj = nn.Parameter(torch.empty(down_shape, dtype=weight_dtype, device=device), trainable)
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        if fp8_block is not None:
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.empty(scale_grid(gate_up_shape, fp8_block), dtype=torch.float32, device=device),
                requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(
                torch.empty(scale_grid(down_shape, fp8_block), dtype=torch.float32, device=device),
                requires_grad=False)
        # transformers' module path; never called: SiLU runs inside the experts' computation on each expert's
        # own tokens, not once over the flat batch, so it is not a site.
        self.act_fn = nn.SiLU()

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of expert e in the model's dtype (dequantized when FP8)."""
        if self.fp8_block is None:
            return self.gate_up_proj[e], self.down_proj[e]
        assert self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None
        return (dequantize(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.dtype),
                dequantize(self.down_proj[e], self.down_proj_scale_inv[e], self.dtype))

    def _fused_weights(self) -> dict[str, Any]:
        """The fused kernels' weight arguments: the tensors, and the FP8 block scales when there are."""
        return {"gate_up": self.gate_up_proj, "down": self.down_proj, "gate_up_scale": self.gate_up_proj_scale_inv,
                "down_scale": self.down_proj_scale_inv, "quantize_activations": self.fp8_activations}

    def forward(self, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                layout: Any = None) -> torch.Tensor:
        """`layout`: the fused kernels' token layout made with `ids` by the routing kernel, if it ran."""
        if fused_kernels_enabled(hidden_states, "moe"):
            from pellucid.kernels.fused_moe import fused_experts
            out = fused_experts(hidden_states, ids=ids, weights=weights, layout=layout, **self._fused_weights())
        elif hidden_states.is_cuda:
            out = self._forward_masked(hidden_states, ids, weights)
        else:
            out = self._forward_loop(hidden_states, ids, weights)
        if self.shard is not None:
            tp = get_tensor_parallel()
            assert tp is not None
            out = tp.all_reduce(out)
        return out

    def forward_rows(self, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     layout: Any = None) -> TopKRows:
        """The fused kernels' output before their top-k sum (SparseMoeBlock.forward_top_k_rows); under tensor
        parallelism this rank's part, not all-reduced (`TopKRows.partial`)."""
        if not fused_kernels_enabled(hidden_states, "moe"):
            raise ValueError("the experts' unsummed rows exist only on the fused kernels' path")
        from pellucid.kernels.fused_moe import fused_expert_rows
        rows = fused_expert_rows(hidden_states, ids=ids, weights=weights, layout=layout, **self._fused_weights())
        return TopKRows(rows, ids.shape[1], partial=self.shard is not None)

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.fp8_activations:
            return self._expert_w8a8(x, e)
        gate_up, down = self.expert_weights(e)
        gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return nn.functional.linear(nn.functional.silu(gate) * up, down)

    def _expert_w8a8(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """The W8A8 kernels' arithmetic: each GEMM's input quantized per token and K block and dequantized, times
        the dequantized weights, in float32; each GEMM's output rounded to the model's dtype."""
        assert self.fp8_block is not None and self.gate_up_proj_scale_inv is not None
        assert self.down_proj_scale_inv is not None
        group = self.fp8_block[1]
        gate_up = dequantize(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], torch.float32)
        down = dequantize(self.down_proj[e], self.down_proj_scale_inv[e], torch.float32)
        gate, up = (fake_quantized_activations(x, group) @ gate_up.T).to(x.dtype).chunk(2, dim=-1)
        return (fake_quantized_activations(nn.functional.silu(gate) * up, group) @ down.T).to(x.dtype)

    def _forward_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """transformers' eager loop: each chosen expert in increasing order on its tokens (reads the ids on the host)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            contribution = self._expert(x[token], e) * weights[token, slot, None]
            out.index_add_(0, token, contribution.to(out.dtype))
        return out

    def _forward_masked(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by 0 where not chosen: no host read, so CUDA graphs capture it.
        Only for PELLUCID_FUSED_KERNELS without `moe` (debugging); it costs num_experts / top_k times the work."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            weight = torch.where(ids == e, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
            out += (self._expert(x, e) * weight.sum(dim=-1, keepdim=True)).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_block is None else f", fp8_block={list(self.fp8_block)}"
        fp8 += ", fp8_activations=True" if self.fp8_activations else ""
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}{fp8}"


class SparseMoeBlock(TopKRowsMlp):
    """`mlp` of a mixture-of-experts layer: experts(x, route(gate(x))) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)].

    Without a shared expert and on the fused kernels' path it can hand its experts' rows to the residual add +
    RMSNorm after it unsummed (TopKRowsMlp), while neither it nor `experts` is observed: on one rank, or under
    tensor parallelism to the fused all-reduce + add + norm.
    """

    def __init__(self, spec: MoeSpec, hidden_size: int, intermediate_size: int, shared_intermediate_size: int,
                 dtype: torch.dtype, device: torch.device | str, fp8_block: tuple[int, int] | None = None,
                 fp8_activations: bool = False) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.spec = spec
        self.gate = Linear(hidden_size, spec.num_experts, bias=False, **factory)
        self.routing = TopKRouting(spec)
        self.experts = FusedExperts(spec.num_experts, hidden_size, intermediate_size, **factory, fp8_block=fp8_block,
                                    fp8_activations=fp8_activations)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, **factory)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False, **factory)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, *self._route(hidden_states))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out

    def top_k_rows_apply(self, x: torch.Tensor, fused_reduction: bool = False) -> bool:
        on_one_rank = self.experts.shard is None and fused_kernels_enabled(x, "add_rms_norm_top_k")
        return (self.shared_expert is None and (on_one_rank or (self.experts.shard is not None and fused_reduction))
                and fused_kernels_enabled(x, "moe") and not is_observed(self, self.experts))

    def forward_top_k_rows(self, x: torch.Tensor) -> TopKRows:
        return self.experts.forward_rows(x, *self._route(x))

    def _route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(expert ids [T, k], routing weights [T, k], the fused kernels' token layout or None)."""
        logits = self.gate(hidden_states)
        if is_observed(self.routing):
            # The experts run for the largest weights of the (possibly edited) routing decision: the chosen
            # experts, or those of them an edit kept (the others weigh 0 and add nothing).
            weights, ids = self.routing(logits).topk(self.spec.top_k, dim=-1)
            return ids, weights, None
        return self.routing.route(logits)
