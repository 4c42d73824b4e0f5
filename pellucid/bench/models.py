"""Named model shapes for benchmarks, written as random-weight bf16 HuggingFace checkpoints.

Weights are drawn straight into safetensors files (on the GPU when there is one, a layer at a time),
never through a transformers model object, so an 8B checkpoint takes seconds rather than minutes.
Shapes in DRAWN_AT_LOAD (Qwen3-30B-A3B: 61 GB of bf16 weights, Mixtral-8x7B: 93 GB, Llama-3.1-70B: 141 GB,
more than the GPU machines' disks hold comfortably; the FP8 shapes, whose codes no writer here quantizes) get no
weight files: the directory's
pellucid_random_weights.json makes the loader draw them on the device (pellucid.models.loader); transformers
cannot read such a directory.
The tokenizer covers the model's whole vocabulary with one word per id (` t1234`), so every token a
random model samples decodes to text at once: a streamed response carries one chunk per token, and
time to first token and inter-token latency are measured on every token (benchmark prompts are
token ids).
"""
from __future__ import annotations

import json
import os
from typing import Any


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu"),
    "Llama-3.2-1B": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, hidden_act="silu",
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, hidden_act="silu",
                         rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    # 141 GB of bf16 weights: drawn at load, each tensor-parallel rank its own shard (tensor_parallel_size 4+).
    "Llama-3.1-70B": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
                          rms_norm_eps=1e-5, hidden_act="silu",
                          rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    # 128 experts, 8 per token, every layer sparse; 3.3B parameters read per token (30.5B in all).
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu"),
    # 8 experts, 2 per token, of width 14,336: 46.7B parameters (93 GB of bf16), 12.9B read per token.
    "Mixtral-8x7B": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
                         tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None),
}
# The same with its weights stored as the official Qwen3-30B-A3B-FP8 stores them (block-wise FP8, 128 x 128
# blocks): the experts stay in FP8 (pellucid.models.fp8_experts), and the attention projections too with
# PELLUCID_FP8_LINEAR=1 (fp8_linear; else they are drawn in bf16, as that checkpoint's dequantized weights load); the
# routers, norms, embeddings and LM head are drawn in bf16, as that checkpoint keeps them.
NAMED_CONFIGS["Qwen3-30B-A3B-FP8"] = dict(NAMED_CONFIGS["Qwen3-30B-A3B"], quantization_config=dict(
    quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128],
    modules_to_not_convert=["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(48)]))
# A dense model in block-wise FP8 (Qwen3-8B-FP8's format on Llama-3.1-8B's shape): its projections stay in FP8 with
# PELLUCID_FP8_LINEAR=1 (pellucid.models.fp8_linear); drawn at load, since no writer here quantizes checkpoint files.
NAMED_CONFIGS["Llama-3.1-8B-FP8"] = dict(NAMED_CONFIGS["Llama-3.1-8B"], quantization_config=dict(
    quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128],
    modules_to_not_convert=["lm_head"]))
DRAWN_AT_LOAD = frozenset({"Qwen3-30B-A3B", "Qwen3-30B-A3B-FP8", "Mixtral-8x7B", "Llama-3.1-70B", "Llama-3.1-8B-FP8"})


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of a Llama/Qwen3 config, as HuggingFace names them."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                       p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if config["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def num_parameters(config: dict[str, Any]) -> int:
    total = 0
    for shape in tensor_shapes(config).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def build_random_checkpoint(name: str, out_dir: str, seed: int = 0) -> str:
    """Write config, tokenizer and random bf16 weights of NAMED_CONFIGS[name] to out_dir (reused if present)."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(NAMED_CONFIGS)}")
    config = dict(NAMED_CONFIGS[name], torch_dtype="bfloat16", bos_token_id=None, eos_token_id=2, pad_token_id=0)
    done = os.path.join(out_dir, ".complete")
    if os.path.exists(done):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    build_word_tokenizer(out_dir, config["vocab_size"])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if name in DRAWN_AT_LOAD:
        from pellucid.models.loader import RANDOM_WEIGHTS_FILE
        with open(os.path.join(out_dir, RANDOM_WEIGHTS_FILE), "w") as f:
            json.dump({"seed": seed}, f)
        open(done, "w").close()
        return out_dir
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    shard_bytes, shard_index = 0, 0

    def flush() -> None:
        nonlocal current, shard_bytes, shard_index
        if current:
            shard = f"model-{shard_index:05d}.safetensors"
            save_file(current, os.path.join(out_dir, shard), metadata={"format": "pt"})
            shards.update({key: shard for key in current})
            current, shard_bytes, shard_index = {}, 0, shard_index + 1

    for key, shape in tensor_shapes(config).items():
        if len(shape) == 1:      # norm weights: near 1, as trained models have them
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
        else:                    # std 1/sqrt(fan_in) keeps activations O(1) through the random layers
            t = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
        current[key] = t.to(torch.bfloat16).cpu()
        shard_bytes += current[key].numel() * 2
        if shard_bytes >= 2 << 30:
            flush()
    flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": shards}, f)
    open(done, "w").close()
    return out_dir


_SPECIAL = ["<unk>", "<pad>", "</s>"]     # ids 0, 1, 2 (the named configs' pad and eos ids)


def build_word_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A tokenizer with one word per id, ` t{id}` (ids 0-2 are <unk>, <pad>, </s>), saved for transformers.
    Every id decodes to its own complete text, so incremental detokenization yields text for every token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(_SPECIAL)}
    vocab.update({f"\u2581t{i}": i for i in range(len(_SPECIAL), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in _SPECIAL])
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "pad_token": "<pad>",
                   "eos_token": "</s>", "model_max_length": 1 << 20}, f, indent=1)


def resolve_model(name_or_dir: str, cache_root: str) -> str:
    """A named config is built under cache_root (once); anything else is taken as a model directory."""
    if name_or_dir in NAMED_CONFIGS:
        return build_random_checkpoint(name_or_dir, os.path.join(cache_root, name_or_dir))
    if not os.path.isdir(name_or_dir):
        raise ValueError(f"{name_or_dir!r} is neither a named benchmark model ({', '.join(NAMED_CONFIGS)}) "
                         "nor a directory")
    return name_or_dir
