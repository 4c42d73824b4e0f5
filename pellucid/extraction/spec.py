"""Which hidden states an extraction takes, as trace ops, and how a finished request's saves become one
`[num_tokens, num_layers, hidden]` tensor.

Layer `i` (0 <= i < num_layers) is the residual stream after decoder layer i: the output of the site
`model.layers.{i}`, which is transformers' `output_hidden_states[i + 1]` for every layer but the last
(transformers reports the final-normed state there instead). Layer `-1` is that final-normed state:
the output of the site `model` (the backbone returns the normed hidden states whatever the
architecture names its final norm: `model.norm`, LFM2's `model.embedding_norm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pellucid.tracing.ops import Save
from pellucid.tracing.plan import TRACE_KEY, TracePlan

FINAL_NORMED = -1


def _save_name(layer: int) -> str:
    return "extract.final" if layer == FINAL_NORMED else f"extract.layer{layer}"


def _site(layer: int, backbone: str = "model") -> str:
    return backbone if layer == FINAL_NORMED else f"{backbone}.layers.{layer}"


@dataclass(frozen=True)
class ExtractionSpec:
    layers: tuple[int, ...]
    num_model_layers: int
    # The decoder's module path (EngineInfo.backbone): "model", or e.g. Qwen3-Omni's thinker's "thinker.model".
    backbone: str = "model"

    @classmethod
    def resolve(cls, layers: Any, num_model_layers: int, backbone: str = "model") -> "ExtractionSpec":
        """Validated layer ids; ValueError naming the problem (out of range, duplicate, not an int)."""
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError(f"layers must be a non-empty list of decoder-layer indices, got {layers!r}")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ValueError(f"layer ids must be integers, got {layer!r}")
            if layer != FINAL_NORMED and not 0 <= layer < num_model_layers:
                raise ValueError(f"layer {layer} is out of range: the model has {num_model_layers} decoder layers "
                                 f"(valid ids 0..{num_model_layers - 1}, or -1 for the final normed output)")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers must not repeat, got {list(layers)}")
        return cls(tuple(layers), num_model_layers, backbone)

    @property
    def sites(self) -> list[str]:
        return [_site(layer, self.backbone) for layer in self.layers]

    def trace_plan(self, keep_on_device: bool = False) -> TracePlan:
        """Save ops at every position of the request (phase all): a traced request never reads the
        prefix cache, and saves are stored per position, so chunking and preemption cannot lose rows.
        `keep_on_device`: the finished request's saves stay on the GPU (the job copies them to the host
        itself, off the step loop: staging.py)."""
        return TracePlan([Save(site=_site(layer, self.backbone), name=_save_name(layer)) for layer in self.layers],
                         keep_saves_on_device=keep_on_device)

    def extras(self, keep_on_device: bool = False) -> dict[str, Any]:
        """Engine request extras that make a request carry this extraction."""
        return {TRACE_KEY: self.trace_plan(keep_on_device)}

    def hidden_states(self, output: Any, num_tokens: int) -> torch.Tensor:
        """`[num_tokens, num_layers, hidden]` in the model dtype from a finished request's saves.
        RuntimeError if any position is missing (the failure other engines show as short files)."""
        return torch.stack(self.layer_columns(output, num_tokens), dim=1)

    def layer_columns(self, output: Any, num_tokens: int) -> list[torch.Tensor]:
        """The per-layer `[num_tokens, hidden]` states, checked complete (see hidden_states)."""
        if output.error:
            raise RuntimeError(f"the extraction request failed: {output.error}")
        return self.columns_from_saves(output.extras.get("saves"), output.extras.get("save_positions"), num_tokens)

    def columns_from_saves(self, saves: dict[str, torch.Tensor] | None, positions: dict[str, list[int]] | None,
                           num_tokens: int) -> list[torch.Tensor]:
        """The per-layer columns from a finished request's saves and their positions, checked complete."""
        if saves is None or positions is None:
            raise RuntimeError("the extraction request finished without saved hidden states")
        expected = list(range(num_tokens))
        columns = []
        for layer in self.layers:
            name = _save_name(layer)
            if positions.get(name) != expected:
                got = positions.get(name) or []
                raise RuntimeError(f"hidden states of layer {layer} cover {len(got)} of {num_tokens} positions; "
                                   f"refusing to write an incomplete sample")
            columns.append(saves[name])
        return columns
