"""Weight loading: sharded and single-file checkpoints, tied embeddings, and clear errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pellucid.models.loader import load_model, read_eos_token_ids, read_generation_config, read_tensors
from pellucid.models.registry import get_model_class, supported_architectures
from pellucid.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("llama")), seed=3)


def _copy(model_dir: str, tmp_path) -> str:
    target = str(tmp_path / "copy")
    shutil.copytree(model_dir, target)
    return target


def _state_dict_from_files(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_loaded_parameters_equal_checkpoint_tensors(llama_dir: str) -> None:
    model, hf_config = load_model(llama_dir, torch.float32, "cpu")
    expected = _state_dict_from_files(llama_dir)
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(params[name].detach(), tensor), name
    assert hf_config.architectures == ["LlamaForCausalLM"]


def test_sharded_checkpoint_loads_identically(llama_dir: str, tmp_path) -> None:
    sharded = build_tiny_model("llama", str(tmp_path / "sharded"), seed=3, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    single, _ = load_model(llama_dir, torch.float32, "cpu")
    multi, _ = load_model(sharded, torch.float32, "cpu")
    single_params = dict(single.named_parameters())
    for name, param in multi.named_parameters():
        assert torch.equal(param, single_params[name]), name
    head = read_tensors(sharded, ["lm_head.weight", "model.norm.weight"])
    assert torch.equal(head["lm_head.weight"], single_params["lm_head.weight"].detach())
    assert torch.equal(head["model.norm.weight"], single_params["model.norm.weight"].detach())


def test_missing_shard_file_is_named(tmp_path) -> None:
    sharded = build_tiny_model("llama", str(tmp_path / "sharded"), seed=1, max_shard_size="40KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(sharded, torch.float32, "cpu")


def test_tied_embeddings_share_one_tensor(tmp_path) -> None:
    model_dir = build_tiny_model("qwen3", str(tmp_path), seed=5)
    assert "lm_head.weight" not in _state_dict_from_files(model_dir)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.tie_word_embeddings
    untied = build_tiny_model("qwen3-untied", str(tmp_path / "untied"), seed=5)
    model, _ = load_model(untied, torch.float32, "cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_loads_in_bfloat16(llama_dir: str) -> None:
    model, _ = load_model(llama_dir, torch.bfloat16, "cpu")
    expected = _state_dict_from_files(llama_dir)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, expected[name].to(torch.bfloat16)), name


def test_truncated_file_error_names_the_file(llama_dir: str, tmp_path) -> None:
    model_dir = _copy(llama_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    data = open(path, "rb").read()
    for keep in (len(data) // 2, 5):
        with open(path, "wb") as f:
            f.write(data[:keep])
        with pytest.raises(ValueError, match="model.safetensors"):
            load_model(model_dir, torch.float32, "cpu")


def test_missing_tensor_error_names_the_tensor(llama_dir: str, tmp_path) -> None:
    model_dir = _copy(llama_dir, tmp_path)
    tensors = _state_dict_from_files(model_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_wrong_shape_and_unexpected_tensor_are_named(llama_dir: str, tmp_path) -> None:
    model_dir = _copy(llama_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = _state_dict_from_files(model_dir)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        load_model(model_dir, torch.float32, "cpu")
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.ones(2)
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)   # derived state: ignored
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_unknown_architecture_error_names_it(llama_dir: str, tmp_path) -> None:
    model_dir = _copy(llama_dir, tmp_path)
    config_path = os.path.join(model_dir, "config.json")
    config = json.load(open(config_path))
    config["architectures"] = ["FancyNewForCausalLM"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        load_model(model_dir, torch.float32, "cpu")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        supported_architectures())


def test_missing_weights_and_config_are_reported(llama_dir: str, tmp_path) -> None:
    model_dir = _copy(llama_dir, tmp_path)
    os.remove(os.path.join(model_dir, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(model_dir, torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_generation_config_and_eos_ids(llama_dir: str, tmp_path) -> None:
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(llama_dir).convert_tokens_to_ids("<|im_end|>")
    assert read_generation_config(llama_dir)["eos_token_id"] == eos_id
    assert read_eos_token_ids(llama_dir) == {eos_id}
    model_dir = _copy(llama_dir, tmp_path)
    json.dump({"eos_token_id": [eos_id, 0]}, open(os.path.join(model_dir, "generation_config.json"), "w"))
    assert read_eos_token_ids(model_dir) == {eos_id, 0}
    os.remove(os.path.join(model_dir, "generation_config.json"))
    assert read_generation_config(model_dir) == {}
    assert read_eos_token_ids(model_dir) == {eos_id}   # falls back to config.json


def test_tiny_builds_are_deterministic(tmp_path) -> None:
    first = build_tiny_model("qwen2", str(tmp_path / "a"), seed=11)
    second = build_tiny_model("qwen2", str(tmp_path / "b"), seed=11)
    other_seed = build_tiny_model("qwen2", str(tmp_path / "c"), seed=12)
    for name in sorted(os.listdir(first)):
        assert open(os.path.join(first, name), "rb").read() == open(os.path.join(second, name), "rb").read(), name
    assert open(os.path.join(first, "model.safetensors"), "rb").read() != \
        open(os.path.join(other_seed, "model.safetensors"), "rb").read()


def test_tiny_tokenizer_round_trips_and_renders_chatml(llama_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert len(tokenizer) == 512
    text = "Hello there! The museum opens at 9, café prices vary."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())            # merges were learned
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")
    ids = tokenizer(rendered)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe", "lfm2"])
def test_loading_a_model_imports_no_compiler_machinery(arch: str, tmp_path) -> None:
    """Models are built on the meta device and then loaded. Some meta ops import torch._dynamo (nn.Embedding's
    normal_ init, torch.cat of the merged projections) or sympy (empty_like, in nn.Module.to_empty): together
    about 1.2 s of every engine process's start-up on the dev machine; the loader and layers avoid them.
    Checked in a fresh interpreter, after the config is read (some transformers versions import both
    themselves while reading one, and then there is nothing left to check)."""
    import subprocess
    import sys

    model_dir = build_tiny_model(arch, str(tmp_path / arch), seed=1)
    script = ("import sys, torch\n"
              "from pellucid.models.loader import load_model, read_hf_config\n"
              "watched = ('torch._dynamo', 'sympy')\n"
              f"read_hf_config({model_dir!r})\n"
              "print('by the config:', [name for name in watched if name in sys.modules])\n"
              f"model, _ = load_model({model_dir!r}, dtype=torch.float32, device='cpu', max_model_len=64)\n"
              "assert sum(p.numel() for p in model.parameters()) > 0\n"
              "print('by the model:', [name for name in watched if name in sys.modules])\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    if "by the config: []" not in run.stdout:
        pytest.skip(f"this transformers imports them while reading a config: {run.stdout.splitlines()[0]}")
    assert "by the model: []" in run.stdout, run.stdout + run.stderr[-3000:]
