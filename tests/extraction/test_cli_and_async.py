"""`pellucid extract` on a JSONL file, and the AsyncLLM job path."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from pellucid.extraction import HiddenStatesDataset, extract_hidden_states_async, read_job_info
from pellucid.extraction.cli import add_extract_parser
from tests.extraction.conftest import TOLERANCE, expected_states, random_prompts, relative_error


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pellucid")
    add_extract_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_extract_with_generate_and_resume(ext_model_dir, hf_reference, tmp_path, capsys):
    prompts = random_prompts(41, [9, 17, 4])
    data = tmp_path / "data.jsonl"
    lines = [{"id": "a", "prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]},
             {"id": "c", "prompt_token_ids": prompts[2]}]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "out"
    argv = ["extract", ext_model_dir("llama"), "--data", str(data), "--layers", "0,-1", "--out", str(out),
            "--generate", "--max-tokens", "5", "--ignore-eos", "--shard-size", "2", "--device", "cpu",
            "--dtype", "float32", "--num-kv-blocks", "128", "--no-progress"]
    assert _run_cli(argv) == 0
    assert "wrote 3 samples" in capsys.readouterr().out
    assert read_job_info(str(out))["generate"]["max_tokens"] == 5
    items = {item["id"]: item for item in HiddenStatesDataset(str(out))}
    assert sorted(items) == ["1", "a", "c"]
    for key, prompt in zip(["a", "1", "c"], prompts):
        item = items[key]
        assert item["input_ids"].shape[0] == len(prompt) + 5 and item["input_ids"][:len(prompt)].tolist() == prompt
        ref = hf_reference("llama", item["input_ids"].tolist())
        assert relative_error(item["hidden_states"], expected_states(ref, [0, -1])) <= TOLERANCE
    assert _run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote 0 samples" in printed and "3 already done" in printed


def test_cli_reports_bad_input(ext_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hello"}\nnot json\n')
    argv = ["extract", ext_model_dir("llama"), "--data", str(data), "--layers", "0", "--out", str(tmp_path / "o"),
            "--device", "cpu", "--num-kv-blocks", "64", "--no-progress"]
    assert _run_cli(argv) == 1
    assert "data.jsonl:2: not valid JSON" in capsys.readouterr().err
    argv[argv.index("--layers") + 1] = "7"
    assert _run_cli(argv) == 1
    assert "layer 7 is out of range" in capsys.readouterr().err


def test_async_llm_job_matches_transformers(ext_model_dir, hf_reference, tmp_path):
    from pellucid.engine.async_llm import AsyncLLM

    llm = AsyncLLM(ext_model_dir("qwen2"), dtype="float32", device="cpu", num_kv_blocks=128,
                   max_num_batched_tokens=16, max_num_seqs=3)
    prompts = random_prompts(51, [21, 6, 30, 13, 9])
    try:
        async def main():
            # An ordinary request runs alongside the job.
            other = asyncio.ensure_future(_drain(llm.generate(prompts[0], _greedy(8))))
            summary = await extract_hidden_states_async(llm, prompts, layers=[1, 2, -1], output_dir=str(tmp_path),
                                                        max_in_flight=3)
            await other
            return summary
        summary = asyncio.run(main())
    finally:
        llm.shutdown()
    assert summary.num_samples == len(prompts)
    for item in HiddenStatesDataset(str(tmp_path)):
        prompt = prompts[int(item["id"])]
        assert item["input_ids"].tolist() == prompt
        ref = hf_reference("qwen2", prompt)
        assert relative_error(item["hidden_states"], expected_states(ref, [1, 2, -1])) <= TOLERANCE


def _greedy(n: int):
    from pellucid import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n)


async def _drain(stream):
    async for _ in stream:
        pass
