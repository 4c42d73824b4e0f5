"""`python -m pellucid ...` is the `pellucid` console script's CLI (pyproject: pellucid.cli:main)."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from pellucid.cli import build_parser, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "COLUMNS": "100", "PYTHONPATH": REPO}


def python_m(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pellucid", *argv], capture_output=True, env=ENV, timeout=300,
                          cwd=os.path.dirname(REPO))
    # Decoded by hand: text mode would turn a generated "\r" into "\n".
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def test_the_console_script_is_pellucid_cli_main():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["pellucid"] == "pellucid.cli:main"


def test_help_and_usage_errors_are_the_clis(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    done = python_m("--help")
    assert done.returncode == 0 and done.stdout == build_parser().format_help()
    assert "generate" in done.stdout and "extract" in done.stdout and "flashhead" in done.stdout
    bad = python_m("generate")
    assert bad.returncode == 2 and "the following arguments are required: prompts" in bad.stderr
    with pytest.raises(SystemExit) as info:
        main(["generate"])
    assert info.value.code == 2


def test_the_parser_of_a_light_subcommand_imports_no_torch():
    """`pellucid --help` and the parsers of every subcommand need no torch (seconds to import on some machines): only
    the subcommand being run has its parser built, and its handler imports what it runs. Checked in a fresh
    interpreter."""
    script = ("import sys\n"
              "from pellucid.cli import build_parser\n"
              "for command in (None, 'generate', 'serve', 'bench', 'eval', 'extract', 'flashhead'):\n"
              "    build_parser(command).format_help()\n"
              "print('imported:', sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "imported: []" in run.stdout, run.stdout


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_prints_what_the_console_script_prints(qwen3_dir, capsys, seed):
    argv = ["generate", "The quick brown fox", "a second prompt", "--model", qwen3_dir, "--device", "cpu",
            "--dtype", "float32", "--max-tokens", "6", "--temperature", "0.9", "--sampling-seed", str(seed),
            "--ignore-eos", "--num-kv-blocks", "64"]
    done = python_m(*argv)
    assert main(argv) == 0
    assert done.returncode == 0, done.stderr
    assert done.stdout == capsys.readouterr().out
    assert done.stdout.count("--- prompt:") == 2 and "(6 tokens, finish: length)" in done.stdout
