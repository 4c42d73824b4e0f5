"""The embedded default model (pellucid-debian-13m): packaged, equal to transformers, and writes English."""
from __future__ import annotations

import fnmatch
import gzip
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from transformers import AutoModelForCausalLM

from pellucid import LLM, SamplingParams
from pellucid.default_model import DEFAULT_MODEL_NAME, default_model_dir, ensure_default_model, is_default_model
from tests.reference import random_prompts, relative_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = os.path.join(ROOT, "tests", "data", "corpus_words.txt.gz")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return ensure_default_model()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu")


def test_files_are_package_data_and_fit_the_budget(model_dir):
    """Every file of the model is matched by pyproject's package-data, so a regular install has it too."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        patterns = tomllib.load(handle)["tool"]["setuptools"]["package-data"]["pellucid"]
    package_root = os.path.join(ROOT, "pellucid")
    files = [os.path.relpath(os.path.join(d, f), package_root) for d, _, fs in os.walk(model_dir) for f in fs]
    assert files and all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in files), files
    total = sum(os.path.getsize(os.path.join(package_root, f)) for f in files)
    assert total <= 30 * 10 ** 6
    config = json.load(open(os.path.join(model_dir, "config.json")))
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert is_default_model(model_dir) and model_dir == default_model_dir()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_equal_transformers(llm, hf_model, seed):
    prompts = random_prompts(seed, [7, 64, 300], vocab=8192)
    with llm.trace(prompts) as tr:
        logits = tr.logits.save()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0].float()
        assert relative_error(logits[i], expected) <= 1e-4


def test_greedy_generation_equals_transformers(llm, hf_model, model_dir):
    tokenizer = llm.get_tokenizer()
    texts = ["The Lord is", "In the beginning", "Abjure, v. t.", "def main():\n"]
    prompts = [tokenizer(t).input_ids for t in texts] + random_prompts(5, [12], vocab=8192)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


def test_cli_default_prints_english():
    """`pellucid generate "The Lord is"` with no model: at least 80% of the words it prints are words of the
    training corpus (seen at least twice in its train split), and nothing calls the weights random."""
    with gzip.open(WORDS, "rt", encoding="utf-8") as handle:
        vocabulary = set(handle.read().split())
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "pellucid.cli", "generate", "The Lord is", "--max-tokens", "64"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "RANDOM" not in out.stderr and DEFAULT_MODEL_NAME in out.stderr
    text = out.stdout.split("\n", 1)[1]                 # after the "--- prompt: ..." line
    words = [w.lower() for w in re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", text)]
    assert len(words) >= 20, text
    known = sum(w in vocabulary for w in words)
    assert known / len(words) >= 0.8, (known, len(words), text)


def test_chat_template_and_stop_tokens(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does abjure mean?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat does abjure mean?<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat([{"role": "user", "content": "What does abjure mean?"}],
                   SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"                  # the model learned to end its turn
    assert out.text.strip()
