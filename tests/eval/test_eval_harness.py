"""`pellucid eval ppl | agree` against brute-force transformers computations on tiny random models."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pellucid import LLM
from pellucid.eval.cli import main as eval_main
from pellucid.eval.data import token_windows
from pellucid.eval.harness import compare_configs, engine_perplexity
from pellucid.eval.heads import flashhead_logits
from pellucid.heads.flashhead.cli import read_head_weight
from pellucid.heads.registry import build_head
from pellucid.tokenizer import load_tokenizer
from pellucid.tiny_models import TRAINING_TEXT


@pytest.fixture(scope="module")
def model_with_asset(tiny_model_factory, tmp_path_factory):
    """A tiny Qwen3 (vocab 512, hidden 64) with a FlashHead asset of 32 clusters x 16, in its own copy."""
    from pellucid.heads.flashhead.cli import add_flashhead_parser
    import argparse

    model_dir = str(tmp_path_factory.mktemp("eval-model") / "m")
    shutil.copytree(tiny_model_factory("qwen3", seed=3), model_dir)
    parser = argparse.ArgumentParser()
    add_flashhead_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flashhead", "build", model_dir, "--iterations", "3", "--device", "cpu"])
    assert args.func(args) == 0
    return model_dir


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-data") / "text.txt"
    path.write_text(TRAINING_TEXT + "<|endoftext|>" + TRAINING_TEXT[::-1], encoding="utf-8")
    return str(path)


def _hf_nll(model_dir: str, windows: list[list[int]]) -> tuple[float, int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = hf(torch.tensor([window])).logits[0].double()
            logprobs = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(logprobs.gather(1, torch.tensor(window[1:])[:, None]).sum())
            count += len(window) - 1
    return nll, count


def test_windows_cut_the_file_like_training(model_with_asset, text_file):
    tokenizer = load_tokenizer(model_with_asset)
    ids = tokenizer.backend_tokenizer.encode(open(text_file).read(), add_special_tokens=False).ids
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids.count(end) == 1                          # the special token written in the text is that token
    windows = token_windows(tokenizer, text_file, 37)
    assert windows == [ids[i:i + 37] for i in range(0, len(ids) // 37 * 37, 37)]
    assert token_windows(tokenizer, text_file, 37, max_tokens=80) == windows[:2]
    assert token_windows(tokenizer, text_file, 10 ** 6) == [ids]      # shorter than a window: one window


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_perplexity_equals_transformers(tiny_model_factory, seed):
    model_dir = tiny_model_factory("qwen3", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    windows = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 40, 17)]
    result = engine_perplexity(LLM(model_dir, dtype="float32", device="cpu"), windows)
    nll, count = _hf_nll(model_dir, windows)
    assert result.tokens == count
    assert abs(result.nll - nll) / nll < 1e-5


def test_flashhead_logit_estimate_brute_force(model_with_asset):
    """Exact logits for the tokens of the p best clusters, the cluster's mean logit for the others."""
    weight = read_head_weight(model_with_asset).float()
    for seed, probes in [(0, 3), (1, 7), (2, 32)]:
        head = build_head("flashhead", weight, {"probes": probes, "max_fast_batch": None}, model_with_asset)
        hidden = torch.randn(6, weight.shape[1], generator=torch.Generator().manual_seed(seed))
        estimate, exact = flashhead_logits(head, hidden)
        dense = hidden @ weight.t()
        members = head.cluster_token_ids
        for row in range(hidden.shape[0]):
            cluster_means = torch.stack([dense[row, m[m >= 0]].mean() for m in members])
            best = set(cluster_means.topk(probes).indices.tolist())
            for cluster, m in enumerate(members):
                m = m[m >= 0]
                if cluster in best:
                    assert torch.allclose(estimate[row, m], dense[row, m], rtol=1e-5, atol=1e-5)
                    assert exact[row, m].all()
                else:
                    assert torch.allclose(estimate[row, m], cluster_means[cluster].expand(len(m)), rtol=1e-4, atol=1e-4)
                    assert not exact[row, m].any()


def test_compare_configs(model_with_asset, text_file):
    windows = token_windows(load_tokenizer(model_with_asset), text_file, 64)
    clusters = 32
    reference = {"dtype": "float32", "device": "cpu"}
    candidates = [{**reference, "head": "flashhead", "head_options": {"probes": p}} for p in (2, clusters)]
    results = compare_configs(model_with_asset, windows, reference, candidates)
    nll, count = _hf_nll(model_with_asset, windows)
    ref, few, every = results
    assert ref.positions == count and ref.agreement == 1.0 and ref.target_exact == 1.0
    assert abs(math.log(ref.perplexity) - nll / count) < 1e-5            # traced states + dense head = transformers
    assert every.agreement == 1.0 and every.target_exact == 1.0          # all clusters probed: the dense head
    assert abs(every.perplexity - ref.perplexity) / ref.perplexity < 1e-5
    # Two of 32 clusters: a brute-force greedy over those clusters' tokens gives the same agreement.
    hf = AutoModelForCausalLM.from_pretrained(model_with_asset, dtype=torch.float32).eval()
    weight = read_head_weight(model_with_asset).float()
    head = build_head("flashhead", weight, {"probes": 2, "max_fast_batch": None}, model_with_asset)
    agree = []
    with torch.no_grad():
        for window in windows:
            hidden = hf(torch.tensor([window]), output_hidden_states=True).hidden_states[-1][0, :-1]
            dense = hidden @ weight.t()
            for row in range(hidden.shape[0]):
                means = torch.stack([dense[row, m[m >= 0]].mean() for m in head.cluster_token_ids])
                tokens = torch.cat([m[m >= 0] for m in head.cluster_token_ids[means.topk(2).indices]])
                best = tokens[dense[row, tokens].argmax()]
                agree.append(int(best) == int(dense[row].argmax()))
    assert abs(few.agreement - sum(agree) / len(agree)) <= 2 / len(agree)   # near-ties may flip a row
    assert few.target_exact < 1.0 and few.perplexity != ref.perplexity


def test_unknown_head_is_a_clear_error(model_with_asset, text_file):
    windows = token_windows(load_tokenizer(model_with_asset), text_file, 64)[:1]
    with pytest.raises(ValueError, match="no adapter for LM head 'mystery'"):
        compare_configs(model_with_asset, windows, {}, [{"head": "mystery"}])


def test_cli_ppl_and_agree(model_with_asset, text_file, tmp_path, capsys):
    ppl_json, agree_json = tmp_path / "ppl.json", tmp_path / "agree.json"
    assert eval_main(["ppl", "--model", model_with_asset, "--data", text_file, "--context", "64",
                      "--device", "cpu", "--dtype", "float32", "--json", str(ppl_json)]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert eval_main(["agree", "--model", model_with_asset, "--data", text_file, "--context", "64",
                      "--reference", '{"device": "cpu", "dtype": "float32"}', "--head", "flashhead",
                      "--head-options", '{"stage1_dtype": "float32"}', "--probes", "4,32",
                      "--json", str(agree_json)]) == 0
    out = capsys.readouterr().out
    assert '"probes": 4' in out and '"probes": 32' in out
    ppl, agree = json.loads(ppl_json.read_text()), json.loads(agree_json.read_text())
    assert [r["config"].get("head_options", {}).get("probes") for r in agree["results"]] == [None, 4, 32]
    assert all(r["config"]["dtype"] == "float32" for r in agree["results"])     # --head inherits the reference
    # Two independent paths to the dense perplexity: prompt logprobs, and traced states + the dense head.
    assert abs(agree["results"][0]["perplexity"] - ppl["perplexity"]) / ppl["perplexity"] < 1e-5
    with pytest.raises(SystemExit, match="need --head"):
        eval_main(["agree", "--model", model_with_asset, "--data", text_file, "--probes", "4"])
