"""Connectors: how a pipeline stage hands chunks of a request's output to the next stage.

One interface, keyed by ChunkKey (request id, from stage, to stage, chunk index):

- `put(key, chunk)` (the producing stage): the chunk is stored; once put returns, `get` finds it;
- `get(key)` (the consuming stage): takes the chunk out (each chunk is read once); a chunk that is not
  there is an error (ChunkMissingError) naming the key, never a wait;
- `discard(keys)`: drops chunks that were put but will never be read (their request ended);
- `deliver(notices)`: delivery of the producers' notices ("chunk i of request r is there") to the
  consumers. The pipeline relays every notice through it; the real connectors pass them on as they are,
  and a test double may hold them back and reorder them (see tests): the consumer puts chunks back in
  order, waits for a late one, and never reads one twice.

Implementations: `inproc` (a dict, for stages in one process) and `shm` (shared memory between the
processes of one machine: each chunk is one POSIX shared-memory segment, written once by the producer and
unlinked by the consumer when it reads it; tensors are laid out as raw bytes and copied out once).
"""
from __future__ import annotations

import hashlib
import pickle
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, Iterable

import numpy as np
import torch


class ChunkMissingError(RuntimeError):
    """A chunk that was announced is not in the connector (lost, or read twice)."""


@dataclass(frozen=True, order=True)
class ChunkKey:
    request_id: str
    from_stage: str
    to_stage: str
    index: int

    def __str__(self) -> str:
        return f"chunk {self.index} of request {self.request_id!r} from {self.from_stage} to {self.to_stage}"


@dataclass
class Chunk:
    """Rows [first, first + n) of a request's output on one edge; `final`: the end of that stream."""

    first: int                                  # index of the first row (a position, or a frame)
    num_rows: int
    payload: dict[str, Any] = field(default_factory=dict)    # tensors [num_rows, ...] and small values
    final: bool = False


@dataclass(frozen=True)
class Notice:
    """A producer's word that a chunk is in the connector (relayed by the pipeline to the consumer)."""

    key: ChunkKey
    final: bool


@dataclass(frozen=True)
class ConnectorSpec:
    """Which connector an edge uses; picklable, so every process builds its own handle to the same store."""

    kind: str                       # "inproc" | "shm"
    name: str = ""                  # the store's name (shm: the prefix of its segments)


class Connector(ABC):
    @abstractmethod
    def put(self, key: ChunkKey, chunk: Chunk) -> None: ...

    @abstractmethod
    def get(self, key: ChunkKey) -> Chunk: ...

    @abstractmethod
    def discard(self, keys: Iterable[ChunkKey]) -> None:
        """Drop these chunks if they are there (their request ended before the consumer read them)."""

    def deliver(self, notices: list[Notice]) -> list[Notice]:
        """The notices to hand to consumers now (all of them, in order, for real connectors)."""
        return notices

    def close(self) -> None:
        pass


class InprocConnector(Connector):
    """Chunks in a dict of this process (stages whose engines run in this process)."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, Chunk] = {}
        self._lock = threading.Lock()

    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        with self._lock:
            if key in self._chunks:
                raise ValueError(f"{key} was put twice")
            self._chunks[key] = chunk

    def get(self, key: ChunkKey) -> Chunk:
        with self._lock:
            chunk = self._chunks.pop(key, None)
        if chunk is None:
            raise ChunkMissingError(f"{key} was announced but is not in the connector")
        return chunk

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._chunks.pop(key, None)

    def __len__(self) -> int:
        return len(self._chunks)


class ShmConnector(Connector):
    """One POSIX shared-memory segment per chunk, named from the store's name and the key.

    Layout: 8 bytes header length, a pickled header (chunk fields, and per tensor its dtype, shape and
    byte offset), then the tensors' bytes. The producer writes and closes it; the consumer maps it, copies
    the tensors out and unlinks it. Segments of requests that end before their chunks are read are
    unlinked by `discard` in the consumer's process.
    """

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("a shared-memory connector needs a name (the prefix of its segments)")
        self.name = name

    def _segment(self, key: ChunkKey) -> str:
        # A stable digest (the same in every process; str hashes are salted per process).
        digest = hashlib.blake2b(f"{key.request_id}\0{key.from_stage}\0{key.to_stage}".encode(), digest_size=8)
        return f"{self.name}-{digest.hexdigest()}-{key.index}"

    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        tensors: dict[str, np.ndarray] = {}
        header: dict[str, Any] = {"first": chunk.first, "num_rows": chunk.num_rows, "final": chunk.final,
                                  "key": key, "values": {}, "tensors": {}}
        offset = 0
        for name, value in chunk.payload.items():
            if isinstance(value, torch.Tensor):
                array = value.detach().to("cpu").contiguous()
                dtype = str(array.dtype).removeprefix("torch.")
                raw = array.reshape(-1).view(torch.uint8).numpy() if array.numel() else np.zeros(0, np.uint8)
                header["tensors"][name] = (dtype, tuple(array.shape), offset, raw.nbytes)
                tensors[name] = raw
                offset += (raw.nbytes + 63) // 64 * 64
            else:
                header["values"][name] = value
        head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        base = (8 + len(head) + 63) // 64 * 64
        segment = shared_memory.SharedMemory(name=self._segment(key), create=True, size=max(base + offset, 1))
        try:
            buffer = segment.buf
            buffer[:8] = len(head).to_bytes(8, "little")
            buffer[8:8 + len(head)] = head
            for name, raw in tensors.items():
                start = base + header["tensors"][name][2]
                buffer[start:start + raw.nbytes] = raw.data
        finally:
            segment.close()
        _untrack(segment)

    def get(self, key: ChunkKey) -> Chunk:
        try:
            segment = shared_memory.SharedMemory(name=self._segment(key))
        except FileNotFoundError:
            raise ChunkMissingError(f"{key} was announced but is not in the shared-memory connector") from None
        try:
            buffer = segment.buf
            head_len = int.from_bytes(bytes(buffer[:8]), "little")
            header = pickle.loads(bytes(buffer[8:8 + head_len]))
            if header["key"] != key:
                raise ChunkMissingError(f"{key}: the segment holds {header['key']} instead")
            base = (8 + head_len + 63) // 64 * 64
            payload = dict(header["values"])
            for name, (dtype, shape, start, nbytes) in header["tensors"].items():
                torch_dtype = getattr(torch, dtype)
                if nbytes == 0:
                    payload[name] = torch.empty(shape, dtype=torch_dtype)
                    continue
                data = bytearray(buffer[base + start:base + start + nbytes])     # the one copy out of the segment
                payload[name] = torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
        finally:
            segment.close()
            segment.unlink()
        return Chunk(header["first"], header["num_rows"], payload, header["final"])

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            try:
                segment = shared_memory.SharedMemory(name=self._segment(key))
            except FileNotFoundError:
                continue
            segment.close()
            segment.unlink()


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Python's resource tracker would unlink a segment its creator made when that process exits (and warn):
    a chunk outlives its producer's handle, and the consumer unlinks it (unlink() unregisters it there)."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(segment._name, "shared_memory")   # type: ignore[attr-defined]
    except Exception:
        pass


_INPROC: dict[str, Connector] = {}
_INPROC_LOCK = threading.Lock()


def open_connector(spec: ConnectorSpec) -> Connector:
    """This process's handle to the store `spec` names (inproc stores are shared by name in a process)."""
    if spec.kind == "inproc":
        with _INPROC_LOCK:
            return _INPROC.setdefault(spec.name, InprocConnector())
    if spec.kind == "shm":
        return ShmConnector(spec.name)
    raise ValueError(f"unknown connector {spec.kind!r}; known: inproc, shm")


def set_inproc_connector(name: str, connector: Connector) -> None:
    """Serve the in-process store `name` with `connector` from now on (e.g. a wrapper that records or
    delays deliveries); stages open it by name."""
    with _INPROC_LOCK:
        _INPROC[name] = connector      # type: ignore[assignment]


def forget_inproc(name: str) -> None:
    """Drop an inproc store (its pipeline shut down)."""
    with _INPROC_LOCK:
        _INPROC.pop(name, None)
