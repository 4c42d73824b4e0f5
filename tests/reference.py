"""Helpers shared by the tests that compare Pellucid against a reference: the error measure, random
token-id prompts and a transformers forward that also captures every decoder layer's output."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_forward(model: torch.nn.Module, token_ids: list[int],
               hooks: Sequence[tuple[torch.nn.Module, Callable[..., Any]]] = ()) -> dict[str, Any]:
    """Logits, hidden states and every decoder layer's output of one sequence, with optional forward hooks."""
    captured: dict[int, torch.Tensor] = {}
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    for i, layer in enumerate(model.model.layers):
        def capture(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            captured[i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
        handles.append(layer.register_forward_hook(capture))
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return {"logits": out.logits[0].float(), "hidden_states": [h[0] for h in out.hidden_states],
            "layers": [captured[i] for i in range(len(model.model.layers))]}
