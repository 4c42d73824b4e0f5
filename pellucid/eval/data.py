"""Evaluation text as token windows."""
from __future__ import annotations

from typing import Any


def token_windows(tokenizer: Any, path: str, context: int, max_tokens: int | None = None) -> list[list[int]]:
    """The file's tokens (special tokens written in the text, e.g. <|endoftext|>, are those tokens) cut
    into non-overlapping windows of `context` tokens. A trailing piece shorter than `context` is dropped,
    as the training script's validation does, unless the file is shorter than one window. `max_tokens`
    keeps only the first windows that fit in that many tokens (at least one)."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    # The tokenizers backend: no model_max_length warning for a long file (windows are cut below).
    ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        raise ValueError(f"{path} has {len(ids)} token(s); perplexity needs at least 2")
    windows = [ids[start:start + context] for start in range(0, len(ids) - context + 1, context)] or [ids]
    if max_tokens is not None:
        windows = windows[:max(1, max_tokens // context)]
    return windows
