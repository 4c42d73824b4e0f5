"""The training pipeline of the default model on small synthetic inputs (CI has no Debian text packages)."""
from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import math

import pytest
from transformers import AutoTokenizer

from pellucid import LLM
from pellucid.eval.data import token_windows
from pellucid.eval.harness import engine_perplexity
from pellucid.tiny_models import TRAINING_TEXT
from pellucid.training import corpus, sources
from pellucid.training.tokenizer import train_tokenizer
from pellucid.training.train import main as train_main

GCIDE_SAMPLE = """\
00-database-url
   ftp://ftp.gnu.org/gnu/gcide

GCIDE is free software; you can redistribute it and/or modify it
under the terms of the GNU General Public License.

Abjure \\Ab*jure"\\, v. t. [imp. & p. p. {Abjured}; p. pr. & vb.
   n. {Abjuring}.] [L. abjurare to deny upon oath.]
   1. To renounce upon oath; as, to abjure allegiance.
      [1913 Webster]

   2. To reject with solemnity. "Magic I here abjure." --Shak.
      [1913 Webster]

Abjurer \\Ab*jur"er\\, n.
   One who abjures.
   [1913 Webster]
This unindented line is not part of any entry.
"""


def test_gcide_reader_keeps_entries_and_drops_markup(tmp_path, monkeypatch):
    path = tmp_path / "gcide.dict.dz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(GCIDE_SAMPLE)
    monkeypatch.setattr(sources, "GCIDE_FILE", str(path))
    docs = list(sources.read_gcide())
    assert docs == [("gcide:0",
                     "Abjure, v. t. [imp. & p. p. Abjured; p. pr. & vb. n. Abjuring.] [L. abjurare to deny upon oath.] "
                     "1. To renounce upon oath; as, to abjure allegiance.\n"
                     "2. To reject with solemnity. \"Magic I here abjure.\" --Shak.\n\n"
                     "Abjurer, n. One who abjures.")]


def test_info_cross_references_become_prose():
    text = "The *note dataclass(): 193. decorator, such as *note __eq__(): 79a, and *note Foo:: too."
    cleaned = sources._INFO_XREF.sub(lambda m: m.group(1) + ("," if m.group(2) == "," else ""), text)
    assert cleaned == "The dataclass() decorator, such as __eq__(), and Foo too."


def test_validation_split_is_a_stable_hash():
    ids = [f"doc:{i}" for i in range(20000)]
    chosen = [i for i in ids if corpus.is_validation(i)]
    assert 0.007 < len(chosen) / len(ids) < 0.013
    expected = [i for i in ids if int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") % 1000 < 10]
    assert chosen == expected
    assert corpus.words_of("The LORD's shepherd, don't 42 x-ray") == ["the", "lord's", "shepherd", "don't", "x", "ray"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """train.jsonl.xz / val.jsonl.xz / val.txt in build_corpus's formats, from the tiny English text."""
    root = tmp_path_factory.mktemp("corpus")
    lines = [line for line in TRAINING_TEXT.splitlines() if line]
    docs = [{"source": "tiny", "id": f"tiny:{i}", "text": " ".join(lines[i:i + 3])} for i in range(len(lines))]
    chat = {"source": "chat", "id": "chat:0", "text": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>"}
    for split, items in (("train", docs * 8 + [chat]), ("val", docs[:12])):
        with lzma.open(root / f"{split}.jsonl.xz", "wt", encoding="utf-8") as handle:
            for doc in items:
                handle.write(json.dumps(doc) + "\n")
    (root / "val.txt").write_text("".join(d["text"] + corpus.END_OF_TEXT for d in docs[:12]), encoding="utf-8")
    return root


def test_tokenizer_training(small_corpus, tmp_path):
    out = tmp_path / "tok"
    train_tokenizer(str(small_corpus), str(out), vocab_size=400, model_max_length=64)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 400
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    text = "The quick brown fox jumps over the lazy dog.\nÜnïcödé too"
    assert tok.decode(tok(text).input_ids) == text                     # byte level: every text round-trips
    assert tok("Hi<|im_end|>").input_ids[-1] == 2
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    train_tokenizer(str(small_corpus), str(tmp_path / "again"), vocab_size=400, model_max_length=64)
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "again" / "tokenizer.json").read_bytes()


def test_training_run_is_reproducible_and_its_perplexity_is_the_engines(small_corpus, tmp_path):
    tokenizer = tmp_path / "tok"
    train_tokenizer(str(small_corpus), str(tokenizer), vocab_size=400, model_max_length=64)
    records = []
    for run in ("a", "b"):
        argv = ["--corpus", str(small_corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / run),
                "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup", "1", "--val-windows", "3",
                "--device", "cpu", "--eval-every", "0", "--log-every", "1"]
        assert train_main(argv) == 0
        records.append(json.loads((tmp_path / run / "training.json").read_text()))
    first, second = records
    assert first["val_loss"] == second["val_loss"]                      # CPU: bit-identical reruns
    assert first["val_loss"] < math.log(400)                           # below a uniform guess after 3 steps
    assert math.isclose(first["val_perplexity"], math.exp(first["val_loss"]))
    # The recorded validation perplexity is what Pellucid's engine measures on the saved (bfloat16) weights.
    llm = LLM(str(tmp_path / "a"), dtype="float32", device="cpu")
    windows = token_windows(llm.get_tokenizer(), str(small_corpus / "val.txt"), 32)[:3]
    assert len(windows) == 3
    measured = engine_perplexity(llm, windows)
    assert abs(measured.mean_nll - first["val_loss"]) < 1e-4
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
