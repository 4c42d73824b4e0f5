"""Shared by the kernel check scripts and the tests that run them: the error measure, and running a
check script under the Triton interpreter in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    # bf16: one rounding step is ~4e-3 relative; the Triton interpreter truncates instead of rounding to nearest.
    limit = 1e-5 if dtype == torch.float32 else (2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 4e-3)
    assert err < limit, f"{what}: relative error {err:.3g} >= {limit}"


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_file(path: str, *args: str, timeout: float = 600) -> str:
    """Run the Python file `path` with `args` on the CPU under the Triton interpreter, the repository importable;
    its stdout, after asserting that it exited 0. The interpreter must be chosen before triton is imported, hence
    a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, path, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


UNSUPPORTED = "INTERPRETER_UNSUPPORTED"


def interpreter_runs_loaded_loop_bounds() -> bool:
    """Inside an interpreted script: whether this Triton interpreter runs loops bounded by loaded values. Older
    ones (3.6 seen) call int() on 1-element arrays, which numpy >= 2.4 refuses, so such a loop fails there before
    reaching our code; then this prints the UNSUPPORTED marker, which interpreted_checks turns into a skip."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def probe(bound_ptr, out_ptr):
        total = 0
        for i in range(0, tl.load(bound_ptr)):
            total += i
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe[(1,)](torch.tensor([4], dtype=torch.int32), out)
    except Exception as exc:  # the interpreter wraps the TypeError in its own error type
        if "0-dimensional arrays" not in repr(exc):
            raise
        print(f"{UNSUPPORTED}: the triton {triton.__version__} interpreter with numpy {numpy.__version__} cannot "
              "run loops bounded by loaded values")
        return False
    return int(out) == 6


def interpreted_checks(path: str, passed: str) -> None:
    """Run the file `path` with --interpret under the Triton interpreter: it must print `passed`, or the
    UNSUPPORTED marker (interpreter_runs_loaded_loop_bounds), which skips the calling test."""
    stdout = interpret_file(path, "--interpret")
    if UNSUPPORTED in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    assert passed in stdout


def run_script_under_interpreter(script: str) -> None:
    """Run tests/gpu/`script` on the CPU under the Triton interpreter; it exits non-zero on a mismatch."""
    interpret_file(os.path.join(HERE, script), "cpu")


def make_kv_store(num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                  g: torch.Generator):
    """A FusedKVStore over a random 6-block cache (block size 4), distinct random slots with two padding rows
    (slot -1), and random values; plus a copy of the cache before any store."""
    from pellucid.attention.fused_kv_store import FusedKVStore
    cache = torch.randn(2, 6, 4, kv_heads, head_dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(24, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:2]] = -1
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype).to(device)
    return FusedKVStore(value, cache, slots.to(device)), cache.clone()


def assert_kv_stored(store, cache_before: torch.Tensor, key: torch.Tensor, what: str) -> None:
    """Brute force: each token with a slot has exactly its key and value there; every other entry is unchanged."""
    assert store.stored, f"{what}: the kernel did not mark the KV store done"
    expected = cache_before.clone()
    block_size = expected.shape[2]
    for token, slot in enumerate(store.slot_mapping.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[token]
            expected[1, slot // block_size, slot % block_size] = store.value[token]
    assert torch.equal(store.kv_cache, expected), f"{what}: the KV cache differs from the slot-by-slot store"
