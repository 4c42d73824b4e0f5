"""Decode saves kept in a SaveLog (one [steps, pairs] buffer) assemble like per-step records: against a
brute-force per-position reference, with records before and after the log, recomputed positions, position
limits, several logs, and only some of a log's pairs finishing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pellucid.tracing.ops import Save
from pellucid.tracing.plan import TracePlan, finalize_plans
from pellucid.tracing.save_log import STEPS_PER_BLOCK, SaveLog

HIDDEN = 5


def _plan() -> TracePlan:
    plan = TracePlan([Save(site="model.layers.0", name="h")])
    plan.bound = True
    plan.sites = [SimpleNamespace(shape=(HIDDEN,), dtype=torch.float32)]
    plan.saves = {"h": []}
    return plan


def test_log_blocks_hold_the_rows_written() -> None:
    """flat_blocks / row_index / positions_of (how plan.py reads a log) give back each pair's rows and
    positions of every step, across block boundaries, for any subset of pairs in any order."""
    gen = torch.Generator().manual_seed(0)
    num_pairs, steps = 6, 2 * STEPS_PER_BLOCK + 3          # crosses block boundaries
    log = SaveLog(num_pairs)
    written = []
    for step in range(steps):
        source = torch.randn(10, HIDDEN, generator=gen)
        index = torch.randperm(10, generator=gen)[:num_pairs]
        log.write(source, index, np.arange(num_pairs, dtype=np.int64) * 100 + step)
        written.append(source[index])
    for pairs in ([0, 1, 2, 3, 4, 5], [4, 1], [3]):
        pairs_np = np.array(pairs, dtype=np.int64)
        index = torch.from_numpy(log.row_index(pairs_np, steps).ravel())
        rows = torch.cat(log.flat_blocks(steps)).index_select(0, index)
        positions = log.positions_of(pairs_np, steps)
        expected = torch.stack([torch.stack([w[p] for w in written]) for p in pairs])
        torch.testing.assert_close(rows, expected.reshape(-1, HIDDEN), rtol=0, atol=0)
        assert positions.tolist() == [[p * 100 + s for s in range(steps)] for p in pairs]


@pytest.mark.parametrize("seed", range(6))
def test_logged_saves_match_per_position_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    plans = [_plan() for _ in range(int(rng.integers(2, 7)))]
    expected: list[dict[int, torch.Tensor]] = [{} for _ in plans]
    next_position = [int(rng.integers(0, 4)) for _ in plans]

    def record_chunk(members: list[int]) -> None:       # an ordinary per-step record, one row each
        chunk = torch.randn(len(members), HIDDEN, generator=gen)
        for k, i in enumerate(members):
            position = next_position[i] if rng.random() < 0.8 else int(rng.integers(0, next_position[i] + 1))
            plans[i].record_save(0, position, chunk, k)
            expected[i][position] = chunk[k]
            next_position[i] = max(next_position[i], position + 1)

    for _layout in range(int(rng.integers(1, 4))):
        record_chunk([i for i in range(len(plans)) if rng.random() < 0.6])
        members = [i for i in range(len(plans)) if rng.random() < 0.8] or [0]
        if rng.random() < 0.3:      # recomputed after preemption: the layout starts at earlier positions
            for i in members:
                next_position[i] = int(rng.integers(0, next_position[i] + 1))
        log = SaveLog(len(members))
        for pair, i in enumerate(members):
            plans[i].saves["h"].extend((log, None, pair))
        for _step in range(int(rng.integers(1, STEPS_PER_BLOCK + 5))):
            source = torch.randn(len(members) + 2, HIDDEN, generator=gen)
            index = torch.randperm(len(members) + 2, generator=gen)[:len(members)]
            positions = np.array([next_position[i] for i in members], dtype=np.int64)
            log.write(source, index, positions)
            for pair, i in enumerate(members):
                expected[i][next_position[i]] = source[index[pair]]
                next_position[i] += 1
    record_chunk([i for i in range(len(plans)) if rng.random() < 0.5])
    limits = [int(rng.integers(1, next_position[i] + 2)) if rng.random() < 0.5 else None
              for i in range(len(plans))]
    finishing = [i for i in range(len(plans)) if rng.random() < 0.7] or [len(plans) - 1]
    results = finalize_plans([plans[i] for i in finishing], [limits[i] for i in finishing])
    for i, result in zip(finishing, results):
        want = {p: v for p, v in expected[i].items() if limits[i] is None or p < limits[i]}
        assert result["save_positions"]["h"] == sorted(want)
        got = result["saves"]["h"]
        assert got.shape == (len(want), HIDDEN)
        if want:
            torch.testing.assert_close(got, torch.stack([want[p] for p in sorted(want)]), rtol=0, atol=0)
    # Plans still running keep their log references and assemble later to the same reference.
    rest = [i for i in range(len(plans)) if i not in finishing]
    for i, result in zip(rest, finalize_plans([plans[i] for i in rest])):
        want = expected[i]
        assert result["save_positions"]["h"] == sorted(want)
        if want:
            torch.testing.assert_close(result["saves"]["h"], torch.stack([want[p] for p in sorted(want)]),
                                       rtol=0, atol=0)
