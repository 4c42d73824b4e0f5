"""Qwen3-Omni's thinker, text path: the Qwen3-MoE decoder under `thinker.` (thinker.model.layers.N...,
thinker.lm_head), loaded from the thinker's part of an Omni checkpoint.

Position encoding: the thinker uses 3D multimodal rotary (temporal, height, width). For text input the
three position ids of a token are equal (transformers' get_rope_index: positions 0, 1, 2, ... on each
axis), and interleaved or sectioned, every frequency then rotates by that one position: plain 1D rotary
with the text config's rope_theta, which is what runs here. Audio, image and video input need the
encoders and the 3D positions; a prompt holding their placeholder tokens is refused.

For the talker the thinker hands on, per position it computes, its input embedding (transformers'
`hidden_states[0]`) and the residual stream after `accept_hidden_layer` layers (`hidden_states[k]`).
Forward hooks on `thinker.model.embed_tokens` and that layer copy every forward's rows into buffers at
fixed addresses (`stage_outputs` reads them), so the copies are part of the decode CUDA graphs and a
stage's decode steps replay them (GraphStepInputs: `graph_extras_keys`). The hooks stay installed:
graphs are captured before any stage request arrives, and two row copies a step cost next to nothing.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.models.moe_models import Qwen3MoeForCausalLM
from pellucid.models.qwen3_omni.configs import OmniConfig, check_text_prompt
from pellucid.models.qwen3_omni.talker import STAGE_OUTPUT_KEY


class Qwen3OmniThinker(nn.Module):
    """Constructor `(omni hf_config, dtype, device, max_model_len=None)`; forward(input_ids [T]) -> hidden [T, H]."""

    checkpoint_prefixes = ("thinker.model.", "thinker.lm_head.")
    backbone_path = "thinker.model"     # sites: thinker.model.layers.N (EngineInfo.backbone, extraction)
    # What stage_outputs() returns: one row per computed token.
    stage_output_rows = "tokens"
    # Its stage outputs are copied inside the forward (hooks captured into the decode graphs).
    graph_extras_keys = frozenset({STAGE_OUTPUT_KEY})

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.omni = OmniConfig(hf_config)
        self.engine_hf_config = self.omni.thinker_text
        self.thinker = Qwen3MoeForCausalLM(self.omni.thinker_text, dtype, device, max_model_len)
        self._capture_active = False
        # Name -> [rows, hidden] buffer the hooks copy each forward's rows into (fixed once graphs are planned).
        self._capture_buffers: dict[str, torch.Tensor] = {}
        self._buffers_fixed = False
        self._install_capture_hooks()

    # ---- what the engine needs of a model -----------------------------------------------------
    @property
    def lm_head(self) -> nn.Linear:
        return self.thinker.lm_head

    @property
    def num_attention_layers(self) -> int:
        return self.thinker.num_attention_layers

    @property
    def num_attention_heads(self) -> int:
        return self.thinker.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.thinker.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.thinker.head_dim

    def tie_weights(self) -> None:
        self.thinker.tie_weights()

    def checkpoint_target(self, name: str) -> tuple[str, tuple[Any, ...]] | None:
        return self.thinker.checkpoint_target(name)     # per-expert tensors, whatever their prefix

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.thinker(input_ids)

    # ---- what the talker reads ----------------------------------------------------------------
    def check_prompt_ids(self, token_ids: list[int]) -> None:
        check_text_prompt(token_ids, self.omni)

    def set_stage_capture(self, active: bool) -> None:
        """A pipeline stage reads each step's embeddings and accept-layer hidden states (True) or stops (False)."""
        self._capture_active = active

    def _install_capture_hooks(self) -> None:
        model = self.thinker.model
        layer = self.omni.talker.accept_hidden_layer
        num_layers = len(model.layers)
        if not 0 <= layer <= num_layers:
            raise ValueError(f"talker accept_hidden_layer={layer} is outside the thinker's 0..{num_layers} layers")
        model.embed_tokens.register_forward_hook(self._keep("embed"))
        # transformers' hidden_states[k]: the input embeddings (k = 0), layer k - 1's output, or for the last
        # layer the final norm's output.
        source = model.embed_tokens if layer == 0 else model.norm if layer == num_layers else model.layers[layer - 1]
        source.register_forward_hook(self._keep("hidden"))

    def prepare_cuda_graphs(self, max_graph_size: int, max_num_tokens: int) -> None:
        """Fix the capture buffers at the largest step's size: the graphs bake their addresses."""
        hidden = self.omni.thinker_text.hidden_size
        weight = self.thinker.model.embed_tokens.weight
        with torch.inference_mode(False):
            for name in ("embed", "hidden"):
                self._capture_buffers[name] = torch.empty((max_num_tokens, hidden), dtype=weight.dtype,
                                                          device=weight.device)
        self._buffers_fixed = True

    def _keep(self, name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            # A copy: fused kernels may update a residual buffer in place after the layer returned it.
            rows = output.shape[0]
            buffer = self._capture_buffers.get(name)
            if buffer is None or buffer.shape[0] < rows or buffer.dtype != output.dtype:
                if self._buffers_fixed:
                    raise RuntimeError(f"a thinker forward of {rows} rows exceeds the {name!r} capture buffer "
                                       f"fixed for CUDA graphs ({None if buffer is None else buffer.shape[0]} rows)")
                with torch.inference_mode(False):   # a normal tensor: forwards run in and outside inference mode
                    buffer = output.new_empty((rows, *output.shape[1:]))
                self._capture_buffers[name] = buffer
            buffer[:rows].copy_(output.detach())
        return hook

    def stage_header(self) -> dict[str, torch.Tensor]:
        """What the talker needs once per request: the input embeddings of the TTS tokens (bos, eos, pad)."""
        ids = torch.tensor(self.omni.tts_token_ids, device=self.thinker.model.embed_tokens.weight.device)
        return {"tts_embeds": self.thinker.model.embed_tokens(ids).detach().to("cpu")}

    def stage_outputs(self, batch: Any, sampled: Any) -> dict[str, torch.Tensor]:
        """This step's rows for the talker: {"embed": [T, H], "hidden": [T, H]} (token rows of the batch)."""
        if not self._capture_active or set(self._capture_buffers) != {"embed", "hidden"}:
            raise RuntimeError("the thinker's stage capture is not active, or no forward ran yet")
        n = batch.num_tokens
        return {name: value[:n] for name, value in self._capture_buffers.items()}
