"""`pellucid extract MODEL --data FILE.jsonl --layers 2,18,34 --out DIR [--generate --max-tokens N] [--shard-size K]`.

Each JSONL line is one sample: {"id"?, "prompt"} | {"id"?, "prompt_token_ids"} | {"id"?, "messages"}.
Lines without an id are named by their line index (0-based, blank lines not counted), so resuming
needs the same file. Rerunning the same command resumes: samples in DIR/manifest.jsonl are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator

from pellucid.engine.arg_utils import add_engine_args, engine_kwargs_from_args


def parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers such as 2,18,34 "
                                         f"(-1: final normed output), got {text!r}") from exc


def add_extract_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pellucid.cli import add_sampling_args, subcommand_help

    parser = subparsers.add_parser("extract", help=subcommand_help("extract"),
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HuggingFace-format model directory")
    g = parser.add_argument_group("extraction")
    g.add_argument("--data", required=True, help="JSONL file of samples")
    g.add_argument("--layers", required=True, type=parse_layers,
                   help="decoder layers whose output to save, e.g. 2,18,34 (-1: final normed output)")
    g.add_argument("--out", required=True, help="output directory (created; resumed if it holds a job)")
    g.add_argument("--generate", action="store_true",
                   help="generate a response per sample first; hidden states then cover prompt + response "
                        "(sampling flags below apply; greedy by default)")
    g.add_argument("--shard-size", type=int, default=1, help="samples per safetensors file")
    g.add_argument("--skip-invalid", action="store_true",
                   help="skip samples that cannot be extracted (e.g. longer than max_model_len) instead of stopping")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(func=run_extract)
    return parser


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Records one by one (the file is never loaded whole); ValueError naming the bad line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object, got {type(record).__name__}")
            yield record


def run_extract(args: argparse.Namespace) -> int:
    from pellucid.cli import sampling_params_from_args
    from pellucid.extraction.writer import ExtractionError
    from pellucid.llm import LLM

    try:
        open(args.data, encoding="utf-8").close()
    except OSError as exc:
        print(f"error: cannot read --data {args.data!r}: {exc}", file=sys.stderr)
        return 2
    generate = sampling_params_from_args(args) if args.generate else None
    llm = LLM(args.model, **engine_kwargs_from_args(args))
    try:
        summary = llm.extract_hidden_states(read_jsonl(args.data), layers=args.layers, output_dir=args.out,
                                            generate=generate, shard_size=args.shard_size,
                                            progress=not args.no_progress, skip_invalid=args.skip_invalid)
    except (ExtractionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {summary.num_samples} samples ({summary.num_tokens} tokens) to {summary.output_dir} in "
          f"{summary.elapsed_s:.1f} s: {summary.samples_per_s:.2f} samples/s, {summary.tokens_per_s:.0f} tokens/s; "
          f"{summary.num_already_done} already done" +
          (f"; {len(summary.invalid)} invalid samples skipped" if summary.invalid else ""))
    return 0
