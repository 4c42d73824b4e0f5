"""Batched assembly of saves at finish (finalize_plans) against a brute-force per-position reference."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pellucid.tracing.ops import Save
from pellucid.tracing.plan import TracePlan, finalize_plans

SHAPES = {"h": ((6,), torch.float32), "q": ((2, 3), torch.float64), "tok": ((), torch.int64)}


def _plan() -> TracePlan:
    plan = TracePlan([Save(site="model.layers.0", name="h"), Save(site="model.layers.1", name="q"),
                      Save(site="tokens", name="tok"), Save(site="model.layers.2", name="empty")])
    plan.bound = True
    plan.sites = [SimpleNamespace(shape=SHAPES[n][0] if n in SHAPES else (5,),
                                  dtype=SHAPES[n][1] if n in SHAPES else torch.float16)
                  for n in ("h", "q", "tok", "empty")]
    plan.saves = {name: [] for name in plan.save_names.values()}
    return plan


def _random_chunk(rows: int, name: str, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    shape, dtype = SHAPES[name]
    if dtype == torch.int64:
        return torch.randint(0, 1000, (rows, *shape), generator=gen).to(device)
    return torch.randn((rows, *shape), generator=gen, dtype=dtype).to(device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_finalize_plans_matches_per_position_reference(seed: int, device: str) -> None:
    """Random records (decode chunks, prefill chunks, per-request chunks, recomputed positions), random
    position limits (rows a step launched ahead recorded past a request's end), on the CPU and the GPU."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    plans = [_plan() for _ in range(int(rng.integers(1, 6)))]
    expected: list[dict[str, dict[int, torch.Tensor]]] = [{n: {} for n in SHAPES} for _ in plans]
    op_of = {"h": 0, "q": 1, "tok": 2}
    for _step in range(int(rng.integers(3, 9))):
        for name in SHAPES:
            kind = rng.integers(0, 3)
            if kind == 0:       # a decode step's shared chunk: one row per plan (int position, start k)
                members = [i for i in range(len(plans)) if rng.random() < 0.7]
                chunk = _random_chunk(len(members) + int(rng.integers(0, 3)), name, gen, device)   # spare rows
                order = rng.permutation(len(members))
                for k, j in enumerate(order.tolist()):
                    i = members[j]
                    position = int(rng.integers(0, 12))       # repeats model recomputes
                    plans[i].record_save(op_of[name], position, chunk, k)
                    expected[i][name][position] = chunk[k]
            elif kind == 1:     # a prefill tap's shared chunk: a run of rows per plan
                start = 0
                chunk = _random_chunk(40, name, gen, device)
                for i in range(len(plans)):
                    n = int(rng.integers(0, 5))
                    positions = np.sort(rng.choice(12, size=n, replace=False))
                    if n:
                        plans[i].record_save(op_of[name], positions, chunk, start)
                        for j, p in enumerate(positions.tolist()):
                            expected[i][name][p] = chunk[start + j]
                    start += n
            else:               # the per-request path: a chunk of its own (start None)
                i = int(rng.integers(0, len(plans)))
                positions = np.sort(rng.choice(12, size=int(rng.integers(1, 4)), replace=False))
                chunk = _random_chunk(positions.size, name, gen, device)
                plans[i].record_save(op_of[name], positions, chunk)
                for j, p in enumerate(positions.tolist()):
                    expected[i][name][p] = chunk[j]
    failed = len(plans) > 1 and rng.random() < 0.5
    if failed:
        plans[-1].fail(0, RuntimeError("boom"))
    chunks_before = {id(c): (c, c.clone()) for plan in plans for lst in plan.saves.values() for c in lst[1::3]}
    assert chunks_before
    limits = [int(rng.integers(1, 14)) if rng.random() < 0.6 else None for _ in plans]
    results = finalize_plans(plans, limits)
    for i, (plan, result) in enumerate(zip(plans, results)):
        assert plan.finalized
        if failed and i == len(plans) - 1:
            assert "boom" in result["trace_error"]["message"]
            continue
        for name, (shape, dtype) in SHAPES.items():
            want = {p: v for p, v in expected[i][name].items() if limits[i] is None or p < limits[i]}
            got = result["saves"][name]
            assert result["save_positions"][name] == sorted(want)
            assert got.device.type == "cpu" and got.dtype == dtype and got.shape == (len(want), *shape)
            if want:
                torch.testing.assert_close(got, torch.stack([want[p] for p in sorted(want)]).cpu(), rtol=0, atol=0)
        assert result["saves"]["empty"].shape == (0, 5) and result["save_positions"]["empty"] == []
    # Saves are copies: writing to one changes no other save and no recorded chunk.
    live = [r for r in results if "saves" in r and r["saves"]["h"].numel()]
    if live:
        snapshot = [r["saves"]["h"].clone() for r in live]
        live[0]["saves"]["h"].fill_(1e6)
        for r, before in zip(live[1:], snapshot[1:]):
            torch.testing.assert_close(r["saves"]["h"], before)
    for chunk, before in chunks_before.values():
        torch.testing.assert_close(chunk, before, rtol=0, atol=0)


def test_finalize_matches_batched() -> None:
    """One plan at a time gives the same result as all plans together."""
    gen = torch.Generator().manual_seed(5)
    chunk = torch.randn(3, 6, generator=gen)
    single, together = [_plan() for _ in range(3)], [_plan() for _ in range(3)]
    for plans in (single, together):
        for k, plan in enumerate(plans):
            plan.record_save(0, 7, chunk, k)
            plan.record_save(0, np.array([2, 3]), chunk[k:k + 1].expand(2, 6).contiguous())
    one_by_one = [plan.finalize() for plan in single]
    batched = finalize_plans(together)
    for a, b in zip(one_by_one, batched):
        assert a["save_positions"] == b["save_positions"]
        for name in a["saves"]:
            torch.testing.assert_close(a["saves"][name], b["saves"][name])
        assert a["save_positions"]["h"] == [2, 3, 7]
