"""Qwen3-Omni's talker: a mixture-of-experts decoder (every layer sparse, with a shared expert behind a
sigmoid gate, Qwen3 q/k norms) whose inputs are not token embeddings but sums assembled per position:

    input = projection(thinker vector) + codec part

- the projection is `text_projection` (a 2-layer MLP from the thinker's width) of a thinker input
  embedding, or `hidden_projection` of a thinker hidden state (audio / image positions of the user turn);
- the codec part is the sum of the codec embeddings of a frame: its first code by the talker's own
  `codec_embedding`, code i > 0 by the code predictor's `codec_embedding[i - 1]` (absent codes add nothing).

Which thinker vector and which codes go with each position is the pipeline's business (stage_io.py
builds them from what the thinker sent); the engine passes them per step in the forward context
(`TALKER_INPUTS_KEY`, a TalkerStepInputs). Position encoding: multimodal rotary with equal position ids
on every axis for text input, i.e. plain rotary, as in the thinker.

The head (talker_head.py) samples a frame's first code with the codec head, and the code predictor the
frame's others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pellucid.attention.metadata import get_forward_context
from pellucid.models.layers import Embedding
from pellucid.models.llama import AttentionOptions, DecoderModel, check_supported_config
from pellucid.models.moe import MoeSpec, SparseMoeBlock
from pellucid.models.moe_models import _num_experts
from pellucid.models.qwen3_omni.code_predictor import CodePredictor
from pellucid.models.qwen3_omni.configs import OmniConfig

# ForwardContext.extras key of a step's TalkerStepInputs.
TALKER_INPUTS_KEY = "qwen3_omni_talker_inputs"
# Request extras key without which the talker refuses a request: its inputs come from the thinker.
STAGE_INPUT_KEY = "stage_input"
# Request extras key of the stages that send rows on (pellucid/pipeline/stage_features.py).
STAGE_OUTPUT_KEY = "stage_output"

PROJECT_TEXT = 0        # TalkerStepInputs.projection: text_projection of a thinker input embedding
PROJECT_HIDDEN = 1      # hidden_projection of a thinker hidden state (multimodal positions)


@dataclass
class TalkerStepInputs:
    """One step's talker inputs, one row per scheduled token (device tensors)."""

    thinker_vectors: torch.Tensor       # [T, thinker hidden]
    projection: torch.Tensor            # [T] int64: PROJECT_TEXT | PROJECT_HIDDEN
    codes: torch.Tensor                 # [T, num_code_groups] int64; -1 where a position has no such code
    any_hidden: bool = False            # some row is PROJECT_HIDDEN (host flags: the step reads nothing back)
    any_codes: bool = True              # some row has codes


class ResizeMLP(nn.Module):
    """`text_projection` / `hidden_projection`: linear_fc2(act(linear_fc1(x))), thinker width -> talker width."""

    def __init__(self, in_size: int, intermediate: int, out_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate, bias=True, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(intermediate, out_size, bias=True, dtype=dtype, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class TalkerModel(DecoderModel):
    """`talker.model`: codec_embedding, layers, norm; forward(inputs_embeds [T, H]) -> normed hidden [T, H]."""

    def __init__(self, config: Any, max_positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        spec = MoeSpec(_num_experts(config), int(config.num_experts_per_tok), bool(config.norm_topk_prob), True)
        shared = int(config.shared_expert_intermediate_size)

        def sparse_mlp(cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
            # transformers' talker makes every layer sparse, whatever mlp_only_layers / decoder_sparse_step say.
            return SparseMoeBlock(spec, cfg.hidden_size, int(cfg.moe_intermediate_size), shared, dtype, device)

        super().__init__(config, AttentionOptions(qk_norm=True), max_positions, dtype, device, make_mlp=sparse_mlp)
        del self.embed_tokens
        self.codec_embedding = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.forward_embeds(inputs_embeds)


class TalkerForConditionalGeneration(nn.Module):
    """`talker`: model, codec_head, text_projection, hidden_projection, code_predictor."""

    def __init__(self, omni: OmniConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        text = omni.talker_text
        factory = {"dtype": dtype, "device": device}
        self.model = TalkerModel(text, max_positions, dtype, device)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, **factory)
        thinker_width = int(omni.talker.thinker_hidden_size)
        self.text_projection = ResizeMLP(thinker_width, text.intermediate_size, text.hidden_size, **factory)
        self.hidden_projection = ResizeMLP(thinker_width, text.intermediate_size, text.hidden_size, **factory)
        self.code_predictor = CodePredictor(omni.code_predictor, dtype, device)

    def embed_inputs(self, inputs: TalkerStepInputs) -> torch.Tensor:
        """[T, H] input embeddings from a step's TalkerStepInputs (see the module doc)."""
        vectors = inputs.thinker_vectors.to(self.codec_head.weight.dtype)
        projected = self.text_projection(vectors)
        if inputs.any_hidden:
            hidden_rows = inputs.projection == PROJECT_HIDDEN
            projected = torch.where(hidden_rows[:, None], self.hidden_projection(vectors), projected)
        if not inputs.any_codes:
            return projected
        codes = inputs.codes
        present = codes >= 0
        safe = codes.clamp(min=0)
        parts = [self.model.codec_embedding(safe[:, 0])]
        parts += [self.code_predictor.model.codec_embedding[i - 1](safe[:, i]) for i in range(1, codes.shape[1])]
        stacked = torch.stack(parts, dim=1) * present[:, :, None].to(projected.dtype)
        # transformers sums a frame's codec embeddings in one reduction, then adds the text part.
        return projected + stacked.sum(dim=1)


class Qwen3OmniTalker(nn.Module):
    """The talker stage. Constructor `(omni hf_config, dtype, device, max_model_len=None)`."""

    checkpoint_prefixes = ("talker.",)
    required_extras = (STAGE_INPUT_KEY,)
    # What stage_outputs() returns: one row per sampling request (its frame's codes).
    stage_output_rows = "samples"
    supports_prefix_caching = False
    # Its stage inputs reach the decode graphs through fixed buffers (prepare_cuda_graphs), and its stage
    # outputs are the head's sampled frames: neither needs Python inside the forward.
    graph_extras_keys = frozenset({STAGE_INPUT_KEY, STAGE_OUTPUT_KEY})
    no_prefix_caching_reason = ("the talker's positions are embeddings of what the thinker sent, not token ids "
                                "that a cache could match")

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.omni = OmniConfig(hf_config)
        text = self.omni.talker_text
        self.engine_hf_config = text
        max_model_len = max_model_len or text.max_position_embeddings
        check_supported_config(text, max_model_len)
        self.talker = TalkerForConditionalGeneration(self.omni, max(max_model_len, text.max_position_embeddings),
                                                     dtype, device)
        self.eos_token_ids = {int(self.omni.talker.codec_eos_token_id)}

    @property
    def lm_head(self) -> nn.Linear:
        return self.talker.codec_head

    @property
    def num_attention_layers(self) -> int:
        return len(self.talker.model.layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self.omni.talker_text.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.omni.talker_text.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return self.talker.model.layers[0].self_attn.head_dim

    def tie_weights(self) -> None:
        pass

    def checkpoint_target(self, name: str) -> tuple[str, tuple[Any, ...]] | None:
        from pellucid.models.expert_weights import ExpertCheckpointNames
        return ExpertCheckpointNames().target(name, int(self.omni.talker_text.moe_intermediate_size))

    def make_lm_head(self, head_name: str) -> Any:
        """The talker's own head (codec head with suppressed ids, then the code predictor): no other LM head
        can sample a frame."""
        from pellucid.models.qwen3_omni.talker_head import TalkerHead
        if head_name != "dense":
            raise ValueError(f"the Qwen3-Omni talker samples with its own head; head={head_name!r} cannot serve it")
        return TalkerHead(self.talker, self.omni.talker_suppressed_ids)

    # ---- decode CUDA graphs (runner/cuda_graphs.py GraphStepInputs) ----
    def prepare_cuda_graphs(self, max_graph_size: int, max_num_tokens: int) -> None:
        """Fixed buffers of the graphs' step inputs: a graph embeds every row both ways (any_hidden) and
        adds the codes present (-1 elsewhere), so one graph per size serves every step."""
        omni, weight = self.omni, self.talker.codec_head.weight
        self._graph_inputs = TalkerStepInputs(
            thinker_vectors=torch.zeros((max_graph_size, int(omni.talker.thinker_hidden_size)), dtype=weight.dtype,
                                        device=weight.device),
            projection=torch.zeros(max_graph_size, dtype=torch.int64, device=weight.device),
            codes=torch.full((max_graph_size, omni.num_code_groups), -1, dtype=torch.int64, device=weight.device),
            any_hidden=True, any_codes=True)

    def graph_step_extras(self, size: int) -> dict[str, Any]:
        inputs = self._graph_inputs
        return {TALKER_INPUTS_KEY: TalkerStepInputs(inputs.thinker_vectors[:size], inputs.projection[:size],
                                                    inputs.codes[:size], any_hidden=True, any_codes=True)}

    def load_graph_step_extras(self, size: int, extras: dict[str, Any]) -> None:
        step = extras[TALKER_INPUTS_KEY]
        rows = step.projection.shape[0]
        if rows > size:
            raise RuntimeError(f"a talker step of {rows} rows does not fit a graph of {size}")
        # Padding rows keep earlier rows' values: valid inputs whose outputs nobody reads.
        inputs = self._graph_inputs
        inputs.thinker_vectors[:rows].copy_(step.thinker_vectors)
        inputs.projection[:rows].copy_(step.projection)
        inputs.codes[:rows].copy_(step.codes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inputs = get_forward_context().extras.get(TALKER_INPUTS_KEY)
        if inputs is None:
            # Only the runner's memory-profiling forward has no inputs (requests without them are refused).
            embeds = self.talker.model.codec_embedding(input_ids)
        else:
            embeds = self.talker.embed_inputs(inputs)
        return self.talker.model(embeds)

    # ---- pipeline stage inputs (pellucid/pipeline/stage_features.py) ----
    def make_stage_input(self, params: Any) -> Any:
        """A request's input state, from the TalkerLayout the frontend computed."""
        from pellucid.models.qwen3_omni.stage_io import TalkerInputs, TalkerLayout
        if not isinstance(params, TalkerLayout):
            raise ValueError(f"the talker's stage input needs a TalkerLayout, got {type(params).__name__}")
        return TalkerInputs(params, self.omni)

    def stage_step_inputs(self, states: list[Any], starts: list[int], counts: list[int],
                          device: torch.device) -> dict[str, Any]:
        from pellucid.models.qwen3_omni.stage_io import talker_step_inputs
        return talker_step_inputs(states, starts, counts, device)

    def stage_outputs(self, batch: Any, sampled: Any) -> dict[str, torch.Tensor]:
        """This step's frames for code2wav: {"codes": [S, num_code_groups]} (one row per sampling request)."""
        codes = getattr(sampled, "extra_token_ids", None)
        if codes is None:
            raise RuntimeError("the talker's head returned no frame codes")
        return {"codes": codes}
