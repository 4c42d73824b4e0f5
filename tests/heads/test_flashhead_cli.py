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
