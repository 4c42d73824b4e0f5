"""Test doubles around the real connectors: deliveries delayed and reordered at random, chunks lost."""
from __future__ import annotations

import random

from pellucid.pipeline.connectors import ChunkKey, Connector, Notice, open_connector, set_inproc_connector


class _Wrapper(Connector):
    """A connector around a real one: everything passes through unless a subclass says otherwise."""

    def __init__(self, inner: Connector) -> None:
        self.inner = inner

    def put(self, key, chunk) -> None:
        self.inner.put(key, chunk)

    def get(self, key):
        return self.inner.get(key)

    def discard(self, keys) -> None:
        self.inner.discard(keys)

    def __len__(self) -> int:
        return len(self.inner)


class ShuffledDelivery(_Wrapper):
    """Wraps a connector: each notice is held back with probability `hold` and released later, at random,
    in random order, interleaved with newer ones; every notice is released in the end (each deliver call
    releases some held ones, and a notice is held at most `max_rounds` deliver calls)."""

    def __init__(self, inner: Connector, seed: int, hold: float = 0.6, max_rounds: int = 4) -> None:
        super().__init__(inner)
        self.rng = random.Random(seed)
        self.hold = hold
        self.max_rounds = max_rounds
        self.held: list[tuple[int, Notice]] = []
        self.num_reordered = 0

    def deliver(self, notices: list[Notice]) -> list[Notice]:
        out = []
        for notice in notices:
            if self.rng.random() < self.hold:
                self.held.append((0, notice))
            else:
                out.append(notice)
        kept = []
        for rounds, notice in self.held:
            if rounds >= self.max_rounds or self.rng.random() < 0.4:
                out.append(notice)
            else:
                kept.append((rounds + 1, notice))
        self.held = kept
        self.rng.shuffle(out)
        self.num_reordered += sum(1 for a, b in zip(out, out[1:]) if a.key > b.key)
        return out


class LosingConnector(_Wrapper):
    """Wraps a connector and loses the chunks of `lost` (their notices still go out)."""

    def __init__(self, inner: Connector, lost: set[ChunkKey]) -> None:
        super().__init__(inner)
        self.lost = lost

    def put(self, key, chunk) -> None:
        if key not in self.lost:
            self.inner.put(key, chunk)


def install(pipeline, wrap) -> list[Connector]:
    """Serve each edge's in-process store with `wrap(real connector)` (the stages open it by name)."""
    wrapped = []
    for spec in pipeline.connectors.values():
        assert spec.kind == "inproc"
        wrapped.append(wrap(open_connector(spec)))
        set_inproc_connector(spec.name, wrapped[-1])
    return wrapped


class RecordingConnector(_Wrapper):
    """Wraps a connector and keeps a copy of every chunk put (e.g. the talker's frames, per request)."""

    def __init__(self, inner: Connector) -> None:
        super().__init__(inner)
        self.chunks: dict[ChunkKey, object] = {}

    def put(self, key, chunk) -> None:
        self.chunks[key] = chunk
        self.inner.put(key, chunk)

    def rows(self, request_id: str, name: str):
        import torch
        chunks = sorted((k.index, c) for k, c in self.chunks.items() if k.request_id == request_id)
        return torch.cat([c.payload[name] for _, c in chunks if c.num_rows])


class DroppingDelivery(_Wrapper):
    """Wraps a connector and never delivers the notices of `dropped` (a relay that loses them)."""

    def __init__(self, inner: Connector, dropped: set[ChunkKey]) -> None:
        super().__init__(inner)
        self.dropped = dropped

    def deliver(self, notices: list[Notice]) -> list[Notice]:
        return [n for n in notices if n.key not in self.dropped]
