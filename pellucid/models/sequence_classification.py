"""`<Arch>ForSequenceClassification`: a decoder with a classification head instead of an LM head (reward
models such as Skywork-Reward-Llama-3.1-8B, classifiers, cross-encoder rerankers made from a decoder).

As in transformers, the head is `score`, a linear layer [num_labels, hidden] without bias applied to the
final-normed hidden state of the sequence's last token. The model has no LM head (`lm_head` is None, so
the engine serves it with the "none" head and only requests that discard their sampled token): the
classification requests of pellucid/pooling, whose step hook applies `score` to the last prompt row.
`score` replicates over tensor-parallel ranks (it is small and reads the full hidden state).

A causal LM read as a classifier (vLLM's `hf_overrides`: `"architectures": ["Qwen3ForSequenceClassification"]`
with `"classifier_from_token": [token, ...]`) takes its `score` from its LM head's rows of those tokens, read
from the checkpoint at load: a label per token (each label's logit is the token's logit), or, for two tokens
with `"is_original_qwen3_reranker": true` or `"method": "from_2_way_softmax"`, one label whose logit is the
second token's logit minus the first's (its sigmoid is the second token's probability against the first:
Qwen3-Reranker's "yes" against "no").
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
            self.from_tokens = _tokens_of(hf_config)
            self.two_way = self.from_tokens is not None and _two_way(hf_config, self.from_tokens)
            if self.from_tokens is None:
                self.num_labels = int(hf_config.num_labels)
            else:
                self.num_labels = 1 if self.two_way else len(self.from_tokens)
                self.derived_parameters = ("score.weight",)
            self.score = nn.Linear(hf_config.hidden_size, self.num_labels, bias=False, dtype=dtype, device=device)

        def tie_weights(self) -> None:
            pass        # no LM head to tie: a classifier's `tie_word_embeddings` concerns the LM it came from

        def finish_loading(self, model_dir: str) -> None:
            """`score` from the LM head's rows of `classifier_from_token` (see the module docstring)."""
            if self.from_tokens is None:
                return
            from pellucid.models.loader import checkpoint_files, read_rows
            from pellucid.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
            ids = []
            for token in self.from_tokens:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
                    raise ValueError(f"classifier_from_token names {token!r}, which is not a token of {model_dir}'s "
                                     f"tokenizer")
                ids.append(token_id)
            names = {name for file_names in checkpoint_files(model_dir).values() for name in file_names}
            head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
            rows = read_rows(model_dir, head, ids).to(device=self.score.weight.device, dtype=torch.float32)
            weight = (rows[1] - rows[0]).unsqueeze(0) if self.two_way else rows
            self.score.weight.copy_(weight)

    name = causal_lm.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = name
    return register_model(name)(SequenceClassifier)


def _tokens_of(hf_config: Any) -> list[str] | None:
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return None
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    return list(tokens)


def _two_way(hf_config: Any, tokens: list[str]) -> bool:
    method = getattr(hf_config, "method", None)
    two_way = bool(getattr(hf_config, "is_original_qwen3_reranker", False)) or method == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ValueError(f"a two-way classifier needs two classifier_from_token tokens (the negative, then the "
                         f"positive), got {tokens!r}")
    if method not in (None, "from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"method must be from_2_way_softmax or no_post_processing, got {method!r}")
    return two_way


for _causal_lm in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
                   Qwen2MoeForCausalLM, MixtralForCausalLM):
    sequence_classifier(_causal_lm)
