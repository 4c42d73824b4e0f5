"""Programmatic dependent launch (PDL) for the small Triton kernels of a decode step.

At batch 1 a decode step is ~300 kernels of 2-5 us each, and inside a CUDA graph each still pays the
gap between one kernel's last block and the next kernel's first (grid launch, block scheduling,
prologue). On Hopper a kernel launched with PDL may start while the kernel before it still runs: its
blocks become resident, load what no earlier kernel writes (weights), and then block in
`griddepcontrol.wait` until the previous kernel has completed and its writes are visible. Each PDL
kernel also releases its dependents at its start, so the next launch overlaps this kernel's run.

The rule every PDL kernel keeps: before `wait_for_previous_kernel` it writes nothing and reads only
what no kernel of the step writes:
- weights;
- the step's metadata (positions, slot mapping, block table, sequence lengths, query starts), which
  host-to-device copies fill before the step's first kernel. A PDL kernel starts no earlier than the
  kernel before it started, and so on back to the step's first kernel, a plain launch that starts only
  once those copies are done;
- KV-cache entries of earlier positions (written by earlier steps), never those of the step's own
  tokens, which this step's KV write stores.
Everything else (activations, this step's K/V, split-KV partials) is read after the wait. Every
program waits before it exits, even one with nothing to do: a kernel whose programs all left early
could complete before the kernel it follows, and its successor waits only for it. The one exception
keeps that guarantee: programs with nothing to do may leave at once where other programs of the same
grid always wait (the split-KV decode kernel's empty splits; split 0 of each request waits), since a
grid completes only when all its programs have. A kernel launched without PDL is unaffected (it starts after everything
before it), and a PDL kernel after a kernel that never releases simply starts when that one ends, so
PDL kernels mix freely with cuBLAS and torch kernels.

PELLUCID_PDL=0 turns it off (the benchmarks use it to measure what it buys).
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

try:    # Triton >= 3.3 on NVIDIA; without it PDL stays off and these names are never reached
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def release_dependents(ENABLED: tl.constexpr):
    """Let the next PDL kernel launch now (it still waits for this one before touching its inputs)."""
    if ENABLED:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel(ENABLED: tl.constexpr):
    """Block until the previous kernel has completed and its memory writes are visible."""
    if ENABLED:
        gdc_wait()


def _triton_supports_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=8)
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_supports_pdl()


def pdl_enabled(x: torch.Tensor) -> bool:
    """True when kernels reading x may be launched with PDL: a Hopper-or-newer GPU, a Triton that
    supports it, and PELLUCID_PDL not set to 0."""
    if not x.is_cuda or os.environ.get("PELLUCID_PDL", "1") == "0":
        return False
    return _device_supports_pdl(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_launch_options(x: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for a kernel launch: the kernel's `PDL` constexpr, plus `launch_pdl` when on."""
    if pdl_enabled(x):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
