"""A request's stream of rows on one edge, cut into chunks (producer) and put back in order (consumer).

Rows are indexed: a position of the producer's sequence ("tokens" rows: the thinker's per-position
hidden states), or an output index ("samples" rows: the talker's frames). The producer adds rows as
steps compute them, releases those that are final (below a limit its stage decides) and cuts chunks at
fixed boundaries: chunk i ends at row `base + first_chunk_size + i * chunk_size` (`base`: the rows that ride
with the first chunk, e.g. the prompt's; `first_chunk_size`, chunk_size unless set smaller so that the next
stage starts sooner), and the rest goes with the end of the stream. A chunk size of 0 means "all": one
chunk at the end, the stage-after-stage pipeline on the same code path.

Every chunk is cut from the rows not sent yet (never from row 0 again), a row computed twice (a request
recomputed after preemption) is kept once, and a gap is an error. The consumer takes chunks in index
order whatever order their notices come in, and refuses one it already has.
"""
from __future__ import annotations

from typing import Any

import torch

from pellucid.pipeline.connectors import Chunk, ChunkKey, ChunkMissingError, Connector, Notice

ALL = 0     # chunk size of an edge that sends everything at the end


def check_first_chunk_size(first_chunk_size: int | None, chunk_size: int) -> None:
    """A first chunk smaller than the steady ones (None: the same); an edge sending everything at the end has none."""
    if first_chunk_size is None:
        return
    if chunk_size == ALL:
        raise ValueError("first_chunk_size needs a chunk size: an edge that sends everything at the end has one chunk")
    if isinstance(first_chunk_size, bool) or not isinstance(first_chunk_size, int) or first_chunk_size < 1:
        raise ValueError(f"first_chunk_size must be a positive number of rows, got {first_chunk_size!r}")


class ChunkSender:
    """The producer's side of one request on one edge."""

    def __init__(self, request_id: str, from_stage: str, to_stage: str, connector: Connector, chunk_size: int,
                 base: int, header: dict[str, Any] | None = None, first_chunk_size: int | None = None) -> None:
        if chunk_size < 0:
            raise ValueError(f"chunk size must be >= 0 (0: everything at the end), got {chunk_size}")
        check_first_chunk_size(first_chunk_size, chunk_size)
        self.request_id, self.from_stage, self.to_stage = request_id, from_stage, to_stage
        self.connector = connector
        self.chunk_size = chunk_size
        self.first_chunk_size = first_chunk_size or chunk_size
        self.base = base
        self.header = header or {}      # rides with chunk 0 (the producer's constants the consumer needs)
        self.next_row = 0               # rows below it are held or sent
        self.sent_rows = 0              # rows below it are sent
        self.next_chunk = 0
        self.finished = False
        self._held: list[tuple[int, dict[str, torch.Tensor]]] = []      # (first row, payload), in order

    def add(self, first: int, rows: dict[str, torch.Tensor]) -> None:
        """Rows [first, first + n) just computed; those below next_row were computed before (recompute)."""
        n = _num_rows(rows)
        if first + n <= self.next_row:
            return
        if first > self.next_row:
            raise RuntimeError(f"request {self.request_id}: rows {self.next_row}..{first - 1} for {self.to_stage} "
                               f"were never computed (got rows from {first})")
        skip = self.next_row - first
        if skip:
            rows = {name: value[skip:] for name, value in rows.items()}
        self._held.append((self.next_row, rows))
        self.next_row += n - skip

    def release(self, limit: int, final: bool) -> list[tuple[ChunkKey, Chunk]]:
        """Chunks now complete among the rows below `limit` (rows at or past it may still change: a token not
        fed yet); with `final`, the rest below `limit` as the last chunk. Returns what to put."""
        if self.finished:
            return []
        ready = min(limit, self.next_row)
        chunks = []
        while self.chunk_size != ALL:
            boundary = self.base + self.first_chunk_size + self.next_chunk * self.chunk_size
            if boundary > ready or (final and boundary >= ready):
                break           # the end of the stream takes the last rows, so the last chunk is never empty
            chunks.append(self._cut(boundary, False))
        if final:
            chunks.append(self._cut(ready, True))
            self.finished = True
            self._held = []
        return chunks

    def _cut(self, end: int, final: bool) -> tuple[ChunkKey, Chunk]:
        start = self.sent_rows
        parts: dict[str, list[torch.Tensor]] = {}
        kept = []
        for first, rows in self._held:
            n = _num_rows(rows)
            lo, hi = max(start, first), min(end, first + n)
            if lo < hi:
                for name, value in rows.items():
                    parts.setdefault(name, []).append(value[lo - first:hi - first])
            if first + n > end:
                kept.append((first, rows) if first >= end else (end, {k: v[end - first:] for k, v in rows.items()}))
        self._held = kept
        payload: dict[str, Any] = {name: torch.cat(values) for name, values in parts.items()}
        if self.next_chunk == 0:
            payload.update(self.header)
        key = ChunkKey(self.request_id, self.from_stage, self.to_stage, self.next_chunk)
        self.next_chunk += 1
        self.sent_rows = end
        return key, Chunk(start, end - start, payload, final)


class ChunkReceiver:
    """The consumer's side of one request on one edge: chunks back in index order."""

    def __init__(self, request_id: str, from_stage: str, to_stage: str) -> None:
        self.request_id, self.from_stage, self.to_stage = request_id, from_stage, to_stage
        self.next_chunk = 0
        self.next_row = 0
        self.ended = False
        self._early: dict[int, Chunk] = {}      # arrived ahead of a chunk still on its way

    def arrived(self, notice: Notice, connector: Connector) -> list[Chunk]:
        """Take the announced chunk out of the connector; return the chunks now in order (maybe none)."""
        key = notice.key
        if (key.request_id, key.from_stage, key.to_stage) != (self.request_id, self.from_stage, self.to_stage):
            raise ValueError(f"{key} was delivered to request {self.request_id!r}'s input from {self.from_stage}")
        if key.index < self.next_chunk or key.index in self._early:
            raise ChunkMissingError(f"{key} was delivered twice")
        if self.ended:
            raise ChunkMissingError(f"{key} came after the end of its stream")
        self._early[key.index] = connector.get(key)
        ready = []
        while self.next_chunk in self._early:
            chunk = self._early.pop(self.next_chunk)
            if chunk.first != self.next_row:
                raise ChunkMissingError(f"chunk {self.next_chunk} of request {self.request_id!r} starts at row "
                                        f"{chunk.first}, expected {self.next_row}")
            self.next_chunk += 1
            self.next_row += chunk.num_rows
            ready.append(chunk)
            if chunk.final:
                self.ended = True
                if self._early:
                    raise ChunkMissingError(f"request {self.request_id!r}: chunks {sorted(self._early)} came after "
                                            f"the end of its stream at chunk {self.next_chunk - 1}")
                break
        return ready


def _num_rows(rows: dict[str, torch.Tensor]) -> int:
    sizes = {value.shape[0] for value in rows.values()}
    if len(sizes) != 1:
        raise ValueError(f"a chunk's row tensors disagree on their number of rows: {sizes}")
    return sizes.pop()
