"""`pellucid eval ppl | agree`."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pellucid.engine.arg_utils import add_engine_args, engine_kwargs_from_args


def _model(args: argparse.Namespace) -> str:
    from pellucid.default_model import ensure_default_model

    return ensure_default_model() if args.model in (None, "default") else args.model


def _windows(model: str, args: argparse.Namespace, max_model_len: int | None) -> list[list[int]]:
    from pellucid.eval.data import token_windows
    from pellucid.tokenizer import load_tokenizer

    if args.context is None:
        # A window is one request's prompt, which must leave room for the one token it samples.
        limit = max_model_len
        if limit is None:
            with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
                limit = json.load(handle).get("max_position_embeddings")
        if limit is None:
            raise SystemExit("the model config has no max_position_embeddings: pass --context")
        args.context = int(limit) - 1
    return token_windows(load_tokenizer(model), args.data, args.context, args.max_tokens)


def run_ppl(args: argparse.Namespace) -> int:
    from pellucid.eval.harness import engine_perplexity
    from pellucid.llm import LLM

    model = _model(args)
    windows = _windows(model, args, args.max_model_len)
    llm = LLM(model, **engine_kwargs_from_args(args))
    start = time.perf_counter()
    result = engine_perplexity(llm, windows)
    seconds = time.perf_counter() - start
    print(f"perplexity of {model} on {args.data}")
    print(f"  windows x context     {len(windows)} x {args.context} tokens")
    print(f"  tokens scored         {result.tokens}")
    print(f"  mean NLL (nats)       {result.mean_nll:.5f}")
    print(f"  perplexity            {result.perplexity:.4f}")
    print(f"  time                  {seconds:.1f} s")
    if args.json:
        _write_json(args.json, {"model": model, "data": args.data, "context": args.context,
                                "windows": len(windows), "tokens": result.tokens, "mean_nll": result.mean_nll,
                                "perplexity": result.perplexity, "engine_args": engine_kwargs_from_args(args)})
    return 0


def _candidates(args: argparse.Namespace, reference: dict[str, Any]) -> list[dict[str, Any]]:
    """--candidate configurations as given; --head ones take the reference's other arguments (dtype, ...)."""
    candidates = [json.loads(c) for c in args.candidate]
    if args.head:
        body = {k: v for k, v in reference.items() if k not in ("head", "head_options")}
        options = json.loads(args.head_options) if args.head_options else {}
        probes = [int(p) for p in args.probes.split(",")] if args.probes else [None]
        candidates += [{**body, "head": args.head,
                        "head_options": options if p is None else {**options, "probes": p}} for p in probes]
    elif args.probes or args.head_options:
        raise SystemExit("--probes and --head-options need --head")
    if not candidates:
        raise SystemExit("nothing to compare: give --head NAME (with --probes / --head-options) or --candidate JSON")
    for config in candidates:
        if not isinstance(config, dict):
            raise SystemExit(f"a configuration is a JSON object of LLM arguments, got {config!r}")
    return candidates


def run_agree(args: argparse.Namespace) -> int:
    from pellucid.eval.harness import compare_configs

    model = _model(args)
    reference = json.loads(args.reference)
    candidates = _candidates(args, reference)
    windows = _windows(model, args, min((c["max_model_len"] for c in [reference, *candidates] if c.get("max_model_len")),
                                        default=None))
    start = time.perf_counter()
    results = compare_configs(model, windows, reference, candidates)
    seconds = time.perf_counter() - start
    print(f"agreement on {args.data}: {results[0].positions} positions ({len(windows)} windows of "
          f"{args.context} tokens), model {model}, {seconds:.1f} s")
    header = ("configuration", "greedy agree", "target exact", "perplexity", "delta", "delta %")
    rows = [(json.dumps(r.config) + (" (reference)" if i == 0 else ""), f"{r.agreement:.4f}",
             f"{r.target_exact:.4f}", f"{r.perplexity:.4f}", f"{r.delta:+.4f}",
             f"{100 * r.delta / r.reference_perplexity:+.2f}") for i, r in enumerate(results)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    if args.json:
        _write_json(args.json, {"model": model, "data": args.data, "context": args.context,
                                "windows": len(windows), "results": [r.as_dict() for r in results]})
    return 0


def _write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    parser.add_argument("--data", required=True, help="UTF-8 text file")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per window, non-overlapping (default: max_model_len - 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="use only the first windows, up to this many tokens")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pellucid.cli import subcommand_help

    parser = subparsers.add_parser("eval", help=subcommand_help("eval"))
    commands = parser.add_subparsers(dest="eval_command", required=True)

    ppl = commands.add_parser("ppl", help="perplexity of the model on a text file, through the engine",
                              description="Perplexity from the engine's prompt logprobs (always exact logits, "
                                          "whatever --head says; use `eval agree` for an approximate head).")
    _add_common(ppl)
    add_engine_args(ppl)
    ppl.set_defaults(func=run_ppl)

    agree = commands.add_parser(
        "agree", help="greedy agreement and perplexity delta of engine configurations against a reference",
        description="Each configuration is a JSON object of LLM arguments. The engine computes the final hidden "
                    "states; each configuration's LM head is applied to them (see docs/eval.md).")
    _add_common(agree)
    agree.add_argument("--reference", default="{}", help="reference configuration (default {}: the dense head)")
    agree.add_argument("--candidate", action="append", default=[], help="a configuration to compare (repeatable)")
    agree.add_argument("--head", default=None, help="shorthand: a candidate that is the reference with this LM head, "
                                                    "e.g. flashhead")
    agree.add_argument("--head-options", default=None, help="JSON options of --head")
    agree.add_argument("--probes", default=None, help="with --head flashhead: comma-separated probe counts, "
                                                      "one candidate each")
    agree.set_defaults(func=run_agree)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m pellucid.eval.cli ppl|agree ...`: the same subcommands without the rest of the CLI (whose
    server imports need FastAPI and uvicorn)."""
    parser = argparse.ArgumentParser(prog="python -m pellucid.eval.cli")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
