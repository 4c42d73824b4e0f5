"""Scores from embeddings (vLLM's `score` for embedding models): which texts pair up, and their cosine
similarity. Shared by `LLM.score` and the server's /v1/score and /v1/rerank."""
from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def pair_up(first: T | list[T], second: T | list[T]) -> list[tuple[T, T]]:
    """One first item against every second one, or the i-th of each; ValueError naming the side at fault."""
    left = first if isinstance(first, list) else [first]
    right = second if isinstance(second, list) else [second]
    if not left or not right:
        raise ValueError(f"{'text_1' if not left else 'text_2'} must not be empty")
    if len(left) != 1 and len(left) != len(right):
        raise ValueError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many as text_2")
    return [(left[0] if len(left) == 1 else left[i], item) for i, item in enumerate(right)]


def cosine_scores(pairs: list[tuple[T, T]], vectors: dict[T, torch.Tensor]) -> list[float]:
    """Each pair's cosine similarity, from the embedding of each distinct item."""
    a = torch.stack([vectors[x] for x, _ in pairs])
    b = torch.stack([vectors[y] for _, y in pairs])
    return torch.nn.functional.cosine_similarity(a, b, dim=1).tolist()
