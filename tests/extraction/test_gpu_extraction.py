"""Extraction on the GPU: the side-stream copy to pinned memory (staging.py) and a whole job against
transformers. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from pellucid.extraction import HiddenStatesDataset
from pellucid.extraction.staging import HostStager
from tests.extraction.conftest import expected_states, random_prompts, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staging_copies_exactly_without_a_sync(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    chunk = torch.randn(300, 3, 64, device="cuda", generator=g).to(torch.bfloat16)
    # Columns as finalize hands them out: views into a chunk shared with other samples, and a fresh tensor.
    columns = [chunk[17:217, 0], chunk[17:217, 2], torch.randn(200, 64, device="cuda", generator=g).to(torch.bfloat16)]
    want = torch.stack(columns, dim=1).cpu()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")     # the step loop must not wait for the copy
    try:
        staged = HostStager().stage(columns)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # The engine drops its references and reuses the memory at once: the copy must still read the old values.
    del columns, chunk
    for _ in range(4):
        torch.full((300, 3, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    staged.wait()
    assert staged.hidden_states.is_pinned()
    assert torch.equal(staged.hidden_states, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_job_matches_transformers(ext_model_dir, hf_reference, tmp_path, seed):
    from pellucid import LLM

    prompts = random_prompts(seed + 40, [5 + 13 * i for i in range(8)])
    layers = [0, 2, -1]
    # A token budget below the longest prompt forces chunked prefill.
    llm = LLM(ext_model_dir("llama"), dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_batched_tokens=64, max_model_len=256)
    llm.extract_hidden_states(prompts, layers=layers, output_dir=str(tmp_path), progress=False)
    items = {item["id"]: item for item in HiddenStatesDataset(str(tmp_path))}
    assert sorted(items) == sorted(str(i) for i in range(len(prompts)))
    for i, prompt in enumerate(prompts):
        item = items[str(i)]
        assert item["input_ids"].tolist() == prompt
        want = expected_states(hf_reference("llama", prompt), layers)
        # GPU float32 kernels (cuBLAS, Triton attention) against CPU float32: a wrong row would be ~1 off.
        assert relative_error(item["hidden_states"], want) <= 1e-3
