"""The talker's code predictor (`talker.code_predictor`): given the talker's last hidden state and the
frame's first code, it predicts the frame's other `num_code_groups - 1` codes one after the other.

transformers runs it as a `generate` of num_code_groups - 1 tokens per frame: a prefill of two positions
(the talker's normed hidden state, the talker's embedding of the first code) through a small dense
Qwen3 decoder, `lm_head[0]` on the last one; then each code i, embedded by `codec_embedding[i - 1]`, is
fed and `lm_head[i]` predicts code i + 1. Here the frames of all rows of a step run together, with a KV
cache of num_code_groups positions.

Sampling follows the talker row's: greedy rows take the argmax (transformers mirrors the talker's
do_sample onto the code predictor); sampling rows draw with transformers' code predictor settings,
top-k 50 and top-p 0.8 at temperature 1, as the sampler draws (exponential race), seeded rows from their
own stream of the step seed.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.kernels import fused_kernels_enabled
from pellucid.models.layers import Embedding, Linear
from pellucid.models.qwen3_omni.dense import DenseStack, KVCache
from pellucid.runner.sampler import HEAD_STREAM, exponential_noise

TOP_K = 50
TOP_P = 0.8
# A seeded row's code-predictor draws: their own stream of the row's step seed (runner/sampler.py).
CODE_PREDICTOR_STREAM = HEAD_STREAM + 1


# apply_top_k_top_p drops a token when the mass at or below it is <= 1 - top_p, computed in float32.
_TOP_P_FLOOR = (1 - torch.tensor(TOP_P, dtype=torch.float32)).item()


def top_k_top_p_race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[R] token ids drawn from softmax(logits [R, V]) restricted to the top TOP_K and then to top-p TOP_P,
    by the exponential race with `noise` [R, V] (Exp(1) per token): the sampler's draw
    (apply_top_k_top_p, softmax, argmax of probs / noise), computed over the TOP_K largest logits only
    instead of sorting the whole vocabulary (15 times per frame)."""
    values, ids = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1)      # descending
    probs = values.softmax(dim=-1)
    # Summed from the least likely kept token up, as the ascending sort's cumulative sum does.
    mass_at_or_below = probs.flip(-1).cumsum(dim=-1).flip(-1)
    keep = mass_at_or_below > _TOP_P_FLOOR
    keep[:, 0] = True       # the most likely token always survives rounding in the cumulative sum
    score = torch.where(keep, probs / noise.gather(1, ids), -1.0)
    return ids.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)


def draw_code(logits: torch.Tensor, greedy: torch.Tensor | None, noise: torch.Tensor | None) -> torch.Tensor:
    """[R] codes from one codebook's logits [R, V] (model dtype): the argmax where `greedy` [R] is set (every
    row when it is None), else the top-k / top-p race with `noise` [R, V]. One launch on CUDA."""
    sampling = greedy is not None and noise is not None
    if fused_kernels_enabled(logits, "top_k_race"):
        from pellucid.kernels.top_k_race import top_k_race
        return top_k_race(logits, noise if sampling else None, greedy if sampling else None, TOP_K, _TOP_P_FLOOR)
    logits = logits.float()
    code = logits.argmax(dim=-1)
    if sampling:
        code = torch.where(greedy, code, top_k_top_p_race(logits, noise))
    return code


class CodePredictorModel(DenseStack):
    """`talker.code_predictor.model`: layers, norm, and one codec embedding per predicted codebook."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, qk_norm=True, sliding_window=None, layer_scale=False, dtype=dtype, device=device,
                         max_positions=int(config.num_code_groups))
        self.codec_embedding = nn.ModuleList(
            Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
            for _ in range(config.num_code_groups - 1))


class CodePredictor(nn.Module):
    """`talker.code_predictor`: model + lm_head[i] per predicted codebook."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.num_code_groups = int(config.num_code_groups)
        self.model = CodePredictorModel(config, dtype, device)
        self.lm_head = nn.ModuleList(Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                            device=device) for _ in range(self.num_code_groups - 1))

    def predict(self, hidden: torch.Tensor, first_code_embeds: torch.Tensor, greedy: torch.Tensor | None,
                seeds: dict[int, int]) -> torch.Tensor:
        """Codes 1 .. G-1 [R, G-1] of R frames: `hidden` [R, H] the talker's normed hidden states that
        sampled each frame's first code, `first_code_embeds` [R, H] the talker's embedding of that code.
        `greedy`: [R] bool (device), which rows take the argmax, or None when every row does; `seeds`:
        row -> the row's step seed (SamplingMetadata.seeds) for seeded sampling rows."""
        noise = None
        if greedy is not None:
            noise = self.draw_noise(hidden.shape[0], hidden.device, seeds)
        return self.predict_codes(hidden, first_code_embeds, greedy, noise)

    def noise_shape(self, rows: int) -> torch.Size:
        return torch.Size((rows, (self.num_code_groups - 1) * int(self.config.vocab_size)))

    def draw_noise(self, rows: int, device: torch.device, seeds: dict[int, int],
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """One draw per (codebook, code) per row, from the row's own stream when it is seeded."""
        return exponential_noise(self.noise_shape(rows), device, seeds, CODE_PREDICTOR_STREAM, out=out)

    def predict_codes(self, hidden: torch.Tensor, first_code_embeds: torch.Tensor, greedy: torch.Tensor | None,
                      noise: torch.Tensor | None) -> torch.Tensor:
        """predict() with the sampling rows' noise drawn: device work only, at shapes fixed by the row count,
        so a CUDA graph can hold it (code_predictor_graphs.py)."""
        rows = hidden.shape[0]
        attn = self.model.layers[0].self_attn
        cache = KVCache(len(self.model.layers), rows, attn.num_kv_heads, self.num_code_groups, attn.head_dim,
                        hidden.dtype, hidden.device)
        vocab = int(self.config.vocab_size)
        x = torch.stack((hidden, first_code_embeds), dim=1)
        codes = []
        for i in range(self.num_code_groups - 1):
            logits = self.lm_head[i](self.model(x, cache)[:, -1])
            code = draw_code(logits, greedy, noise[:, i * vocab:(i + 1) * vocab] if noise is not None else None)
            codes.append(code)
            if i + 1 < self.num_code_groups - 1:
                x = self.model.codec_embedding[i](code)[:, None]
        return torch.stack(codes, dim=1)
