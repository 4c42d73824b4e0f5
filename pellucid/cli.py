"""`pellucid generate | serve | bench | extract | flashhead | eval`."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from pellucid.engine.arg_utils import add_engine_args, engine_kwargs_from_args


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (--seed seeds the engine's default generator)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="print each generated token's logprob and this many top alternatives")


def sampling_params_from_args(args: argparse.Namespace):
    from pellucid.sampling_params import SamplingParams
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
                          ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def cmd_generate(args: argparse.Namespace) -> int:
    from pellucid.default_model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SUMMARY, ensure_default_model, is_default_model
    from pellucid.llm import LLM

    model = args.model or ensure_default_model()
    if is_default_model(model):
        print(f"[pellucid] using the embedded default model {DEFAULT_MODEL_NAME}: {DEFAULT_MODEL_SUMMARY}. "
              "Pass --model DIR for another model.", file=sys.stderr)
    llm = LLM(model, **engine_kwargs_from_args(args))
    params = sampling_params_from_args(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=len(args.prompts) > 1)
    for prompt, out in zip(args.prompts, outputs):
        for comp in out.outputs:
            tag = f" [{comp.index}]" if len(out.outputs) > 1 else ""
            print(f"--- prompt: {prompt!r}{tag} ({len(comp.token_ids)} tokens, finish: {comp.finish_reason})")
            print(comp.text)
            if comp.logprobs is not None:
                print_logprobs(comp.token_ids, comp.logprobs)
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
    return 1 if any(o.error for o in outputs) else 0


def print_logprobs(token_ids: list[int], logprobs: list) -> None:
    """One line per generated token: its text, logprob and rank, then the top alternatives."""
    for token_id, position in zip(token_ids, logprobs):
        chosen = position[token_id]
        others = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}"
                           for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank) if tid != token_id)
        print(f"  {chosen.decoded_token!r:>16} logprob {chosen.logprob:8.3f} rank {chosen.rank:>5}   top: {others}")


# Each subcommand: its line in `pellucid --help` and the function that adds its parser. Only the subcommand being
# run has its parser built, so a feature's parser module may import what its commands need, and `pellucid serve`
# starts its engine process before the frontend imports anything heavy (torch included).
SUBCOMMANDS = {
    "generate": ("generate text for one or more prompts", "pellucid.cli:add_generate_parser"),
    "serve": ("serve a model over an OpenAI-compatible HTTP API", "pellucid.server.serve:add_serve_parser"),
    "bench": ("benchmarks: latency, throughput, serve, floors", "pellucid.bench:add_bench_parser"),
    "extract": ("write hidden states of a data set for speculator training", "pellucid.extraction.cli:add_extract_parser"),
    "flashhead": ("build or evaluate a FlashHead clustered LM head", "pellucid.heads.flashhead.cli:add_flashhead_parser"),
    "eval": ("quality: perplexity, and agreement between engine configurations", "pellucid.eval.cli:add_eval_parser"),
}


def subcommand_help(name: str) -> str:
    return SUBCOMMANDS[name][0]


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help=subcommand_help("generate"))
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--model", default=None, help="HuggingFace-format model directory (default: the embedded pellucid-debian-13m)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser, with `command`'s arguments (the others are listed by name and help only)."""
    parser = argparse.ArgumentParser(prog="pellucid", description="Pellucid: LLM inference with open internals.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, adder) in SUBCOMMANDS.items():
        if name == command:
            module, function = adder.split(":")
            getattr(importlib.import_module(module), function)(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(command).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
