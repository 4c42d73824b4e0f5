"""Tokenizer loading, EOS ids, chat templates and incremental detokenization."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # transformers is imported here, not with this module: its import is seconds on some machines, and a
    # frontend starts its engine process first so that the two overlap (AsyncLLM._start).
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types; say which directory failed
        raise ValueError(f"could not load a tokenizer from {path!r}: {exc}") from exc
    if not getattr(tok, "is_fast", False) or not hasattr(tok, "_tokenizer"):
        raise ValueError(f"tokenizer at {path!r} is not a fast (tokenizers-backed) tokenizer; "
                         "Pellucid needs tokenizer.json")
    return tok


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase, hf_config: Any | None = None) -> set[int]:
    """The checkpoint's EOS ids (generation_config.json, else config.json) plus the tokenizer's eos token."""
    from pellucid.models.loader import read_eos_token_ids

    ids = read_eos_token_ids(model_dir, hf_config)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must have 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoded once per token (no re-decoding of the whole output)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id)
        if piece:
            self.text += piece
            return piece
        return ""
