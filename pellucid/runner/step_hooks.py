"""Step hooks: per-step work an engine feature adds to the model runner (a pipeline stage's inputs and
outputs, pellucid/pipeline/stage_features.py).

A feature's engine half installs a hook while some request carries the feature (`ModelRunner.add_step_hook`,
`remove_step_hook`) and the runner calls, for every step it launches:

- `before_forward(so, batch)`: what the model reads this step from the forward context's extras
  (a dict merged into ForwardContext.extras), or None;
- `after_sampling(so, batch, hidden, sampled)`: once the forward, the LM head and the sampler are queued
  (`sampled` the SamplerOutput, None when no row samples): queue device work and copies to the host,
  and return a handle (or None) that travels with the step;
- `after_readback(handle)`: in collect(), after the step's results were read back: the host-side end.

A hook that reads or edits activations through forward hooks must also make its requests' steps run
eagerly (cuda_graphs.require_eager_for_extras_key): graph replays run no Python.
"""
from __future__ import annotations

from typing import Any

import torch


def copy_to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x` that outlives the step: on CUDA pinned and queued (read it after the step's
    readback, in after_readback), on the CPU a clone."""
    if x.device.type == "cpu":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    return host.copy_(x, non_blocking=True)


class StepHook:
    def before_forward(self, so: Any, batch: Any) -> dict[str, Any] | None:
        return None

    def after_sampling(self, so: Any, batch: Any, hidden: Any, sampled: Any) -> Any:
        return None

    def after_readback(self, handle: Any) -> None:
        pass
