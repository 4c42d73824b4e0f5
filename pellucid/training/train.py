"""Train the default model: `python -m pellucid.training.train --corpus DIR --tokenizer DIR --out DIR`.

A Qwen3-architecture model (transformers' own `Qwen3ForCausalLM`, so the result is what
`save_pretrained` writes) trained with a plain PyTorch loop: bfloat16 autocast over float32 weights,
AdamW, linear warmup then cosine decay, gradient clipping. Batches are windows of the concatenated
train split (documents joined by <|endoftext|>) at offsets drawn from a generator seeded with --seed,
so a rerun with the same arguments sees the same batches. The validation perplexity is measured at the
end on the weights as saved (bfloat16), computed in float32 over non-overlapping windows of --seq-len
tokens of the validation split, and written with everything needed to rerun to DIR/training.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pellucid.training.corpus import END_OF_TEXT, read_jsonl_xz

# 13.4M parameters: 26.8 MB in bfloat16, so the committed model stays under 30 MB with its tokenizer.
MODEL_CONFIG: dict[str, Any] = dict(
    hidden_size=384, intermediate_size=768, num_hidden_layers=8, num_attention_heads=6,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu", attention_dropout=0.0,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def log(message: str) -> None:
    print(message, flush=True)


def tokenize_split(corpus_dir: str, split: str, tokenizer_dir: str, max_docs: int | None = None) -> torch.Tensor:
    """The split's documents in file order, each followed by <|endoftext|>, as one int32 stream."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    end = tokenizer.token_to_id(END_OF_TEXT)
    texts = [doc["text"] for doc in read_jsonl_xz(os.path.join(corpus_dir, f"{split}.jsonl.xz"))][:max_docs]
    pieces = [np.array(encoding.ids + [end], dtype=np.int32)
              for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return torch.from_numpy(np.concatenate(pieces))


def build_model(vocab_size: int, tokenizer_dir: str, seed: int):
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    end, im_end = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id("<|im_end|>")
    config = transformers.Qwen3Config(vocab_size=vocab_size, bos_token_id=None, eos_token_id=[end, im_end],
                                      pad_token_id=end, **MODEL_CONFIG)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=[end, im_end], pad_token_id=end,
                                                            bos_token_id=None)
    return model


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def next_token_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of windows[:, 1:] given windows[:, :-1]."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch_size: int, max_windows: int | None = None) -> float:
    """Mean next-token loss over non-overlapping windows of seq_len tokens (each scored on its own: the
    first token of a window is context only)."""
    count = (stream.numel() // seq_len) if max_windows is None else min(max_windows, stream.numel() // seq_len)
    windows = stream[:count * seq_len].view(count, seq_len).long()
    total, tokens = 0.0, 0
    for start in range(0, count, batch_size):
        batch = windows[start:start + batch_size]
        loss = next_token_loss(model, batch)
        n = batch.shape[0] * (seq_len - 1)
        total += float(loss) * n
        tokens += n
    return total / tokens


def train(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    train_stream = tokenize_split(args.corpus, "train", args.tokenizer, args.max_docs).to(device)
    val_stream = tokenize_split(args.corpus, "val", args.tokenizer).to(device)
    log(f"tokens: train {train_stream.numel():,}, val {val_stream.numel():,} "
        f"({time.time() - started:.1f} s to tokenize)")

    from tokenizers import Tokenizer
    vocab_size = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json")).get_vocab_size()
    model = build_model(vocab_size, args.tokenizer, args.seed).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3, {params:,} parameters, vocab {vocab_size}, device {device}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    history = []
    model.train()
    loop_start = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch_size,), generator=generator)
        windows = train_stream[starts.to(device)[:, None] + offsets].long()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        with autocast:
            loss = next_token_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - loop_start
            tokens = (step + 1) * args.batch_size * args.seq_len
            row = {"step": step, "loss": round(loss.item(), 4), "lr": learning_rate(step, args),
                   "grad_norm": round(float(grad_norm), 3), "elapsed_s": round(elapsed, 1)}
            if args.eval_every and step and step % args.eval_every == 0:
                model.eval()
                with autocast:
                    row["val_loss"] = round(evaluate(model, val_stream, args.seq_len, args.batch_size, 32), 4)
                model.train()
            history.append(row)
            log(f"step {step:5d}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  |g| {row['grad_norm']:.2f}  "
                f"{tokens / max(elapsed, 1e-9):,.0f} tok/s" + (f"  val {row['val_loss']:.4f}" if "val_loss" in row else ""))
    train_seconds = time.time() - loop_start

    # Measure what is committed: weights rounded to bfloat16, computed in float32.
    model.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    model.to(torch.bfloat16).to(torch.float32)
    val_loss = evaluate(model, val_stream, args.seq_len, args.batch_size, args.val_windows)
    record = {
        "command": "python -m pellucid.training.train " + " ".join(sys.argv[1:]) if args.record_argv else None,
        "args": vars(args), "model_config": MODEL_CONFIG, "parameters": params, "vocab_size": vocab_size,
        "train_tokens": train_stream.numel(), "val_tokens": val_stream.numel(),
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "val_loss": val_loss, "val_perplexity": math.exp(val_loss), "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "history": history,
    }
    import transformers
    record["transformers"] = transformers.__version__
    save(model, args, record)
    log(f"val loss {val_loss:.4f}  val perplexity {math.exp(val_loss):.3f}  ({train_seconds:.0f} s training)")
    return record


def save(model, args: argparse.Namespace, record: dict[str, Any]) -> None:
    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    manifest = os.path.join(args.corpus, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest, encoding="utf-8") as handle:
            record["corpus_manifest"] = json.load(handle)
    with open(os.path.join(args.out, "training.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
        handle.write("\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pellucid.training.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="directory written by pellucid.training.corpus")
    parser.add_argument("--tokenizer", required=True, help="directory written by pellucid.training.tokenizer")
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--max-docs", type=int, default=None, help="first N train documents only (smoke tests)")
    parser.add_argument("--val-windows", type=int, default=None,
                        help="score only the first N validation windows (smoke tests; default all)")
    args = parser.parse_args(argv)
    args.record_argv = argv is None
    return args


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
