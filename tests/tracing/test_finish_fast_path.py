"""finalize_plans' vectorised assembly (rows taken straight from chunks and SaveLog blocks, limits and
recomputes filtered per row, a copy per piece) against a brute-force per-record walk, on random record
layouts: the engine's common shape (a prefill run and a SaveLog reference per request), decode records of
one row, per-request chunks, positions at and beyond the limit, recomputed positions, logs read only in
part, and several saves of different shapes and dtypes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pellucid.tracing.ops import Save
from pellucid.tracing.plan import TracePlan, finalize_plans
from pellucid.tracing.save_log import STEPS_PER_BLOCK, SaveLog

SAVES = {"h": ((4,), torch.float32), "q": ((2, 3), torch.float16), "tok": ((), torch.int64)}


def _plan(keep_on_device: bool = False) -> TracePlan:
    plan = TracePlan([Save(site=f"model.layers.{i}", name=name) for i, name in enumerate(SAVES)],
                     keep_saves_on_device=keep_on_device)
    plan.bound = True
    plan.sites = [SimpleNamespace(shape=shape, dtype=dtype) for shape, dtype in SAVES.values()]
    plan.saves = {name: [] for name in SAVES}
    return plan


def _rows(count: int, name: str, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    shape, dtype = SAVES[name]
    if dtype == torch.int64:
        return torch.randint(0, 10_000, (count, *shape), generator=gen).to(device)
    return torch.randn((count, *shape), generator=gen).to(device, dtype)


def _reference(records: list, limit: int | None) -> tuple[list[int], list[torch.Tensor]]:
    """Walk the flat record list (positions, rows, start, ...) row by row; a later row of a position
    replaces an earlier one; positions at or beyond the limit are dropped."""
    by_position: dict[int, torch.Tensor] = {}
    for k in range(0, len(records), 3):
        positions, rows, start = records[k:k + 3]
        if type(positions) is SaveLog:
            log, pair = positions, start
            for step in range(log.num_steps):
                block, slot = divmod(step, STEPS_PER_BLOCK)
                by_position[int(log.positions[step][pair])] = log.blocks[block][slot, pair]
        elif type(positions) is int:
            by_position[positions] = rows[start or 0]
        else:
            for j, p in enumerate(positions.tolist()):
                by_position[p] = rows[(start or 0) + j]
    kept = sorted(p for p in by_position if limit is None or p < limit)
    return kept, [by_position[p] for p in kept]


def _record_random(plans: list[TracePlan], name: str, rng: np.random.Generator, gen: torch.Generator,
                   common_shape: bool, device: str) -> None:
    """Records as the engine makes them: a shared prefill chunk, then logged decode steps (or, in part,
    one-row decode records and per-request chunks), sometimes recomputed after a preemption."""
    op_index = list(SAVES).index(name)
    next_position = [0] * len(plans)
    lengths = [int(rng.integers(1, 9)) for _ in plans]
    chunk = _rows(sum(lengths) + int(rng.integers(0, 3)), name, gen, device)       # spare rows: read in part
    start = int(rng.integers(0, chunk.shape[0] - sum(lengths) + 1))
    for i, plan in enumerate(plans):
        plan.record_save(op_index, np.arange(lengths[i]), chunk, start)
        start += lengths[i]
        next_position[i] = lengths[i]
    for _layout in range(1 if common_shape else int(rng.integers(1, 4))):
        if not common_shape and rng.random() < 0.4:      # decode steps recorded one row per request
            for _step in range(int(rng.integers(1, 4))):
                rows = _rows(len(plans) + 1, name, gen, device)
                for k, plan in enumerate(plans):
                    plan.record_save(op_index, next_position[k], rows, k)
                    next_position[k] += 1
        if not common_shape and rng.random() < 0.3:      # a per-request chunk of its own (start None)
            i = int(rng.integers(0, len(plans)))
            positions = np.arange(next_position[i], next_position[i] + int(rng.integers(1, 4)))
            plans[i].record_save(op_index, positions, _rows(positions.size, name, gen, device))
            next_position[i] = int(positions[-1]) + 1
        if not common_shape and rng.random() < 0.3:      # recomputed after preemption: earlier positions again
            for i in range(len(plans)):
                next_position[i] = int(rng.integers(0, next_position[i] + 1))
        members = list(range(len(plans))) if common_shape else \
            [i for i in range(len(plans)) if rng.random() < 0.8] or [0]
        log = SaveLog(len(members))
        for pair, i in enumerate(members):
            plans[i].saves[name].extend((log, None, pair))
        for _step in range(int(rng.integers(1, 2 * STEPS_PER_BLOCK + 3))):
            source = _rows(len(members) + 2, name, gen, device)
            index = torch.randperm(len(members) + 2, generator=gen)[:len(members)].to(device)
            log.write(source, index, np.array([next_position[i] for i in members], dtype=np.int64))
            for i in members:
                next_position[i] += 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("common_shape", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_finalize_matches_record_walk(seed: int, common_shape: bool, device: str) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    plans = [_plan(keep_on_device=not common_shape and rng.random() < 0.2)
             for _ in range(int(rng.integers(1, 7)))]
    for name in SAVES:
        if rng.random() < 0.8 or name == "h":
            _record_random(plans, name, rng, gen, common_shape, device)
    recorded = [{name: list(plan.saves[name]) for name in SAVES} for plan in plans]
    blocks_before = {id(t): (t, t.clone()) for rec in recorded for lst in rec.values() for t in lst[1::3]
                     if t is not None}
    # Limits: none, beyond every position, or cutting into the recorded ones (a step launched ahead).
    limits = []
    for rec in recorded:
        top = max(_reference(rec[name], None)[0][-1] for name in SAVES if rec[name])
        limits.append([None, top + 1, top, int(rng.integers(0, top + 2))][int(rng.integers(0, 4))])
    results = finalize_plans(plans, limits)
    for plan, rec, limit, result in zip(plans, recorded, limits, results):
        for name, (shape, dtype) in SAVES.items():
            positions, rows = _reference(rec[name], limit)
            got = result["saves"][name]
            assert result["save_positions"][name] == positions
            assert got.dtype == dtype and tuple(got.shape) == (len(positions), *shape)
            assert got.device.type == (device if plan.keep_saves_on_device and rows else "cpu")
            if rows:
                torch.testing.assert_close(got, torch.stack(rows).to(got.device), rtol=0, atol=0)
    # Unless a plan asked for device tensors, each save owns its memory: writing to it changes no other
    # save and no recorded chunk or log.
    owned = [result["saves"][name] for plan, result in zip(plans, results) if not plan.keep_saves_on_device
             for name in SAVES if result["saves"][name].numel()]
    pointers = [save.untyped_storage().data_ptr() for save in owned]
    assert len(set(pointers)) == len(pointers)
    for save in owned:
        save.zero_()
    for tensor, before in blocks_before.values():
        torch.testing.assert_close(tensor, before, rtol=0, atol=0)


def test_rows_of_several_pieces_in_any_order() -> None:
    """Records whose rows interleave across chunks, read back to front and in part: the per-piece copies
    (whole, slice, gather) land each row where the reference puts it."""
    gen = torch.Generator().manual_seed(0)
    plans = [_plan() for _ in range(3)]
    a, b = _rows(10, "h", gen), _rows(6, "h", gen)
    plans[0].record_save(0, np.array([5, 6, 7]), a, 7)      # the tail of a
    plans[0].record_save(0, np.array([0, 1]), b, 4)
    plans[1].record_save(0, np.array([0, 1, 2]), b, 0)
    plans[1].record_save(0, 4, a, 2)                        # one row in the middle of a
    plans[2].record_save(0, np.array([3, 4]), a, 0)
    plans[2].record_save(0, np.array([3]), b, 3)
    plans[2].record_save(0, np.array([4]), a, 0)            # position 4 again: a[0] replaces a[1]
    recorded = [list(plan.saves["h"]) for plan in plans]
    results = finalize_plans(plans)
    for rec, result in zip(recorded, results):
        positions, rows = _reference(rec, None)
        assert result["save_positions"]["h"] == positions
        torch.testing.assert_close(result["saves"]["h"], torch.stack(rows), rtol=0, atol=0)


def test_every_row_beyond_the_limit_gives_the_sites_empty_save() -> None:
    gen = torch.Generator().manual_seed(1)
    plan = _plan()
    log = SaveLog(1)
    plan.saves["h"].extend((log, None, 0))
    log.write(_rows(1, "h", gen), torch.zeros(1, dtype=torch.long), np.array([9]))
    plan.record_save(1, np.array([9, 10]), _rows(2, "q", gen), 0)
    result = finalize_plans([plan], [9])[0]
    for name, (shape, dtype) in SAVES.items():
        assert result["save_positions"][name] == []
        assert result["saves"][name].shape == (0, *shape) and result["saves"][name].dtype == dtype


@pytest.mark.parametrize("seed", range(4))
def test_one_row_records_only(seed: int) -> None:
    """Saves recorded only as one-row decode records (no array, no log), with recomputed positions."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    plans = [_plan() for _ in range(int(rng.integers(1, 5)))]
    for _step in range(int(rng.integers(1, 12))):
        rows = _rows(len(plans) + 1, "h", gen)
        for k in rng.permutation(len(plans)).tolist():
            plans[k].record_save(0, int(rng.integers(0, 8)), rows, k)
    recorded = [list(plan.saves["h"]) for plan in plans]
    limits = [None if rng.random() < 0.5 else int(rng.integers(0, 9)) for _ in plans]
    for rec, limit, result in zip(recorded, limits, finalize_plans(plans, limits)):
        positions, rows = _reference(rec, limit) if rec else ([], [])
        assert result["save_positions"]["h"] == positions
        assert result["saves"]["h"].shape == (len(positions), 4)
        if rows:
            torch.testing.assert_close(result["saves"]["h"], torch.stack(rows), rtol=0, atol=0)
