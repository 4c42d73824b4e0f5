"""Audio in OpenAI's audio-output formats: 16-bit PCM, mono, as a WAV file or raw ("pcm16")."""
from __future__ import annotations

import struct

import numpy as np
import torch

FORMATS = ("wav", "pcm16")
STREAMING_WAV_SIZE = 0xFFFFFFFF     # a WAV header's sizes when the length is unknown (streamed WAV)


def pcm16(samples: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] as little-endian 16-bit PCM."""
    values = np.clip(samples.detach().to("cpu", torch.float32).numpy(), -1.0, 1.0)
    return (np.round(values * 32767.0)).astype("<i2").tobytes()


def wav_header(sample_rate: int, num_bytes: int | None) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV; `num_bytes` None: unknown length (a stream)."""
    data = STREAMING_WAV_SIZE if num_bytes is None else num_bytes
    riff = STREAMING_WAV_SIZE if num_bytes is None else 36 + num_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                                 sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def wav(samples: torch.Tensor, sample_rate: int) -> bytes:
    body = pcm16(samples)
    return wav_header(sample_rate, len(body)) + body
