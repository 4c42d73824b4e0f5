"""`<Arch>ForSequenceClassification`: a decoder with a classification head instead of an LM head (reward
models such as Skywork-Reward-Llama-3.1-8B, classifiers, cross-encoder rerankers made from a decoder).

As in transformers, the head is `score`, a linear layer [num_labels, hidden] without bias applied to the
final-normed hidden state of the sequence's last token. The model has no LM head (`lm_head` is None, so
the engine serves it with the "none" head and only requests that discard their sampled token): the
classification requests of pellucid/pooling, whose step hook applies `score` to the last prompt row.
`score` replicates over tensor-parallel ranks (it is small and reads the full hidden state).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pellucid.models.moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pellucid.models.qwen3 import Qwen3ForCausalLM
from pellucid.models.registry import register_model


def sequence_classifier(causal_lm: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """The sequence-classification model of a causal LM class: its decoder, `score` in place of `lm_head`."""

    class SequenceClassifier(causal_lm):
        def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                     max_model_len: int | None = None) -> None:
            super().__init__(hf_config, dtype, device, max_model_len)
            self.lm_head = None
            self.num_labels = int(hf_config.num_labels)
            self.score = nn.Linear(hf_config.hidden_size, self.num_labels, bias=False, dtype=dtype, device=device)

        def tie_weights(self) -> None:
            pass        # no LM head to tie: a classifier's `tie_word_embeddings` concerns the LM it came from

    name = causal_lm.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = name
    return register_model(name)(SequenceClassifier)


for _causal_lm in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
                   Qwen2MoeForCausalLM, MixtralForCausalLM):
    sequence_classifier(_causal_lm)
