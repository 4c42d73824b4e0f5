"""Chunks between stages: cut from a producer's rows at the right offsets (never from row 0 again), rows a
recompute produced twice kept once, put back in order whatever order their notices come in, a chunk
delivered twice or announced but absent refused by name; the shared-memory connector across processes."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch

from pellucid.pipeline.chunks import ALL, ChunkReceiver, ChunkSender
from pellucid.pipeline.connectors import (Chunk, ChunkKey, ChunkMissingError, InprocConnector, Notice,
                                          ShmConnector)


def stream_rows(sender: ChunkSender, rows: torch.Tensor, rng: random.Random, prompt: int) -> list:
    """Feed `rows` as a stage computes them: the prompt, then steps of 1-3 rows, with a recompute from row 0
    (preemption) once; returns the chunks put, in order."""
    put = []
    computed, recomputed = 0, False
    while computed < len(rows):
        n = prompt if computed == 0 else rng.randint(1, 3)
        sender.add(computed, {"x": rows[computed:computed + n]})
        computed = min(computed + n, len(rows))
        if not recomputed and computed > prompt + 2:
            sender.add(0, {"x": rows[:computed]})       # the same rows again: kept once
            recomputed = True
        put += sender.release(computed - 1, False)
    put += sender.release(len(rows), True)
    return put


@pytest.mark.parametrize("chunk_size,first_chunk_size", [(1, None), (3, None), (7, None), (ALL, None), (7, 1),
                                                       (5, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_carry_every_row_once_in_order(chunk_size: int, first_chunk_size: int | None, seed: int) -> None:
    rng = random.Random(seed)
    rows = torch.randn(rng.randint(15, 40), 3)
    prompt = rng.randint(2, 6)
    connector = InprocConnector()
    sender = ChunkSender("r", "a", "b", connector, chunk_size, base=prompt, header={"h": torch.ones(2)},
                         first_chunk_size=first_chunk_size)
    chunks = stream_rows(sender, rows, rng, prompt)
    assert [key.index for key, _ in chunks] == list(range(len(chunks)))
    assert [c.final for _, c in chunks] == [False] * (len(chunks) - 1) + [True]
    if chunk_size != ALL:       # chunk i ends at prompt + first + i * chunk_size; only the last is shorter
        first = first_chunk_size or chunk_size
        assert all(c.first + c.num_rows == prompt + first + k.index * chunk_size for k, c in chunks[:-1])
        assert len(chunks) > 1 and chunks[0][1].num_rows == prompt + first
    for key, chunk in chunks:
        connector.put(key, chunk)
    receiver = ChunkReceiver("r", "a", "b")
    notices = [Notice(key, chunk.final) for key, chunk in chunks]
    rng.shuffle(notices)
    got = [c for notice in notices for c in receiver.arrived(notice, connector)]
    assert receiver.ended and len(connector) == 0
    assert torch.equal(torch.cat([c.payload["x"] for c in got]), rows)
    assert torch.equal(got[0].payload["h"], torch.ones(2))
    with pytest.raises(ChunkMissingError, match="delivered twice"):
        receiver.arrived(notices[0], connector)


def test_first_chunk_size_is_checked() -> None:
    with pytest.raises(ValueError, match="needs a chunk size"):
        ChunkSender("r", "a", "b", InprocConnector(), ALL, base=0, first_chunk_size=2)
    with pytest.raises(ValueError, match="positive number of rows"):
        ChunkSender("r", "a", "b", InprocConnector(), 4, base=0, first_chunk_size=0)


def test_missing_and_gaps_are_errors_naming_the_chunk() -> None:
    connector = InprocConnector()
    receiver = ChunkReceiver("r", "thinker", "talker")
    with pytest.raises(ChunkMissingError, match="chunk 0 of request 'r' from thinker to talker"):
        receiver.arrived(Notice(ChunkKey("r", "thinker", "talker", 0), False), connector)
    sender = ChunkSender("r", "thinker", "talker", connector, 2, base=0)
    sender.add(0, {"x": torch.zeros(2, 1)})
    with pytest.raises(RuntimeError, match="rows 2..3 .* were never computed"):
        sender.add(4, {"x": torch.zeros(1, 1)})


def test_shared_memory_chunks_cross_processes() -> None:
    """A chunk put by another process is read here once, bit for bit, and its segment is gone after."""
    name = f"pellucid-test-{random.randrange(1 << 30):x}"
    key = ChunkKey("req-1", "thinker", "talker", 3)
    script = textwrap.dedent(f"""
        import torch
        from pellucid.pipeline.connectors import Chunk, ChunkKey, ShmConnector
        g = torch.Generator().manual_seed(7)
        payload = {{"embed": torch.randn(5, 8, generator=g).bfloat16(), "ids": torch.arange(5), "n": 3}}
        ShmConnector({name!r}).put(ChunkKey("req-1", "thinker", "talker", 3), Chunk(10, 5, payload, True))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    connector = ShmConnector(name)
    chunk = connector.get(key)
    g = torch.Generator().manual_seed(7)
    assert (chunk.first, chunk.num_rows, chunk.final, chunk.payload["n"]) == (10, 5, True, 3)
    assert torch.equal(chunk.payload["embed"], torch.randn(5, 8, generator=g).bfloat16())
    assert torch.equal(chunk.payload["ids"], torch.arange(5))
    with pytest.raises(ChunkMissingError, match="chunk 3 of request 'req-1'"):
        connector.get(key)
    connector.put(key, Chunk(0, 0, {}, True))
    connector.discard([key])
    with pytest.raises(ChunkMissingError):
        connector.get(key)
