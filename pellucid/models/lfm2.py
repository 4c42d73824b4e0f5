"""LFM2 (Liquid AI): a hybrid decoder whose layers are either attention or a gated short convolution.

`config.layer_types[i]` is "full_attention" or "conv". Module paths equal transformers' `Lfm2ForCausalLM`
(model.layers.N.self_attn.q_layernorm, model.layers.N.conv.in_proj, model.layers.N.feed_forward.w1,
model.layers.N.operator_norm, model.embedding_norm, ...), every module takes and returns one tensor in
the flat token layout [num_tokens, ...], and a decoder layer returns the residual stream transformers
reports in `hidden_states[N + 1]`.

A conv layer needs each request's last `conv_L_cache - 1` inputs from earlier steps. That state lives in
a pool owned by the model runner (pellucid.runner.state_pool), one slot per running request, found
through the forward context (pellucid.models.recurrent_state). Attention KV alone cannot restore it, so
this model does not use the prefix cache (`supports_prefix_caching = False`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.attention.layer import Attention
from pellucid.attention.metadata import get_forward_context
from pellucid.models.layers import Embedding, RMSNorm, RotaryEmbedding, silu_and_mul
from pellucid.models.recurrent_state import current_recurrent_state
from pellucid.models.registry import register_model

LAYER_TYPES = ("full_attention", "conv")


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def mlp_intermediate_size(hf_config: Any) -> int:
    """The feed-forward width as transformers derives it from the block_* options."""
    size = hf_config.intermediate_size
    if hf_config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if hf_config.block_ffn_dim_multiplier is not None:
            size = int(hf_config.block_ffn_dim_multiplier * size)
            multiple = hf_config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         state_pool: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                         num_computed_tokens: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Causal depthwise conv over a flat batch of request chunks, continuing each request's saved inputs.

    x [T, C] (rows past query_start_loc[num_reqs] are padding), weight [C, K], state_pool [slots, C, K-1]
    holding each request's last K-1 inputs in time order. A request whose chunk starts at position 0
    starts from zeros. Writes every request's new last K-1 inputs back to its slot; returns [T, C].

    Each request's chunk is laid out after its K-1 saved inputs in one extended tensor, so one gather per
    tap computes prefill chunks, decodes and any mix of them without a per-request loop or host read.
    """
    num_rows, channels = x.shape
    kernel = weight.shape[1]
    history = kernel - 1
    device = x.device
    starts = query_start_loc[: num_reqs + 1].to(torch.int64)
    rows = torch.arange(num_rows, device=device)
    # Padding rows count as the last request's: they sit after its tokens and only look backwards.
    row_req = torch.searchsorted(starts[1:], rows, right=True).clamp_max_(num_reqs - 1)
    ext_rows = rows + (row_req + 1) * history
    req_offsets = torch.arange(num_reqs, device=device) * history
    taps = torch.arange(history, device=device)
    saved_rows = ((starts[:-1] + req_offsets)[:, None] + taps).flatten()
    new_state_rows = ((starts[1:] + req_offsets)[:, None] + taps).flatten()

    saved = state_pool.index_select(0, slots)                                   # [R, C, K-1]
    fresh = (num_computed_tokens[:num_reqs] == 0)[:, None, None]
    saved = torch.where(fresh, torch.zeros((), dtype=saved.dtype, device=device), saved)
    extended = x.new_empty(num_rows + num_reqs * history, channels)
    extended.index_copy_(0, ext_rows, x)
    extended.index_copy_(0, saved_rows, saved.transpose(1, 2).reshape(-1, channels).to(x.dtype))

    # Accumulate in float32, as conv kernels do, then round once to the activation dtype.
    out = torch.zeros(num_rows, channels, dtype=torch.float32, device=device)
    if bias is not None:
        out = out + bias.float()
    for tap in range(kernel):
        out = out + weight[:, tap].float() * extended.index_select(0, ext_rows - history + tap).float()
    new_state = extended.index_select(0, new_state_rows).view(num_reqs, history, channels).transpose(1, 2)
    state_pool.index_copy_(0, slots, new_state.to(state_pool.dtype))
    return out.to(x.dtype)


class ShortConvKernel(nn.Module):
    """`conv.conv`: the causal depthwise convolution (weights laid out as transformers' nn.Conv1d)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, recurrent_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype, device=device)) if bias else None
        self.recurrent_idx = recurrent_idx
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state_pool, slots = current_recurrent_state(self.recurrent_idx)
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        return causal_conv1d_varlen(x, self.weight[:, 0, :], self.bias, state_pool, slots,
                                    meta.query_start_loc, meta.num_computed_tokens, meta.num_reqs)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel_size={self.kernel_size}, recurrent_idx={self.recurrent_idx}"


class Lfm2ShortConv(nn.Module):
    """`conv`: in_proj -> gates B, C and input x; out_proj(C * conv(B * x))."""

    def __init__(self, hf_config: Any, recurrent_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden, bias = hf_config.hidden_size, bool(hf_config.conv_bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias, **factory)
        self.conv = ShortConvKernel(hidden, hf_config.conv_L_cache, bias, recurrent_idx, **factory)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias, **factory)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b_gate, c_gate, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        return self.out_proj(c_gate * self.conv(b_gate * x))


class Lfm2Attention(nn.Module):
    """`self_attn`: q/k RMSNorm over head_dim, rotary, paged attention, out_proj."""

    def __init__(self, hf_config: Any, kv_cache_idx: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = _head_dim(hf_config)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False, **factory)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False, **factory)
        self.q_layernorm = RMSNorm(self.head_dim, hf_config.norm_eps, **factory)
        self.k_layernorm = RMSNorm(self.head_dim, hf_config.norm_eps, **factory)
        self.rotary_emb = rotary_emb    # shared by all layers; named_modules() lists it once
        # Only attention layers have a KV cache, so the cache index counts attention layers alone.
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, kv_cache_idx, self.head_dim ** -0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        query = self.q_layernorm(self.q_proj(hidden_states).view(num_tokens, self.num_heads, self.head_dim))
        key = self.k_layernorm(self.k_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim))
        value = self.v_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = self.rotary_emb(get_forward_context().positions[:num_tokens], query, key)
        return self.out_proj(self.attn(query, key, value))


class Lfm2MLP(nn.Module):
    """`feed_forward`: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden, intermediate = hf_config.hidden_size, mlp_intermediate_size(hf_config)
        self.w1 = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.w3 = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.w2 = nn.Linear(intermediate, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_and_mul(self.w1(x), self.w3(x)))


class Lfm2DecoderLayer(nn.Module):
    """operator (attention or short conv) and feed-forward, each pre-normed with a residual add."""

    def __init__(self, hf_config: Any, layer_type: str, op_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.layer_type = layer_type
        self.operator_norm = RMSNorm(hf_config.hidden_size, hf_config.norm_eps, **factory)
        if layer_type == "conv":
            self.conv = Lfm2ShortConv(hf_config, op_idx, **factory)
        else:
            self.self_attn = Lfm2Attention(hf_config, op_idx, rotary_emb, **factory)
        self.ffn_norm = RMSNorm(hf_config.hidden_size, hf_config.norm_eps, **factory)
        self.feed_forward = Lfm2MLP(hf_config, **factory)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        operator = self.conv if self.layer_type == "conv" else self.self_attn
        residual = residual + operator(self.operator_norm(residual))
        return residual + self.feed_forward(self.ffn_norm(residual))


class Lfm2Model(nn.Module):
    """`model`: token ids [T] -> final normed hidden states [T, hidden] (transformers calls the final
    norm `embedding_norm`)."""

    def __init__(self, hf_config: Any, max_positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, **factory)
        self.rotary_emb = RotaryEmbedding(hf_config, max_positions, device)
        layers = []
        counts = {"full_attention": 0, "conv": 0}
        for layer_type in hf_config.layer_types:
            layers.append(Lfm2DecoderLayer(hf_config, layer_type, counts[layer_type], self.rotary_emb, **factory))
            counts[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(hf_config.hidden_size, hf_config.norm_eps, **factory)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.embedding_norm(hidden_states)


@register_model("Lfm2ForCausalLM")
@register_model("Lfm2Model")      # the backbone alone (see llama.py)
class Lfm2ForCausalLM(nn.Module):
    """Constructor `(hf_config, dtype, device, max_model_len=None)`; forward(input_ids [T]) -> hidden [T, hidden].

    Positions, attention state and the conv-state pool come from the forward context.
    """

    # A conv layer's state summarises the whole prefix; cached attention KV cannot rebuild it.
    supports_prefix_caching = False

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        check_supported_config(hf_config)
        max_model_len = max_model_len or hf_config.max_position_embeddings
        self.config = hf_config
        self.model = Lfm2Model(hf_config, max(max_model_len, hf_config.max_position_embeddings), dtype, device)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False, dtype=dtype, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head.weight with the embedding when the config says so (again after `to_empty`)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tie_word_embeddings(self) -> bool:
        return self.lm_head is not None and self.lm_head.weight is self.model.embed_tokens.weight

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (the conv layers have none)."""
        return self.config.layer_types.count("full_attention")

    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    num_heads = num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return _head_dim(self.config)

    def recurrent_state_shapes(self) -> list[tuple[int, ...]]:
        """Per-sequence state of each conv layer, in layer order: its last conv_L_cache - 1 inputs."""
        shape = (self.config.hidden_size, self.config.conv_L_cache - 1)
        return [shape] * self.config.layer_types.count("conv")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def check_supported_config(hf_config: Any) -> None:
    """Refuse configs this implementation would compute differently from transformers."""
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    if len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {hf_config.num_hidden_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"LFM2 layer types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if "full_attention" not in layer_types:
        raise NotImplementedError("LFM2 configs without any attention layer are not supported "
                                  "(the KV cache pool sizes itself by the attention layers)")
    if hf_config.conv_L_cache < 2:
        raise NotImplementedError(f"conv_L_cache={hf_config.conv_L_cache} is not supported (needs >= 2)")
