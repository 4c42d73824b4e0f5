"""How a model's hidden states become one embedding: the model's pooler (pooling type, normalisation,
the dimensions it was trained to truncate to) and a request's pooling parameters.

The pooler comes from the model directory the way sentence-transformers lays it out (vLLM reads the
same files): `modules.json` lists the modules after the transformer; a `Pooling` module's `config.json`
names its mode (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and a
`Normalize` module turns L2 normalisation on. A directory without `modules.json` is a causal LM used as an
embedding model: the last token's final-normed hidden state, normalised (vLLM's default for decoder
models). A module this engine cannot run (a Dense projection, max pooling, ...) is refused by name rather
than skipped: skipping it would serve different embeddings from the ones the model was trained to give.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> our pooling types; any other mode that is on is refused.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODULE = "sentence_transformers.models."
_ST_RUNNABLE = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"
    normalize: bool = True
    # Dimensions an embedding may be truncated to (Matryoshka training): None when the model was not
    # trained for it, () when any size up to the hidden size is allowed.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def for_model(cls, model_dir: str, hf_config: Any = None, override: dict[str, Any] | str | None = None
                  ) -> "PoolerConfig":
        """The model's pooler from its directory, then `override` (a dict or its JSON, keys `pooling_type`
        and `normalize`, as vLLM's --pooler-config) on top. ValueError names what cannot be served."""
        config = _from_sentence_transformers(model_dir) or cls()
        config = replace(config, matryoshka_dimensions=_matryoshka(hf_config))
        return config.overridden(override)

    def overridden(self, override: dict[str, Any] | str | None) -> "PoolerConfig":
        if override is None:
            return self
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the pooler config is not valid JSON: {exc}") from exc
        if not isinstance(override, dict):
            raise ValueError(f"the pooler config must be a JSON object, got {override!r}")
        unknown = sorted(set(override) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"the pooler config takes pooling_type and normalize, got {unknown}")
        changes = dict(override)
        if isinstance(changes.get("pooling_type"), str):
            changes["pooling_type"] = changes["pooling_type"].lower()
        return replace(self, **changes)

    def output_size(self, dimensions: int | None, hidden_size: int) -> int:
        """The embedding's length for a request asking for `dimensions` (None: the whole hidden state)."""
        if dimensions is None:
            return hidden_size
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
        if self.matryoshka_dimensions is None:
            raise ValueError("this model was not trained for shorter embeddings (no matryoshka dimensions in its "
                             "config); truncating them would give poor embeddings: leave dimensions unset")
        if dimensions > hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size {hidden_size}, got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of the model's matryoshka dimensions "
                             f"{list(self.matryoshka_dimensions)}, got {dimensions}")
        return dimensions


@dataclass(frozen=True)
class PoolingParams:
    """A request's pooling settings (vLLM's PoolingParams): `dimensions` truncates the embedding (models
    trained for it only), `normalize` overrides the model's normalisation, `truncate_prompt_tokens` keeps
    only the prompt's last tokens."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null, got {self.normalize!r}")
        n = self.truncate_prompt_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {n!r}")


def fit_prompt(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The ids a pooling request runs on: the last `truncate_prompt_tokens` of them, fitting the engine (a
    request computes its prompt and samples one token)."""
    if truncate_prompt_tokens is not None:
        ids = ids[-truncate_prompt_tokens:]
    if len(ids) >= max_model_len:
        raise ValueError(f"the input has {len(ids)} tokens; a pooling input may have at most {max_model_len - 1} "
                         f"(max_model_len - 1): shorten it or set truncate_prompt_tokens")
    return ids


def _from_sentence_transformers(model_dir: str) -> PoolerConfig | None:
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} is not a list of modules")
    kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE) for m in modules if isinstance(m, dict)]
    unsupported = [k for k in kinds if k not in _ST_RUNNABLE]
    if unsupported:
        raise ValueError(f"{modules_file} lists modules this engine does not run: {unsupported} (it runs "
                         f"{', '.join(sorted(_ST_RUNNABLE))}); its embeddings would differ from the model's")
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        raise ValueError(f"{modules_file} has no Pooling module: which hidden state is the embedding is unknown")
    pooling_file = os.path.join(model_dir, str(pooling.get("path", "")), "config.json")
    if not os.path.isfile(pooling_file):
        raise ValueError(f"the Pooling module's config {pooling_file} is missing")
    with open(pooling_file, encoding="utf-8") as f:
        settings = json.load(f)
    on = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ValueError(f"{pooling_file} turns on pooling modes {on}; this engine pools with exactly one of "
                         f"{', '.join(_ST_MODES)}")
    if settings.get("include_prompt") is False:
        raise ValueError(f"{pooling_file} sets include_prompt=false, which this engine does not support")
    return PoolerConfig(_ST_MODES[on[0]], normalize="Normalize" in kinds)


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted(int(d) for d in dims))
    return () if getattr(hf_config, "is_matryoshka", False) else None
