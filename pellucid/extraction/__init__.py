"""Hidden-state extraction for speculator training (EAGLE-3, DFlash, ...): see docs/extraction.md.

`llm.extract_hidden_states(data, layers=[...], output_dir=...)` writes safetensors files plus a
manifest; `HiddenStatesDataset(output_dir)` loads them for training.

The names below load with their modules on first use, so `pellucid extract --help` (whose parser lives in
pellucid.extraction.cli) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "extract_hidden_states": "job", "extract_hidden_states_async": "job", "ExtractionSummary": "job",
    "HiddenStatesDataset": "reader", "collate_padded": "reader", "load_sample": "reader", "read_job_info": "reader",
    "ExtractionSpec": "spec", "ExtractionError": "writer", "read_manifest": "writer",
}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
