"""The Llama-style decoder (Llama, Mistral, Qwen2; Qwen3 adds per-head q/k norms in qwen3.py).

Module paths equal HuggingFace's (model.layers.N.self_attn.q_proj, ...), every module takes and returns
one tensor in the flat token layout [num_tokens, ...], and a decoder layer returns the residual stream
HuggingFace reports in `hidden_states[N + 1]`. The forward returns the final normed hidden states;
the runner applies the LM head (`lm_head`) through pellucid.heads.

Fewer kernels per layer while nothing is traced (each step falls back to the module-by-module code
when `is_observed` reports a hook on a module it would skip): q/k/v and gate/up each run as one GEMM
over merged weights; each residual add is fused with the RMSNorm that follows it (the
post-attention norm, and the next layer's input norm or the final norm), and a mixture of experts leaves
its top-k sum to that add (layers.TopKRowsMlp); Qwen3's q/k norms are fused with rotary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pellucid.attention.fused_kv_store import FusedKVStore
from pellucid.attention.layer import Attention
from pellucid.attention.metadata import get_forward_context
from pellucid.attention.norm_rotary import QKNormRotary
from pellucid.kernels import fused_kernels_enabled
from pellucid.models.layers import (GatedMLP, MergedLinear, RMSNorm, RotaryEmbedding, TopKRowsMlp, add_rms_norm,
                                    is_observed, merged_projections_enabled, qk_norm_rotary, skinny_gemm_applies)
from pellucid.models.parallel_layers import (all_reduce_add_rms_norm, begin_forward, column_linear,
                                             fused_reduction_applies, lm_head_linear, mark_sites,
                                             reduces_partial_sums, row_linear, unit_shard, vocab_embedding)
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
        num_heads, num_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.head_dim = head_dim = _head_dim(hf_config)
        # Under tensor parallelism this rank holds num_heads / N query heads and their KV heads (a KV head
        # serves several ranks when there are fewer than ranks); o_proj sums the ranks' parts.
        q_what, kv_what = "num_attention_heads", "num_key_value_heads"
        self.q_proj = column_linear(hidden, num_heads, head_dim, options.qkv_bias, **factory, what=q_what)
        self.k_proj = column_linear(hidden, num_kv_heads, head_dim, options.qkv_bias, **factory, what=kv_what,
                                    replicate=True)
        self.v_proj = column_linear(hidden, num_kv_heads, head_dim, options.qkv_bias, **factory, what=kv_what,
                                    replicate=True)
        self.o_proj = row_linear(num_heads, head_dim, hidden, options.o_bias, **factory, what=q_what)
        self.num_heads = self.q_proj.out_features // head_dim
        self.num_kv_heads = self.k_proj.out_features // head_dim
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, **factory)
        self.rotary_emb = rotary_emb    # shared by all layers; named_modules() lists it once
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx, self.head_dim ** -0.5)
        q_shard = unit_shard(num_heads, q_what)
        if q_shard is not None:
            mark_sites(self.attn, q_shard, "input", "output")
            if self.q_norm is not None and self.k_norm is not None:
                mark_sites(self.q_norm, q_shard, "input", "output")
                mark_sites(self.k_norm, unit_shard(num_kv_heads, kv_what, replicate=True), "input", "output")
        self.qkv = MergedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _apply(self, fn: Any, recurse: bool = True) -> "DecoderAttention":
        # `to`, `to_empty`, `half`, ... give each parameter its own new tensor: merge them again.
        super()._apply(fn, recurse)
        self.qkv.merge()
        return self

    def forward(self, hidden_states: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: under tensor parallelism, this rank's partial sums of o_proj, left for the caller's
        fused all-reduce (which then skips the `o_proj` and `self_attn` calls: only while nothing observes them)."""
        num_tokens = hidden_states.shape[0]
        positions = get_forward_context().positions[:num_tokens]
        if self._rotary_in_projection(hidden_states):
            return self._out(self.attn(*self._projection_with_rotary(hidden_states, positions)), reduce)
        if merged_projections_enabled() and not is_observed(self.q_proj, self.k_proj, self.v_proj):
            query, key, value = self.qkv(hidden_states)
        else:
            query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self._norm_rotary_in_attention(query):
            return self._out(self.attn.forward_qk_norm_rotary(query, self._qk_norm_rotary(key, value, positions)),
                             reduce)
        # The rotary kernel may store K/V in the cache itself, unless a hook could still change them after it.
        kv_store = None
        if fused_kernels_enabled(query, "rotary_kv_store") and not is_observed(self.rotary_emb, self.attn):
            kv_store = self.attn.fused_kv_store(value)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = qk_norm_rotary(positions, query, key, self.q_norm, self.k_norm, self.rotary_emb, kv_store)
        else:
            query, key = self.rotary_emb(positions, query, key, kv_store=kv_store)
        return self._out(self.attn(query, key, value, kv_store=kv_store), reduce)

    def _out(self, attention: torch.Tensor, reduce: bool) -> torch.Tensor:
        return self.o_proj(attention) if reduce else self.o_proj.partial(attention)

    def _norm_rotary_in_attention(self, query: torch.Tensor) -> bool:
        """Whether the attention backend applies the q/k norm + rotary and stores K/V itself (a decode step
        on a backend that can, pellucid.attention.norm_rotary): only while no hook observes a module it skips."""
        return (self.q_norm is not None and self.k_norm is not None
                and fused_kernels_enabled(query, "attention_qk_norm_rotary")
                and not is_observed(self.q_norm, self.k_norm, self.rotary_emb, self.attn)
                and self.attn.fuses_qk_norm_rotary())

    def _qk_norm_rotary(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> QKNormRotary:
        assert self.q_norm is not None and self.k_norm is not None
        return QKNormRotary(key, value, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
                            self.k_norm.variance_epsilon, self.rotary_emb.cos_sin_cache, positions)

    def _rotary_in_projection(self, hidden_states: torch.Tensor) -> bool:
        """Whether rotary runs as the epilogue of the merged q/k/v GEMM (skinny_paired.qkv_rotary_linear):
        a decode-sized batch on CUDA, no q/k norm between projection and rotary, and no hook on a module
        it skips (the q/k/v projections, rotary_emb)."""
        if (self.q_norm is not None or not merged_projections_enabled()
                or is_observed(self.q_proj, self.k_proj, self.v_proj, self.rotary_emb)
                or not skinny_gemm_applies(hidden_states, self.qkv.weight, "skinny_qkv_rotary", hidden_states.shape[-1])):
            return False
        from pellucid.kernels.skinny_paired import qkv_rotary_config
        return qkv_rotary_config(hidden_states.shape[0], hidden_states.shape[1], self.num_heads, self.num_kv_heads,
                                 self.head_dim) is not None

    def _projection_with_rotary(self, hidden_states: torch.Tensor, positions: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FusedKVStore | None]:
        """(rotated q, rotated k, v, kv_store) from one kernel; it also stores K/V in the cache unless a hook
        on the attention module could still change them (then the attention layer writes them)."""
        from pellucid.kernels.skinny_paired import qkv_rotary_linear
        target = self.attn.plain_kv_target() if not is_observed(self.attn) else None
        weight, bias = self.qkv.merged_parameters()
        qkv = qkv_rotary_linear(hidden_states, weight, bias, positions, self.rotary_emb.cos_sin_cache, self.num_heads,
                                self.num_kv_heads, self.head_dim, *(target or (None, None)))
        query, key, value = qkv.split(self.qkv.sizes, dim=-1)
        kv_store = None
        if target is not None:
            kv_store = FusedKVStore(value.view(-1, self.num_kv_heads, self.head_dim), *target, stored=True)
        return query, key, value, kv_store


# (hf_config, layer_idx, dtype, device) -> the layer's `mlp` module ([T, hidden] -> [T, hidden]).
MlpFactory = Callable[[Any, int, torch.dtype, "torch.device | str"], nn.Module]


def gated_mlp(hf_config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The dense Llama MLP of every layer."""
    return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, bool(getattr(hf_config, "mlp_bias", False)),
                    dtype, device)


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, options: AttentionOptions,
                 dtype: torch.dtype, device: torch.device | str, make_mlp: MlpFactory = gated_mlp) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)
        self.self_attn = DecoderAttention(hf_config, layer_idx, rotary_emb, options, **factory)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)
        self.mlp = make_mlp(hf_config, layer_idx, dtype, device)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return self.forward_fused(residual, None, None)[0]

    def forward_fused(self, residual: torch.Tensor, normed: torch.Tensor | None, next_norm: RMSNorm | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer, optionally sharing its boundary norms with its neighbours.

        `normed`: input_layernorm(residual), when the previous layer computed it fused with its last add.
        `next_norm`: the norm that follows this layer (the next input_layernorm or the final norm); when
        given, returns (residual stream, next_norm(residual stream)) from one fused add + norm, else
        (residual stream, None). Fusing across the layer boundary skips calling this module, so the
        model does it only while neither this layer nor what follows it is observed.
        """
        if normed is None:
            normed = self.input_layernorm(residual)
        attn = self.self_attn
        norm = self.post_attention_layernorm
        if (not is_observed(attn, attn.o_proj, norm) and reduces_partial_sums(attn.o_proj)
                and fused_reduction_applies(residual, norm.weight)):
            residual, normed = all_reduce_add_rms_norm(attn(normed, reduce=False), residual, norm.weight,
                                                       norm.variance_epsilon)
        elif is_observed(norm):
            residual = residual + attn(normed)
            normed = norm(residual)
        else:
            residual, normed = add_rms_norm(attn(normed), residual, norm)
        if next_norm is None:
            return residual + self.mlp(normed), None
        fused_reduction = fused_reduction_applies(residual, next_norm.weight)
        if isinstance(self.mlp, TopKRowsMlp) and self.mlp.top_k_rows_apply(normed, fused_reduction):
            rows = self.mlp.forward_top_k_rows(normed)      # the experts' rows, summed by what follows
            if rows.partial:        # this rank's part: summed over the ranks too
                return all_reduce_add_rms_norm(rows.rows, residual, next_norm.weight, next_norm.variance_epsilon,
                                               rows.top_k)
            return add_rms_norm(rows, residual, next_norm)
        if (fused_reduction and isinstance(self.mlp, GatedMLP) and reduces_partial_sums(self.mlp.down_proj)
                and not is_observed(self.mlp, self.mlp.down_proj)):
            return all_reduce_add_rms_norm(self.mlp(normed, reduce=False), residual, next_norm.weight,
                                           next_norm.variance_epsilon)
        return add_rms_norm(self.mlp(normed), residual, next_norm, after_top_k=isinstance(self.mlp, TopKRowsMlp))


class DecoderModel(nn.Module):
    """`model`: token ids [T] -> final normed hidden states [T, hidden]."""

    def __init__(self, hf_config: Any, options: AttentionOptions, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str, make_mlp: MlpFactory = gated_mlp) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = vocab_embedding(hf_config.vocab_size, hf_config.hidden_size, **factory)
        self.rotary_emb = RotaryEmbedding(hf_config, max_positions, device)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, i, self.rotary_emb, options, **factory, make_mlp=make_mlp)
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **factory)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(input_ids))

    def forward_embeds(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layers and the final norm over input embeddings [T, hidden] (a model whose inputs are not
        token embeddings, e.g. Qwen3-Omni's talker, calls this)."""
        normed: torch.Tensor | None = None    # the next layer's input_layernorm output, when fused ahead
        num_layers = len(self.layers)
        begin_forward()
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1] if i + 1 < num_layers else None
            next_norm = following.input_layernorm if following is not None else self.norm
            if is_observed(layer):
                # Its hooks must see its real input and output; the previous layer fused nothing into it.
                hidden_states, normed = layer(hidden_states), None
            elif is_observed(next_norm) or (following is not None and is_observed(following)):
                hidden_states, normed = layer.forward_fused(hidden_states, normed, None)
            else:
                hidden_states, normed = layer.forward_fused(hidden_states, normed, next_norm)
        return self.norm(hidden_states) if normed is None else normed


class LlamaForCausalLM(nn.Module):
    """Constructor `(hf_config, dtype, device, max_model_len=None)`; forward(input_ids [T]) -> hidden [T, hidden].

    Positions and attention state come from the forward context (pellucid.attention.metadata).
    """

    # Shards over tensor-parallel ranks (parallel_layers.py); the loader refuses classes that do not.
    supports_tensor_parallel = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        max_model_len = max_model_len or hf_config.max_position_embeddings
        check_supported_config(hf_config, max_model_len)
        self.config = hf_config
        self.model = DecoderModel(hf_config, self.attention_options(hf_config),
                                  max(max_model_len, hf_config.max_position_embeddings), dtype, device,
                                  make_mlp=self.build_mlp)
        self.lm_head = lm_head_linear(hf_config.hidden_size, hf_config.vocab_size, dtype, device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head.weight with the embedding when the config says so (again after `to_empty`)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """Layer `layer_idx`'s `mlp` (mixture-of-experts models override it)."""
        return gated_mlp(hf_config, layer_idx, dtype, device)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.lm_head is not None and self.lm_head.weight is self.model.embed_tokens.weight

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    # Per rank under tensor parallelism: the heads of this rank's attention layers and KV cache.
    @property
    def num_attention_heads(self) -> int:
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

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


# "<Arch>Model": the backbone alone, as transformers' AutoModel saves it and embedding models are published
# (tensors without the "model." prefix: models/loader.py); it serves embeddings (pellucid/pooling).
register_model("LlamaForCausalLM")(LlamaForCausalLM)
register_model("LlamaModel")(LlamaForCausalLM)


@register_model("MistralForCausalLM")
@register_model("MistralModel")
class MistralForCausalLM(LlamaForCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions()


@register_model("Qwen2ForCausalLM")
@register_model("Qwen2Model")
class Qwen2ForCausalLM(LlamaForCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
