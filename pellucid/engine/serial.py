"""msgpack for engine messages, with tensors carried as raw side buffers.

A message is a list of frames: frame 0 is the msgpack body; every tensor larger than a few hundred
bytes travels as one extra frame holding its bytes as they lie in memory, so saves, hidden states and
logprobs cross the process boundary with no per-element Python work (zmq sends the frames without
copying them; the receiver wraps each frame's buffer in a tensor without copying it either). Objects
msgpack cannot express (a TracePlan in a request's extras, the engine's startup facts) are pickled:
these messages travel only between a frontend and the engine process it started, over a private
socket, never from a client.
"""
from __future__ import annotations

import pickle
import warnings
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

_TENSOR = 1
_PICKLE = 2
_NDARRAY = 3
_INLINE_LIMIT = 512     # bytes; smaller tensors ride inside the body

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class MessageEncoder:
    """`encode(obj) -> [body, *buffers]`. Not thread-safe: one encoder per sending thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._buffers: list[Any] = []

    def encode(self, obj: Any) -> list[Any]:
        self._buffers = [None]
        try:
            self._buffers[0] = self._encoder.encode(obj)
            return self._buffers
        finally:
            self._buffers = []

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return msgspec.msgpack.Ext(_TENSOR, self._tensor(obj))
        if isinstance(obj, np.ndarray):
            return msgspec.msgpack.Ext(_NDARRAY, self._array(obj))
        return msgspec.msgpack.Ext(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _tensor(self, tensor: torch.Tensor) -> bytes:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} to or from the engine process")
        host = tensor.detach().to("cpu").contiguous()
        raw = host.reshape(-1).view(torch.uint8).numpy()
        return msgspec.msgpack.encode((dtype, list(host.shape), self._place(raw)))

    def _array(self, array: np.ndarray) -> bytes:
        array = np.ascontiguousarray(array)
        return msgspec.msgpack.encode((array.dtype.str, list(array.shape),
                                       self._place(array.reshape(-1).view(np.uint8))))

    def _place(self, raw: np.ndarray) -> int | bytes:
        """The bytes inline when small, else the index of the side frame that carries them."""
        if raw.nbytes <= _INLINE_LIMIT:
            return raw.tobytes()
        self._buffers.append(memoryview(raw))
        return len(self._buffers) - 1


class MessageDecoder:
    """`decode(frames)` for frames from MessageEncoder.encode; `kind` is the expected type."""

    def __init__(self, kind: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=self._hook)
        self._frames: Sequence[Any] = ()

    def decode(self, frames: Sequence[Any]) -> Any:
        self._frames = frames
        try:
            with warnings.catch_warnings():
                # The received frames are read-only buffers owned by this message; the tensors made on
                # them may be written by their user, which touches nothing else.
                warnings.simplefilter("ignore", UserWarning)
                return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._frames = ()

    def _hook(self, code: int, data: memoryview) -> Any:
        if code == _PICKLE:
            return pickle.loads(data)
        if code == _TENSOR:
            dtype, shape, where = msgspec.msgpack.decode(data)
            raw = self._raw(where)
            if len(raw) == 0:
                return torch.empty(shape, dtype=_DTYPES[dtype])
            return torch.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape)
        if code == _NDARRAY:
            dtype, shape, where = msgspec.msgpack.decode(data)
            return np.frombuffer(self._raw(where), dtype=np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown msgpack extension type {code}")

    def _raw(self, where: int | bytes) -> Any:
        if isinstance(where, int):
            return _buffer(self._frames[where])
        return bytearray(where)


def _buffer(frame: Any) -> Any:
    """The bytes of a zmq Frame, or the object itself (bytes, memoryview)."""
    return frame.buffer if hasattr(frame, "buffer") else frame
