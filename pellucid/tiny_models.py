"""Offline builders for tiny random models: a real byte-level BPE tokenizer and HuggingFace checkpoints.

Tests and the embedded default model use these, so nothing ever needs a model hub. Every build is
deterministic: the same arguments give the same bytes on disk.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from pellucid.logger import get_logger

logger = get_logger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# ChatML, as Qwen models render it: one block per message, then an open assistant turn if asked.
CHAT_TEMPLATE = (
    # Offered tools go in a system turn, one JSON function per line; an assistant's calls are written as the
    # hermes parser reads them (<tool_call>{"name": ..., "arguments": ...}</tool_call>); results are "tool" turns.
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\nFunctions you may call, one <tool_call>{\\\"name\\\": ..., \\\"arguments\\\": {...}}"
    "</tool_call> each:\\n' }}"
    "{%- for tool in tools -%}{{ (tool['function'] if 'function' in tool else tool) | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['reasoning_content'] -%}{{ '<think>' + message['reasoning_content'] + '</think>' }}{%- endif -%}"
    "{{ message['content'] or '' }}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{{ '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Varied English, a few KB, so the learned merges look like a real (if small) vocabulary.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A journey of a thousand miles begins with a single step, or so the old saying goes.
She opened the window and the cold morning air filled the small kitchen.
In the beginning there was only darkness, and then the first stars began to shine.
The library closes at nine o'clock on weekdays and at five on Saturdays.
Could you tell me the way to the railway station? I think I am lost.
Scientists measured the temperature of the ocean at twelve different depths.
He wrote three letters to his sister, but she never answered any of them.
Fresh bread, warm soup and a glass of water made a simple but perfect dinner.
The committee will meet again next Thursday to discuss the budget for the new school.
Mountains rise above the valley, and rivers carry melted snow down to the sea.
My grandmother taught me how to plant tomatoes, beans and sunflowers in the garden.
Engineers tested the bridge for weeks before they allowed the first trucks to cross it.
Please remember to turn off the lights when you leave the room.
The children laughed as the puppy chased its own tail around the yard.
Numbers like 1, 2, 3, 42, 100 and 2024 appear in many different kinds of text.
What time is it? It is half past seven, and the train leaves at eight.
The museum displays paintings, sculptures, old maps and a collection of rare coins.
Rain fell all night; by morning the streets were shining and the air smelled clean.
Every language has its own rules, yet people everywhere tell stories to each other.
The doctor asked the patient to breathe slowly and describe where it hurt.
Our team finished the project on time because everyone helped one another.
A computer program is a list of instructions that a machine can follow exactly.
The market was crowded with people buying apples, onions, cheese and fresh fish.
When the storm passed, the sailors repaired the sails and set a course for home.
Reading a good book on a quiet evening is one of the great pleasures of life.
The teacher explained the lesson twice, and then the students tried the exercises.
Birds build nests in spring, and by summer the young ones learn to fly.
You should always check your answer, even when you are sure it is correct.
The city council approved a plan to build more parks and bicycle lanes.
Hello! How are you today? I am fine, thank you, and I hope you are well too.
The recipe calls for two cups of flour, one egg, a pinch of salt and some milk.
Light travels faster than sound, which is why we see lightning before we hear thunder.
They walked along the beach, collecting shells and talking about their plans.
An assistant answers questions clearly, politely and with useful details.
The system message sets the rules, the user asks, and the assistant replies.
Winter evenings are long and dark, but the fire keeps the house warm and bright.
The old clock in the hall struck midnight, and everyone wished each other a happy new year.
Learning to play the piano takes patience, practice and a little bit of talent.
The spacecraft sent back pictures of a distant planet covered in red dust.
"""


def build_tokenizer(out_dir: str, vocab_size: int = 512, model_max_length: int = 512,
                    extra_special_tokens: tuple[str, ...] = (), added_tokens: tuple[str, ...] = ()) -> None:
    """Train a byte-level BPE tokenizer on TRAINING_TEXT and save it as a transformers tokenizer.

    `extra_special_tokens` join SPECIAL_TOKENS (inside `vocab_size`); `added_tokens` are plain words that
    always encode as one token each (ids from `vocab_size` on), as a real vocabulary would hold them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special_tokens = SPECIAL_TOKENS + list(extra_special_tokens)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the embedded training text supports at most {tokenizer.get_vocab_size()} tokens, "
                         f"asked for vocab_size={vocab_size}")
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))

    save_transformers_tokenizer(tokenizer, out_dir, model_max_length, special_tokens)


def save_transformers_tokenizer(tokenizer: Any, out_dir: str, model_max_length: int,
                                special_tokens: list[str] = SPECIAL_TOKENS) -> None:
    """Write a `tokenizers.Tokenizer` that holds `special_tokens` (SPECIAL_TOKENS first) as a transformers
    fast tokenizer with the ChatML template (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    special = {token: tokenizer.token_to_id(token) for token in special_tokens}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "rstrip": False, "normalized": False,
                            "single_word": False, "special": True}
            for token, token_id in special.items()
        },
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"),
                {"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"})


# arch -> (transformers config class name, model class name, config defaults specific to the variant)
_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 128}}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3-untied": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Mixtures of experts (expert weights written per expert, as transformers 5's save_pretrained does).
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "tie_word_embeddings": False}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    # Hybrid: short-convolution layers mixed with attention (LFM2 ties embeddings by default).
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, "norm_eps": 1e-6, "tie_word_embeddings": True,
        "block_auto_adjust_ff_dim": True, "block_multiple_of": 32}),
}

SUPPORTED_TINY_ARCHS = tuple(_ARCHS)


def build_tiny_model(arch: str, out_dir: str, seed: int = 0, max_shard_size: str | int | None = None,
                     vocab_size: int = 512, **config_overrides: Any) -> str:
    """Write a random-weight float32 checkpoint of `arch` (plus tokenizer and generation config) to out_dir.

    `max_shard_size` (e.g. "20KB") splits the weights into shards with a model.safetensors.index.json.
    """
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(_ARCHS)}")
    config_class_name, model_class_name, variant = _ARCHS[arch]
    max_positions = int(config_overrides.get("max_position_embeddings", 512))
    build_tokenizer(out_dir, vocab_size=vocab_size, model_max_length=max_positions)
    tokenizer_json = json.load(open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8"))
    eos_id = next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == EOS_TOKEN)
    pad_id = next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == "<|endoftext|>")

    config_kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    config_kwargs.update(variant)
    config_kwargs.update(config_overrides)
    config = getattr(transformers, config_class_name)(**config_kwargs)
    model = _random_model(getattr(transformers, model_class_name), config, seed)
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    logger.debug("built tiny %s model in %s", arch, out_dir)
    return out_dir


def build_tiny_classifier(arch: str, out_dir: str, num_labels: int = 3, seed: int = 0, **config_overrides: Any) -> str:
    """Write a random-weight float32 `<Arch>ForSequenceClassification` checkpoint of `arch` (the decoder of
    build_tiny_model's and a `score` head of `num_labels` classes named LABEL_0 ...; no LM head), with its
    tokenizer."""
    import transformers

    build_tiny_model(arch, out_dir, seed=seed, **config_overrides)
    config = transformers.AutoConfig.from_pretrained(out_dir)
    config.num_labels = num_labels
    name = _ARCHS[arch][1].removesuffix("ForCausalLM") + "ForSequenceClassification"
    config.architectures = [name]
    for path in os.listdir(out_dir):
        if path.startswith("model") and path.endswith((".safetensors", ".json")):
            os.remove(os.path.join(out_dir, path))
    _random_model(getattr(transformers, name), config, seed).save_pretrained(out_dir, safe_serialization=True)
    logger.debug("built tiny %s classifier in %s", arch, out_dir)
    return out_dir


def _random_model(model_class: Any, config: Any, seed: int) -> Any:
    # HF's init draws from normal(0, initializer_range=0.02); such small weights make every tiny model
    # predict near-uniform logits, which hides numerical bugs. Wider weights give peaked distributions.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.copy_(0.1 * torch.randn_like(param))
                else:
                    param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def _write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
