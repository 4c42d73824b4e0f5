"""The Llama-style decoder (Llama, Mistral, Qwen2; Qwen3 adds per-head q/k norms in qwen3.py).

Module paths equal HuggingFace's (model.layers.N.self_attn.q_proj, ...), every module takes and returns
one tensor in the flat token layout [num_tokens, ...], and a decoder layer returns the residual stream
HuggingFace reports in `hidden_states[N + 1]`. The forward returns the final normed hidden states;
the runner applies the LM head (`lm_head`) through pellucid.heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pellucid.attention.layer import Attention
from pellucid.attention.metadata import get_forward_context
from pellucid.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pellucid.models.registry import register_model


@dataclass(frozen=True)
class AttentionOptions:
    """How an architecture's attention block differs from Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False       # Qwen3: RMSNorm over head_dim on q and k before rotary


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(nn.Module):
    """`self_attn`: normed hidden [T, hidden] -> o_proj output [T, hidden]."""

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, options: AttentionOptions,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = _head_dim(hf_config)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=options.qkv_bias, **factory)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=options.qkv_bias, **factory)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=options.qkv_bias, **factory)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=options.o_bias, **factory)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, **factory)
        self.rotary_emb = rotary_emb    # shared by all layers; named_modules() lists it once
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx, self.head_dim ** -0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        query = self.q_proj(hidden_states).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary_emb(get_forward_context().positions[:num_tokens], query, key)
        return self.o_proj(self.attn(query, key, value))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, options: AttentionOptions,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)
        self.self_attn = DecoderAttention(hf_config, layer_idx, rotary_emb, options, **factory)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)
        self.mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                            bool(getattr(hf_config, "mlp_bias", False)), **factory)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        residual = residual + self.self_attn(self.input_layernorm(residual))
        return residual + self.mlp(self.post_attention_layernorm(residual))


class DecoderModel(nn.Module):
    """`model`: token ids [T] -> final normed hidden states [T, hidden]."""

    def __init__(self, hf_config: Any, options: AttentionOptions, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size, **factory)
        self.rotary_emb = RotaryEmbedding(hf_config, max_positions, device)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, i, self.rotary_emb, options, **factory) for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Constructor `(hf_config, dtype, device, max_model_len=None)`; forward(input_ids [T]) -> hidden [T, hidden].

    Positions and attention state come from the forward context (pellucid.attention.metadata).
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        max_model_len = max_model_len or hf_config.max_position_embeddings
        check_supported_config(hf_config, max_model_len)
        self.config = hf_config
        self.model = DecoderModel(hf_config, self.attention_options(hf_config),
                                  max(max_model_len, hf_config.max_position_embeddings), dtype, device)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False, dtype=dtype, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head.weight with the embedding when the config says so (again after `to_empty`)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return _head_dim(self.config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def check_supported_config(hf_config: Any, max_model_len: int) -> None:
    """Refuse configs this implementation would silently compute differently from HuggingFace."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported (only 'silu')")
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    uses_window = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if uses_window and window < max_model_len:
        raise NotImplementedError(
            f"sliding-window attention (sliding_window={window}) is not implemented and would change results for "
            f"sequences longer than the window; set max_model_len <= {window} to serve this model")


register_model("LlamaForCausalLM")(LlamaForCausalLM)


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions()


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
