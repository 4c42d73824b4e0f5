"""Start-up of a frontend with its engine in another process: the engine process starts first (for `pellucid
serve`, before the frontend imports torch) and the frontend loads its tokenizer (importing transformers, seconds
on some machines) meanwhile; a start-up that fails or is cut short ends with a clear error and leaves no engine
process behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pellucid.config import EngineConfig
from pellucid.engine.core_client import EngineStartupError, make_client
from pellucid.engine.core_launch import EngineLaunch, launch_ahead
from pellucid.llm import LLM
from tests.processes import engine_children

ENGINE_KWARGS = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3", seed=41)


def test_a_frontend_imports_transformers_only_to_load_its_tokenizer(model_dir):
    """Everything a server does before it starts its engine process (parse the command line, make the config,
    check for a pipeline checkpoint, import the server) leaves transformers unimported, so that its import
    overlaps the engine's start-up. Checked in a fresh interpreter."""
    script = ("import sys\n"
              "from pellucid.cli import build_parser\n"
              "from pellucid.config import EngineConfig\n"
              "from pellucid.server.omni_serve import is_pipeline_checkpoint\n"
              "import pellucid.engine.async_llm, pellucid.llm, pellucid.server.app, pellucid.server.serve\n"
              "build_parser()\n"
              f"assert not is_pipeline_checkpoint({model_dir!r})\n"
              f"EngineConfig.from_kwargs({model_dir!r}, device='cpu')\n"
              "print('transformers imported:', 'transformers' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "transformers imported: False" in run.stdout, run.stdout


def test_serve_starts_its_engine_process_before_it_imports_torch(model_dir):
    """`pellucid serve` parses its flags, makes its config and starts the engine process with nothing heavy
    imported, so the engine's imports and model loading overlap the frontend's. Checked in a fresh interpreter
    on the serve command's own path, up to the launch."""
    script = ("import sys\n"
              "import pellucid.server.serve as serve\n"
              "from pellucid.cli import build_parser\n"
              "class Launched(Exception):\n"
              "    pass\n"
              "def launch_ahead(config, asynchronous):\n"
              "    print('at launch:', sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules),\n"
              "          config.model.model, config.runner.device, asynchronous)\n"
              "    raise Launched\n"
              "serve.launch_ahead = launch_ahead\n"
              f"args = build_parser('serve').parse_args(['serve', {model_dir!r}, '--device', 'cpu'])\n"
              "try:\n"
              "    args.func(args)\n"
              "except Launched:\n"
              "    pass\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"at launch: [] {model_dir} cpu True" in run.stdout, run.stdout


def test_an_engine_process_launched_ahead_is_taken_over_or_stopped(model_dir):
    """A launch the client takes over serves it; one made for another configuration is refused and stopped;
    one abandoned stops at once, loading or not."""
    config = EngineConfig.from_kwargs(model_dir, **ENGINE_KWARGS)
    assert launch_ahead(config, asynchronous=False) is None       # a synchronous frontend's core is in-process
    launch = launch_ahead(config, asynchronous=True)
    assert isinstance(launch, EngineLaunch) and launch.proc.pid in engine_children()
    client = make_client(config, asynchronous=True, launch=launch)
    try:
        assert client.pid == launch.proc.pid and client.info.num_blocks == 64
    finally:
        client.shutdown(timeout=30.0)
    assert launch.proc.pid not in engine_children() and not os.path.exists(launch.dir)

    other = EngineConfig.from_kwargs(model_dir, **ENGINE_KWARGS)
    launch = launch_ahead(config, asynchronous=True)
    with pytest.raises(ValueError, match="another configuration"):
        make_client(other, asynchronous=True, launch=launch)
    assert launch.proc.pid not in engine_children() and not os.path.exists(launch.dir)

    launch = EngineLaunch(config)
    launch.abandon()
    assert launch.proc.returncode is not None and launch.proc.pid not in engine_children()


def test_an_engine_process_still_starting_stops_at_once_when_shut_down(model_dir):
    client = make_client(EngineConfig.from_kwargs(model_dir, engine_process=True, **ENGINE_KWARGS), asynchronous=True,
                         wait=False)
    assert client.pid in engine_children()
    client.shutdown(timeout=30.0)
    assert client.pid not in engine_children()
    with pytest.raises(EngineStartupError, match="shut down before it was ready"):
        client.wait_ready()


def test_an_engine_that_cannot_start_is_reported_before_the_tokenizer(tmp_path):
    """Both fail (no tokenizer, an unknown architecture): the engine's error is the one reported, as when
    the two started one after the other, and its process is gone."""
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}')
    before = engine_children()
    with pytest.raises(EngineStartupError, match="NoSuchForCausalLM"):
        LLM(str(tmp_path), engine_process=True, **ENGINE_KWARGS)
    assert engine_children() == before
