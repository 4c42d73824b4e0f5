"""`pellucid bench serve` end to end on the CPU: it runs the offline engine and both server variants on the
same requests and prints one row each, every request served with the lengths it asked for."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from pellucid.bench.models import build_word_tokenizer
from pellucid.tokenizer import IncrementalDetokenizer, load_tokenizer
from server_harness import free_port


def test_bench_serve_runs_offline_and_both_servers_on_the_same_requests(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    result = subprocess.run([sys.executable, "-m", "pellucid", "bench", "serve", "--model", model_dir,
                             "--dtype", "float32", "--port", str(free_port()), "--num-requests", "6",
                             "--input-len", "4", "24", "--output-len", "4", "12", "--rates", "inf,50",
                             "--rate-requests", "4", "--server-args", "--device cpu --num-kv-blocks 128"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    table = result.stdout.rsplit("greedy, ignore_eos", 1)[1]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [[cell.strip() for cell in row] for row in rows[1:]]
    assert [row[0] for row in rows] == ["LLM.generate", "serve (process)", "serve (process)", "serve (thread)",
                                        "serve (thread)"]
    for row in rows[1:]:
        assert row[-1] == "0"                                   # no failed request
        assert float(row[3].replace(",", "")) > 0               # output tok/s
        assert re.fullmatch(r"[\d.]+x", row[4])                 # the ratio to the offline run
        # The API server's CPU per token and cores busy (clock ticks of 10 ms: a tiny load may read 0).
        assert float(row[9]) >= 0 and float(row[10]) >= 0
    assert all(row[11] != "-" for row in rows[1:3]) and all(row[11] == "-" for row in rows[3:])


def test_the_benchmark_tokenizer_spells_every_id_at_once():
    out = tempfile.mkdtemp()
    build_word_tokenizer(out, 5000)
    tokenizer = load_tokenizer(out)
    assert len(tokenizer) == 5000
    detok = IncrementalDetokenizer(tokenizer)
    ids = list(range(3, 5000, 7))
    assert all(detok.add(i) for i in ids)                       # every token streams its own text
    assert detok.text.split() == [f"t{i}" for i in ids]
