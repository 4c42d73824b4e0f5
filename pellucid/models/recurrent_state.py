"""How layers with per-request recurrent state (short convolutions, SSMs) find that state in a step.

The model runner owns one state pool per recurrent layer, `[num_slots, *state_shape]`, and gives every
request in the batch a slot. It passes both through `ForwardContext.extras` under the keys below, so the
attention metadata contract stays unchanged. Models that have such layers declare
`recurrent_state_shapes()` (per-sequence shape of each layer's state) and `supports_prefix_caching = False`.
"""
from __future__ import annotations

import torch

from pellucid.attention.metadata import get_forward_context

# list[torch.Tensor]: one pool per recurrent layer, indexed by the layer's recurrent ordinal.
RECURRENT_STATES_KEY = "recurrent_states"
# torch.Tensor [num_reqs] int64 on the device: the pool slot of each request, in batch order.
RECURRENT_SLOTS_KEY = "recurrent_state_slots"


def current_recurrent_state(recurrent_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(state pool of recurrent layer `recurrent_idx`, slot per request) for the running forward pass."""
    extras = get_forward_context().extras
    if RECURRENT_STATES_KEY not in extras or RECURRENT_SLOTS_KEY not in extras:
        raise RuntimeError("this model keeps per-request recurrent state, but the forward context carries none; "
                           f"the runner must pass extras[{RECURRENT_STATES_KEY!r}] and extras[{RECURRENT_SLOTS_KEY!r}]")
    return extras[RECURRENT_STATES_KEY][recurrent_idx], extras[RECURRENT_SLOTS_KEY]
