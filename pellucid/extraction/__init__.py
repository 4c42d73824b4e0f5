"""Hidden-state extraction for speculator training (EAGLE-3, DFlash, ...): see docs/extraction.md.

`llm.extract_hidden_states(data, layers=[...], output_dir=...)` writes safetensors files plus a
manifest; `HiddenStatesDataset(output_dir)` loads them for training.
"""
from pellucid.extraction.job import ExtractionSummary, extract_hidden_states, extract_hidden_states_async
from pellucid.extraction.reader import HiddenStatesDataset, collate_padded, load_sample, read_job_info
from pellucid.extraction.spec import ExtractionSpec
from pellucid.extraction.writer import ExtractionError, read_manifest

__all__ = ["extract_hidden_states", "extract_hidden_states_async", "ExtractionSummary", "ExtractionError",
           "ExtractionSpec", "HiddenStatesDataset", "collate_padded", "load_sample", "read_job_info", "read_manifest"]
