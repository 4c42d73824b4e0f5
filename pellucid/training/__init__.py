"""Reproducible training of Pellucid's embedded default model.

Three steps, each a module that can be run with `python -m`:

- `pellucid.training.corpus`: a corpus of freely licensed English text from Debian packages, split into
  train and validation deterministically and cached compressed.
- `pellucid.training.tokenizer`: a byte-level BPE trained on the corpus's train split.
- `pellucid.training.train`: a Qwen3-architecture model trained with a plain PyTorch loop.

The model card, pellucid/data/default-model/README.md, records the commands that produced the committed
model; BENCHMARKS.md the device run.
"""
