"""Qwen3-Omni's code2wav: codec frames [B, num_quantizers, T] -> waveform [B, 1, T * samples_per_frame - lost].

The codes of a frame are embedded (one table, offset per codebook) and averaged, go through a small
sliding-window transformer (`pre_transformer`), are upsampled by causal transposed convolutions with
ConvNeXt blocks, and decoded by a convolutional vocoder (SnakeBeta activations, dilated residual units).
Module names are transformers'.

The convolutions look left only, except the transposed ones, which see one frame ahead and drop their
last output samples: decoding a window of frames therefore differs near its right edge from decoding
more. `decode_window` decodes windows exactly as transformers' `chunked_decode(codes, chunk_size,
left_context_size)` does, so a stream decoded window by window equals it sample for sample
(pellucid/pipeline/code2wav_core.py schedules the windows).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pellucid.kernels import fused_kernels_enabled
from pellucid.models.layers import Embedding
from pellucid.models.qwen3_omni.configs import OmniConfig
from pellucid.models.qwen3_omni.dense import DenseStack


class CausalConvNet(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1,
                 **factory: Any) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups, **factory)
        self.padding = (kernel_size - 1) * dilation      # stride 1: all left padding, no extra right padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.padding, 0)))


class CausalTransConvNet(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, **factory: Any) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride, **factory)
        self.trim = math.ceil(kernel_size - stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim:x.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, **factory: Any) -> None:
        super().__init__()
        self.dwconv = CausalConvNet(dim, dim, kernel_size=7, groups=dim, **factory)
        self.norm = nn.LayerNorm(dim, eps=1e-6, **factory)
        self.pwconv1 = nn.Linear(dim, 4 * dim, **factory)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim, **factory)
        self.gamma = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)


class SnakeBeta(nn.Module):
    """x + 1 / exp(beta) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int, **factory: Any) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels, **factory))
        self.beta = nn.Parameter(torch.zeros(channels, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels_enabled(x, "snake_beta"):
            from pellucid.kernels.snake_beta import snake_beta
            return snake_beta(x, self.alpha, self.beta)
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, **factory: Any) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim, **factory)
        self.conv1 = CausalConvNet(dim, dim, kernel_size=7, dilation=dilation, **factory)
        self.act2 = SnakeBeta(dim, **factory)
        self.conv2 = CausalConvNet(dim, dim, kernel_size=1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, config: Any, index: int, **factory: Any) -> None:
        super().__init__()
        in_dim = config.decoder_dim // 2 ** index
        out_dim = config.decoder_dim // 2 ** (index + 1)
        rate = int(config.upsample_rates[index])
        self.block = nn.ModuleList([SnakeBeta(in_dim, **factory),
                                    CausalTransConvNet(in_dim, out_dim, 2 * rate, rate, **factory),
                                    *(ResidualUnit(out_dim, dilation, **factory) for dilation in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.block:
            x = module(x)
        return x


class Code2Wav(nn.Module):
    """`code2wav`: forward(codes [B, Q, T] int64) -> waveform [B, 1, samples] in [-1, 1]."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = config
        self.num_quantizers = int(config.num_quantizers)
        self.codebook_size = int(config.codebook_size)
        self.pre_transformer = DenseStack(config, qk_norm=False, sliding_window=int(config.sliding_window),
                                          layer_scale=True, **factory)
        self.code_embedding = Embedding(self.codebook_size * self.num_quantizers, config.hidden_size, **factory)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConvNet(config.hidden_size, config.hidden_size, factor, factor, **factory),
                           ConvNeXtBlock(config.hidden_size, **factory)])
            for factor in config.upsampling_ratios)
        output_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        self.decoder = nn.ModuleList([CausalConvNet(config.hidden_size, config.decoder_dim, 7, **factory),
                                      *(DecoderBlock(config, i, **factory) for i in range(len(config.upsample_rates))),
                                      SnakeBeta(output_dim, **factory), CausalConvNet(output_dim, 1, 7, **factory)])
        self.total_upsample = math.prod(int(f) for f in list(config.upsample_rates) + list(config.upsampling_ratios))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[1] != self.num_quantizers:
            raise ValueError(f"code2wav decodes {self.num_quantizers} codebooks per frame, got {codes.shape[1]}")
        offsets = torch.arange(self.num_quantizers, device=codes.device)[None, :, None] * self.codebook_size
        hidden = self.code_embedding(codes + offsets).mean(1)
        hidden = self.pre_transformer(hidden).permute(0, 2, 1)
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    def decode_window(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """The samples of a window's frames, `codes` [B, Q, T] holding `context` frames of left context
        first: chunked_decode's step for one window."""
        wav = self(codes)
        return wav[..., context * self.total_upsample:]


def window_bounds(start: int, num_frames: int, chunk_size: int, left_context: int) -> tuple[int, int, int]:
    """(first frame fed, end frame, context frames) of the window that starts at frame `start` of a stream
    of `num_frames` frames: transformers' chunked_decode windows."""
    end = min(start + chunk_size, num_frames)
    context = left_context if start - left_context > 0 else start
    return start - context, end, context


class Qwen3OmniCode2Wav(nn.Module):
    """The code2wav stage. Constructor `(omni hf_config, dtype, device, max_model_len=None)`."""

    checkpoint_prefixes = ("code2wav.",)

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.omni = OmniConfig(hf_config)
        self.engine_hf_config = self.omni.code2wav
        self.code2wav = Code2Wav(self.omni.code2wav, dtype, device)

    def tie_weights(self) -> None:
        pass

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.code2wav(codes)
