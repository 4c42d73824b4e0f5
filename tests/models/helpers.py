"""Test helpers: hand-built attention metadata and a paged KV cache, to run models without the engine."""
from __future__ import annotations

import json
import os
import random
from typing import Hashable

import torch
from safetensors.torch import load_file, save_file

from pellucid.attention.metadata import CommonAttentionMetadata, ForwardContext, forward_context
from pellucid.attention.torch_ref import TorchReferenceBackend
from tests.reference import relative_error  # noqa: F401  (re-exported for the model tests)


def build_attention_metadata(num_computed: list[int], num_scheduled: list[int], block_tables: list[list[int]],
                             block_size: int, num_padded_tokens: int | None = None,
                             device: str | torch.device = "cpu",
                             ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata for requests that have `num_computed[r]` tokens cached and compute `num_scheduled[r]` now.

    Returns (metadata, positions [padded], token_to_req [padded]); padding rows get slot -1, position 0.
    """
    num_reqs = len(num_scheduled)
    num_tokens = sum(num_scheduled)
    num_padded = num_tokens if num_padded_tokens is None else num_padded_tokens
    assert num_padded >= num_tokens
    query_start_loc = [0]
    positions: list[int] = []
    slots: list[int] = []
    token_to_req: list[int] = []
    for r, (computed, scheduled) in enumerate(zip(num_computed, num_scheduled)):
        query_start_loc.append(query_start_loc[-1] + scheduled)
        for pos in range(computed, computed + scheduled):
            block = block_tables[r][pos // block_size]
            positions.append(pos)
            slots.append(block * block_size + pos % block_size)
            token_to_req.append(r)
    pad = num_padded - num_tokens
    positions += [0] * pad
    slots += [-1] * pad
    token_to_req += [0] * pad
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled)]
    max_blocks = max(len(t) for t in block_tables)
    table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for r, blocks in enumerate(block_tables):
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    host = {
        "query_start_loc": torch.tensor(query_start_loc, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "num_computed_tokens": torch.tensor(num_computed, dtype=torch.int32),
        "block_table": table,
    }
    metadata = CommonAttentionMetadata(
        num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max(num_scheduled), max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=host["query_start_loc"].to(device), seq_lens=host["seq_lens"].to(device),
        num_computed_tokens=host["num_computed_tokens"].to(device), block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=host["query_start_loc"], seq_lens_cpu=host["seq_lens"],
        num_computed_tokens_cpu=host["num_computed_tokens"], block_table_cpu=table,
    )
    return (metadata, torch.tensor(positions, dtype=torch.int64, device=device),
            torch.tensor(token_to_req, dtype=torch.int32, device=device))


class PagedModelRunner:
    """Runs a Pellucid model step by step over a paged KV cache with the torch reference backend.

    Blocks are handed out in a shuffled order so block tables are not contiguous, and the cache starts
    filled with random values so reading a slot that was never written shows up as wrong logits.
    """

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        param = next(model.parameters())
        self.model = model
        self.block_size = block_size
        self.device = param.device
        self.backend = TorchReferenceBackend(model.num_attention_heads, model.num_kv_heads, model.head_dim,
                                             param.dtype, param.device)
        gen = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.randn(shape, generator=gen).to(param.dtype).to(self.device)
                          for _ in range(model.num_attention_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[Hashable, list[int]] = {}
        self.num_computed: dict[Hashable, int] = {}

    def step(self, chunks: list[tuple[Hashable, list[int]]], num_padded_tokens: int | None = None
             ) -> list[torch.Tensor]:
        """Compute the next tokens of each request (`(request key, token ids)`); return each one's logits."""
        computed, scheduled, tables, input_ids = [], [], [], []
        for key, token_ids in chunks:
            done = self.num_computed.get(key, 0)
            blocks = self.block_ids.setdefault(key, [])
            while len(blocks) * self.block_size < done + len(token_ids):
                blocks.append(self.free_blocks.pop())
            computed.append(done)
            scheduled.append(len(token_ids))
            tables.append(blocks)
            input_ids += token_ids
        metadata, positions, token_to_req = build_attention_metadata(
            computed, scheduled, tables, self.block_size, num_padded_tokens, self.device)
        input_ids += [0] * (len(positions) - len(input_ids))
        ctx = ForwardContext(attn_metadata=metadata, backend=self.backend,
                             backend_metadata=self.backend.build_metadata(metadata), kv_caches=self.kv_caches,
                             positions=positions, token_to_req=token_to_req)
        with torch.no_grad(), forward_context(ctx):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=self.device))
            logits = (hidden.float() @ self.model.lm_head.weight.float().T)
        for key, token_ids in chunks:
            self.num_computed[key] = self.num_computed.get(key, 0) + len(token_ids)
        starts = metadata.query_start_loc_cpu.tolist()
        return [logits[starts[r]:starts[r + 1]] for r in range(len(chunks))]



def load_hf_model(model_dir: str) -> torch.nn.Module:
    """transformers' own model of a checkpoint, float32, eager attention (the reference of the model tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def random_token_prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def write_fused_expert_layout(src: str, dst: str, layers: list[int] | None = None) -> None:
    """Copy a checkpoint, storing the experts of `layers` (all when None) as the fused 3D tensors."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if ".experts." in name and parts[2].isdigit() and (layers is None or int(parts[2]) in layers):
            prefix = ".".join(parts[:parts.index("experts") + 1]).replace("block_sparse_moe", "mlp")
            experts.setdefault(prefix, {}).setdefault(int(parts[parts.index("experts") + 1]), {})[parts[-2]] = t
        else:
            out[name] = t
    gate, up, down = ("w1", "w3", "w2") if config["model_type"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for prefix, per_expert in experts.items():
        order = sorted(per_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per_expert[e][gate], per_expert[e][up]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([per_expert[e][down] for e in order])
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def assert_tp2_generates_tp1_tokens(model_dir: str) -> None:
    """Greedy tokens of a two-rank tensor-parallel CPU engine equal those of a one-rank engine."""
    from pellucid import LLM, SamplingParams
    engine = dict(dtype="float32", device="cpu", max_model_len=96, num_kv_blocks=24)
    prompts = [{"prompt_token_ids": p} for p in random_token_prompts(4, [12, 30])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **engine).generate(prompts, params, use_tqdm=False)]
    tp2 = LLM(model_dir, tensor_parallel_size=2, **engine)
    try:
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        tp2.shutdown()
