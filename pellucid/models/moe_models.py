"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is the Llama-style decoder of llama.py whose layers' `mlp` is a `SparseMoeBlock` (moe.py), or, for
the layers a Qwen config keeps dense (`mlp_only_layers`, `decoder_sparse_step`), a dense gated MLP of
`intermediate_size`. Checkpoints load in either expert layout (expert_weights.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pellucid.models.expert_weights import ExpertCheckpointNames
from pellucid.models.fp8_experts import fp8_expert_activations, fp8_expert_block
from pellucid.models.layers import GatedMLP
from pellucid.models.llama import AttentionOptions, LlamaForCausalLM
from pellucid.models.moe import MoeSpec, SparseMoeBlock
from pellucid.models.parallel_layers import unit_shard
from pellucid.models.qwen3 import Qwen3ForCausalLM
from pellucid.models.registry import register_model


def _num_experts(hf_config: Any) -> int:
    # transformers 5 maps `num_experts` to `num_local_experts` for some configs; either name is accepted.
    value = getattr(hf_config, "num_experts", None)
    if value is None:
        value = getattr(hf_config, "num_local_experts", None)
    if not value or value < 1:
        raise ValueError(f"mixture-of-experts config has no usable expert count (num_experts={value!r})")
    return int(value)


class MoeCausalLM(LlamaForCausalLM):
    """Shared by the mixture-of-experts architectures: which layers are sparse and how they route."""

    shared_expert = False           # Qwen2-MoE: a dense shared expert next to the routed ones
    weights_in_logits_dtype = True  # Qwen: routing weights rounded to the logits' dtype

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        num_experts, top_k = _num_experts(hf_config), int(hf_config.num_experts_per_tok)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
        return MoeSpec(num_experts, top_k, cls.normalize_top_k(hf_config), cls.weights_in_logits_dtype)

    @classmethod
    def normalize_top_k(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "norm_topk_prob", False))

    @classmethod
    def is_sparse_layer(cls, hf_config: Any, layer_idx: int) -> bool:
        """transformers' rule: not in mlp_only_layers, and every decoder_sparse_step-th layer (1-based)."""
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        return layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0

    @classmethod
    def expert_intermediate_size(cls, hf_config: Any) -> int:
        return int(hf_config.moe_intermediate_size)

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        if not cls.is_sparse_layer(hf_config, layer_idx):
            return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, False, dtype, device)
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if cls.shared_expert else 0
        inter = cls.expert_intermediate_size(hf_config)
        shard = unit_shard(inter, "moe_intermediate_size")
        fp8_block = fp8_expert_block(hf_config, layer_idx, hf_config.hidden_size, inter, shard)
        fp8_activations = fp8_block is not None and fp8_expert_activations(hf_config)
        return SparseMoeBlock(cls.moe_spec(hf_config), hf_config.hidden_size, inter, shared, dtype, device, fp8_block,
                              fp8_activations)

    @classmethod
    def checkpoint_names(cls) -> ExpertCheckpointNames:
        return ExpertCheckpointNames()

    def checkpoint_target(self, name: str) -> tuple[str, tuple[Any, ...]] | None:
        """Where a checkpoint tensor goes: (parameter name, index into it), or None when it is the parameter
        of the same name (pellucid.models.loader asks)."""
        return self.checkpoint_names().target(name, self._expert_intermediate,
                                              unit_shard(self._expert_intermediate, "moe_intermediate_size"),
                                              self._fp8_blocks.get(name.split(".experts.")[0]))

    @functools.cached_property
    def _fp8_blocks(self) -> dict[str, tuple[int, int]]:
        """Checkpoint prefix of each layer's `mlp` whose experts stay in FP8 -> their block (fp8_experts.py); the
        layers are fixed once built, and the loader asks once per checkpoint tensor."""
        blocks = {}
        for i, layer in enumerate(self.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if getattr(experts, "fp8_block", None) is not None:
                for alias in ("mlp", *self.checkpoint_names().block_aliases):
                    blocks[f"model.layers.{i}.{alias}"] = experts.fp8_block
        return blocks

    @property
    def _expert_intermediate(self) -> int:
        return self.expert_intermediate_size(self.config)

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


@register_model("Qwen3MoeForCausalLM")
@register_model("Qwen3MoeModel")      # the backbone alone (see llama.py)
class Qwen3MoeForCausalLM(MoeCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return Qwen3ForCausalLM.attention_options(hf_config)     # Qwen3's attention, q/k norms included


@register_model("Qwen2MoeForCausalLM")
@register_model("Qwen2MoeModel")
class Qwen2MoeForCausalLM(MoeCausalLM):
    shared_expert = True

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), o_bias=False)


@register_model("MixtralForCausalLM")
@register_model("MixtralModel")
class MixtralForCausalLM(MoeCausalLM):
    weights_in_logits_dtype = False     # transformers' Mixtral router keeps the weights in float32

    @classmethod
    def normalize_top_k(cls, hf_config: Any) -> bool:
        return True

    @classmethod
    def is_sparse_layer(cls, hf_config: Any, layer_idx: int) -> bool:
        return True

    @classmethod
    def expert_intermediate_size(cls, hf_config: Any) -> int:
        return int(hf_config.intermediate_size)

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def checkpoint_names(cls) -> ExpertCheckpointNames:
        # Published Mixtral checkpoints: block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down).
        return ExpertCheckpointNames(block_aliases=("block_sparse_moe",), gate="w1", up="w3", down="w2")
