"""Qwen3: the Llama decoder with an RMSNorm over head_dim on each query and key head before rotary."""
from __future__ import annotations

from typing import Any

from pellucid.models.llama import AttentionOptions, LlamaForCausalLM
from pellucid.models.registry import register_model


@register_model("Qwen3ForCausalLM")
@register_model("Qwen3Model")      # the backbone alone (see llama.py)
class Qwen3ForCausalLM(LlamaForCausalLM):

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
