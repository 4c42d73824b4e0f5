"""Train the byte-level BPE: `python -m pellucid.training.tokenizer --corpus DIR --out DIR [--vocab-size 8192]`.

Trained on the corpus's train split with `tokenizers`, saved in transformers' format with the special
tokens (<|endoftext|> ends a document, <|im_start|>/<|im_end|> frame chat turns) and the ChatML template.
Training is deterministic for a given corpus and vocabulary size.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

from pellucid.tiny_models import SPECIAL_TOKENS, save_transformers_tokenizer
from pellucid.training.corpus import read_jsonl_xz

DEFAULT_VOCAB_SIZE = 8192


def train_texts(corpus_dir: str) -> Iterator[str]:
    for doc in read_jsonl_xz(os.path.join(corpus_dir, "train.jsonl.xz")):
        yield doc["text"]


def train_tokenizer(corpus_dir: str, out_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    model_max_length: int = 1024) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(train_texts(corpus_dir), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus supports only {tokenizer.get_vocab_size()} tokens, asked for {vocab_size}")
    save_transformers_tokenizer(tokenizer, out_dir, model_max_length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pellucid.training.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="directory written by pellucid.training.corpus")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--model-max-length", type=int, default=1024)
    args = parser.parse_args(argv)
    train_tokenizer(args.corpus, args.out, args.vocab_size, args.model_max_length)
    print(f"wrote a {args.vocab_size}-token byte-level BPE to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
