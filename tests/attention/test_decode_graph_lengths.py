"""TritonAttentionBackend.decode_graph_lengths (host code only, no GPU): the decode graph lengths captured per
batch size, against the split count each sequence length would take on its own."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")


def test_graph_lengths_give_each_length_at_most_twice_its_own_split_count():
    from pellucid.attention.triton_backend import TritonAttentionBackend

    rng = random.Random(0)
    for _ in range(60):
        kv_heads = rng.choice([1, 2, 4, 8])
        backend = TritonAttentionBackend(kv_heads * rng.choice([1, 4]), kv_heads, 64, torch.float32,
                                         torch.device("cpu"))
        backend.num_sms = rng.choice([8, 78, 132])
        num_reqs, max_model_len = rng.randint(1, 80), rng.randint(1, 40000)
        splits = lambda n: backend._decode_num_splits(num_reqs, n)  # noqa: E731
        lengths = backend.decode_graph_lengths(num_reqs, max_model_len)
        assert lengths == sorted(set(lengths)) and lengths[-1] == max_model_len
        assert len({splits(n) for n in lengths}) == len(lengths), "two graphs with one split count"
        for seq_len in [rng.randint(1, max_model_len) for _ in range(200)] + lengths:
            graph = min(n for n in lengths if n >= seq_len)
            own = splits(seq_len)
            assert own <= splits(graph) < 2 * own, (num_reqs, max_model_len, lengths, seq_len)
