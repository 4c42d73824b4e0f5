"""The embedded default model: pellucid-debian-13m, a 13M-parameter Qwen3 trained here.

Its files ship inside the package (pellucid/data/default-model/, installed as package data), so
`pellucid generate "..."` works on a fresh machine with no model hub. The model card beside the weights
(README.md) gives the data, licenses, training command and validation perplexity; pellucid/training/
holds the code that made it. It writes English-like text, which is what demos and tests need; it knows
little and is not a product model. Tests that need other architectures or sizes build random models
with pellucid.tiny_models.
"""
from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "pellucid-debian-13m"
DEFAULT_MODEL_SUMMARY = ("a 13M-parameter Qwen3 trained on English texts that Debian packages ship (King James "
                         "Bible, dictionaries, Python docs); fine for demos and tests, not a product model")
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")


def default_model_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "default-model")


def ensure_default_model() -> str:
    """Directory of the default model; a clear error if the installation lacks its files."""
    path = default_model_dir()
    missing = [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise FileNotFoundError(f"the embedded default model is incomplete in {path} (missing: {', '.join(missing)}); "
                                "reinstall pellucid (its package data holds the model), or pass --model DIR")
    return path


def is_default_model(path: str) -> bool:
    return os.path.abspath(path) == default_model_dir()
