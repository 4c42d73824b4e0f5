"""Generate-then-extract, chat data and the assistant loss mask."""
from __future__ import annotations

import json
import shutil

import pytest

from pellucid import LLM, SamplingParams
from pellucid.extraction import ExtractionError, HiddenStatesDataset
from pellucid.extraction.samples import chat_tokens_and_mask
from pellucid.tiny_models import CHAT_TEMPLATE
from tests.extraction.conftest import TOLERANCE, expected_states, random_prompts, relative_error

LAYERS = [1, -1]

# The same ChatML rendering with the assistant's part inside {% generation %} (transformers' assistant mask).
GENERATION_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{%- if message['role'] == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif -%}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! How are you today?"},
     {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "system", "content": "An assistant answers questions clearly."},
     {"role": "user", "content": "What time is it?"},
     {"role": "assistant", "content": "It is half past seven."},
     {"role": "user", "content": "And the train?"},
     {"role": "assistant", "content": "The train leaves at eight, so please hurry."}],
]


@pytest.fixture(scope="module")
def generation_template_dir(ext_model_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("llama-generation-template")
    shutil.copytree(ext_model_dir("llama"), out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = GENERATION_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(out)


def _assistant_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_loss_mask_rules_agree(make_ext_llm, generation_template_dir, index):
    """The prefix-render rule and transformers' {% generation %} masks mark the same tokens: the assistant
    contents and their end-of-turn markup, nothing else."""
    plain = make_ext_llm("llama").get_tokenizer()
    marked = LLM(generation_template_dir, dtype="float32", device="cpu", num_kv_blocks=64).get_tokenizer()
    conversation = CONVERSATIONS[index]
    ids_a, mask_a = chat_tokens_and_mask(plain, conversation, add_generation_prompt=False)
    ids_b, mask_b = chat_tokens_and_mask(marked, conversation, add_generation_prompt=False)
    rendered = plain.apply_chat_template(conversation, tokenize=True)
    assert ids_a == ids_b == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert mask_a == mask_b
    expected = "".join(m["content"] + "<|im_end|>\n" for m in conversation if m["role"] == "assistant")
    assert _assistant_text(plain, ids_a, mask_a) == expected


def test_generate_covers_prompt_and_response(make_ext_llm, hf_reference, tmp_path):
    llm = make_ext_llm("qwen3", max_num_batched_tokens=16)
    prompts = random_prompts(31, [12, 25, 6])
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    summary = llm.extract_hidden_states(prompts, layers=LAYERS, output_dir=str(tmp_path), generate=params,
                                        progress=False)
    generated = llm.generate(prompts, params, use_tqdm=False)
    assert summary.num_tokens == sum(len(p) + 9 for p in prompts)
    for item in HiddenStatesDataset(str(tmp_path)):
        index = int(item["id"])
        sequence = prompts[index] + generated[index].outputs[0].token_ids
        assert item["input_ids"].tolist() == sequence          # the last response token included
        assert item["prompt_length"] == len(prompts[index])
        ref = hf_reference("qwen3", sequence)
        assert relative_error(item["hidden_states"], expected_states(ref, LAYERS)) <= TOLERANCE


def test_generate_stops_below_max_model_len(make_ext_llm, tmp_path):
    llm = make_ext_llm("llama", max_model_len=40)
    prompts = random_prompts(32, [30, 39])
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    summary = llm.extract_hidden_states(prompts, layers=LAYERS, output_dir=str(tmp_path), generate=params,
                                        progress=False, skip_invalid=True)
    assert list(summary.invalid) == ["1"] and "no room for a response" in summary.invalid["1"]
    (item,) = list(HiddenStatesDataset(str(tmp_path)))
    assert item["input_ids"].shape[0] == 39                 # prompt + response capped to max_model_len - 1


def test_chat_generate_masks_previous_assistant_turns_and_response(make_ext_llm, hf_reference, tmp_path):
    llm = make_ext_llm("llama")
    tokenizer = llm.get_tokenizer()
    conversation = CONVERSATIONS[1][:4]          # ends with a user turn: the model answers it
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    llm.extract_hidden_states([{"id": "chat", "messages": conversation}], layers=LAYERS, output_dir=str(tmp_path),
                              generate=params, progress=False)
    (item,) = list(HiddenStatesDataset(str(tmp_path)))
    prompt_ids, prompt_mask = chat_tokens_and_mask(tokenizer, conversation, add_generation_prompt=True)
    assert prompt_ids[-3:] == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    response = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert item["input_ids"].tolist() == prompt_ids + response
    assert item["prompt_length"] == len(prompt_ids)
    assert item["loss_mask"].tolist() == [bool(m) for m in prompt_mask] + [True] * len(response)
    assert _assistant_text(tokenizer, prompt_ids, prompt_mask) == "It is half past seven.<|im_end|>\n"
    ref = hf_reference("llama", prompt_ids + response)
    assert relative_error(item["hidden_states"], expected_states(ref, LAYERS)) <= TOLERANCE


def test_mixed_data_forms(make_ext_llm, tmp_path):
    llm = make_ext_llm("llama")
    tokenizer = llm.get_tokenizer()
    data = ["The quick brown fox", [5, 6, 7, 8], CONVERSATIONS[0], {"id": "r", "prompt": "Hello world"}]
    llm.extract_hidden_states(data, layers=LAYERS, output_dir=str(tmp_path), progress=False)
    items = {item["id"]: item for item in HiddenStatesDataset(str(tmp_path))}
    assert sorted(items) == ["0", "1", "2", "r"]
    assert items["0"]["input_ids"].tolist() == tokenizer("The quick brown fox")["input_ids"]
    assert items["1"]["input_ids"].tolist() == [5, 6, 7, 8] and "loss_mask" not in items["1"]
    assert items["2"]["loss_mask"].any() and items["2"]["prompt_length"] == len(items["2"]["input_ids"])
    with pytest.raises(ValueError, match="one conversation"):
        llm.extract_hidden_states(CONVERSATIONS[0], layers=LAYERS, output_dir=str(tmp_path / "x"), progress=False)


def test_conversation_the_template_rejects(make_ext_llm, tmp_path):
    llm = make_ext_llm("llama")
    data = [{"id": "bad", "messages": [{"role": "robot", "content": "x"}]}, {"id": "ok", "prompt": "Hello"}]
    with pytest.raises(ExtractionError, match="'bad'.*chat template failed.*unsupported chat role"):
        llm.extract_hidden_states(data, layers=LAYERS, output_dir=str(tmp_path), progress=False)
    summary = llm.extract_hidden_states(data, layers=LAYERS, output_dir=str(tmp_path), progress=False,
                                        skip_invalid=True)
    assert list(summary.invalid) == ["bad"] and summary.num_samples == 1
