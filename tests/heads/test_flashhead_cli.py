"""`pellucid flashhead build | eval` on a tiny random checkpoint (tied and untied heads)."""
from __future__ import annotations

import argparse

import pytest
import torch

from pellucid.heads.flashhead.asset import default_asset_path, load_asset
from pellucid.heads.flashhead.cli import add_flashhead_parser, read_head_weight


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pellucid")
    add_flashhead_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize("tied", [False, True])
def test_build_then_eval(tiny_model_factory, capsys, tied):
    from safetensors.torch import load_file
    import glob

    model_dir = tiny_model_factory("qwen3", tie_word_embeddings=tied)
    stored = {}
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        stored.update(load_file(path))
    expected = stored["model.embed_tokens.weight"] if tied else stored["lm_head.weight"]
    weight = read_head_weight(model_dir)
    assert torch.equal(weight, expected)

    args = _parse(["flashhead", "build", model_dir, "--cluster-size", "16", "--iterations", "3", "--device", "cpu"])
    assert args.func(args) == 0
    asset = load_asset(default_asset_path(model_dir), weight)
    assert asset.token_ids.shape == (-(-weight.shape[0] // 16), 16)

    # All probes: the candidates are the whole vocabulary, so agreement and containment must be exactly 1.
    args = _parse(["flashhead", "eval", model_dir, "--probes", str(asset.num_clusters), "--device", "cpu",
                   "--dtype", "float32"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    values = {line.split("  ")[1].strip(): line.split()[-1] for line in out.splitlines() if line.startswith("  ")}
    assert values["top-1 agreement with dense"] == "1.0000"
    assert values["top-5 containment (dense top-5 in candidates)"] == "1.0000"
    assert float(values["dense head latency, batch 1 (us/step)"]) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_build_accepts_any_number_of_clusters(tiny_model_factory, capsys, tmp_path, seed):
    """`--clusters C` for a C that is not ceil(V / ceil(V / C)) (the issue: 1000 for a 151,936 vocab): the
    asset has C clusters, every token once, none empty; the head loads it and, probing every cluster,
    is the dense head exactly."""
    from pellucid.heads.flashhead import FlashHead
    from pellucid.heads.flashhead.clustering import PAD_TOKEN

    model_dir = tiny_model_factory("qwen3")
    weight = read_head_weight(model_dir)
    vocab = weight.shape[0]
    rng = torch.Generator().manual_seed(seed)
    clusters = int(torch.randint(vocab // 5, vocab // 2, (1,), generator=rng))
    assert -(-vocab // -(-vocab // clusters)) != clusters       # the shape the old build refused
    out = str(tmp_path / "asset.safetensors")
    args = _parse(["flashhead", "build", model_dir, "--clusters", str(clusters), "--iterations", "2",
                   "--device", "cpu", "--out", out])
    assert args.func(args) == 0
    assert f"{clusters} clusters x {-(-vocab // clusters)} tokens for vocab {vocab}" in capsys.readouterr().out
    asset = load_asset(out, weight)
    assert asset.num_clusters == clusters
    real = asset.token_ids[asset.token_ids != PAD_TOKEN]
    assert torch.equal(real.sort().values, torch.arange(vocab))
    assert bool(((asset.token_ids != PAD_TOKEN).sum(dim=1) >= 1).all())
    head = FlashHead(weight, {"asset": out, "probes": clusters})
    hidden = torch.randn(16, weight.shape[1], generator=rng)
    assert torch.equal(head.greedy(hidden), (hidden @ weight.T).argmax(dim=1))


@pytest.mark.parametrize("argv, message", [
    (["--clusters", "1000"], "clusters must be in [1, vocab_size=512], got 1000"),
    (["--clusters", "0"], "clusters must be in [1, vocab_size=512], got 0"),
    (["--cluster-size", "0"], "cluster_size must be >= 1, got 0"),
    (["--clusters", "40", "--cluster-size", "16"], "use 32 clusters"),
])
def test_build_refuses_impossible_shapes_with_one_line(tiny_model_factory, capsys, tmp_path, argv, message):
    model_dir = tiny_model_factory("qwen3")
    capsys.readouterr()
    args = _parse(["flashhead", "build", model_dir, *argv, "--device", "cpu", "--out", str(tmp_path / "a")])
    assert args.func(args) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and message in captured.err
    assert not (tmp_path / "a").exists()


def test_eval_refuses_bad_probes_with_one_line(tiny_model_factory, capsys):
    model_dir = tiny_model_factory("qwen3")
    args = _parse(["flashhead", "build", model_dir, "--iterations", "1", "--device", "cpu"])
    assert args.func(args) == 0
    capsys.readouterr()
    args = _parse(["flashhead", "eval", model_dir, "--probes", "33", "--device", "cpu", "--dtype", "float32"])
    assert args.func(args) == 1
    err = capsys.readouterr().err      # after transformers' loading progress bar
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: flashhead probes must be an integer in [1, 32]")
