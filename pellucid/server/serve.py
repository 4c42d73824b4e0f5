"""`pellucid serve MODEL`: the OpenAI-compatible server on uvicorn, with a startup banner and stats log."""
from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from pellucid.config import EngineConfig
from pellucid.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pellucid.engine.core_launch import launch_ahead
from pellucid.logger import get_logger
from pellucid.pooling.config import PoolerConfig
from pellucid.server.reasoning import REASONING_PARSERS
from pellucid.server.tool_calls import TOOL_CALL_PARSERS

logger = get_logger(__name__)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pellucid.cli import subcommand_help

    parser = subparsers.add_parser("serve", help=subcommand_help("serve"))
    parser.add_argument("model", help="HuggingFace-format model directory, or 'default' for the embedded "
                                      "default model (pellucid-debian-13m)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and "
                                                       "/detokenize")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the MODEL argument)")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats log lines (0 disables)")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM before "
                        "they are aborted")
    g.add_argument("--extract-dir", default=None,
                   help="directory where extract_hidden_states requests with output 'server' are written "
                        "(clients never choose a path; without it only output 'inline' is accepted)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": the model decides whether to call tools, and --tool-call-parser "
                        "finds the calls in its answer (\"required\" and named functions need neither flag)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS.names(),
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen, Hermes), mistral "
                        "([TOOL_CALLS]...), llama3_json (a JSON call, Llama 3.1-3.3), pythonic ([f(x=1)], Llama 3.2 "
                        "and 4)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS.names(),
                   help="return a thinking model's <think>...</think> in the chat message's `reasoning` field, apart "
                        "from its content (qwen3: when the answer opens with <think>; deepseek_r1: the template "
                        "opened it in the prompt)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help="how /v1/embeddings pools the final hidden states, over what the model directory's "
                        "sentence-transformers files say (default without them: the last token, normalised): "
                        "'{\"pooling_type\": \"last\" | \"mean\" | \"cls\", \"normalize\": true | false}'")
    g.add_argument("--responses-store-size", type=int, default=0, metavar="N",
                   help="keep the last N /v1/responses results in memory, for GET /v1/responses/{id}, "
                        "previous_response_id and background responses (default 0: none are kept, and such "
                        "requests are refused)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser)
    from pellucid.server.omni_serve import add_pipeline_args
    add_pipeline_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def run_server(args: argparse.Namespace) -> int:
    model = args.model
    if model == "default":
        from pellucid.default_model import DEFAULT_MODEL_NAME, ensure_default_model
        model = ensure_default_model()
        logger.info("serving the embedded default model %s", DEFAULT_MODEL_NAME)
    from pellucid.server.omni_serve import is_pipeline_checkpoint, run_pipeline_server
    if is_pipeline_checkpoint(model):       # a speech model: its stages as a pipeline (docs/pipelines.md)
        return run_pipeline_server(args, model, engine_kwargs_from_args(args))
    if args.pipeline_config is not None or args.chunk_size is not None:
        logger.error("--pipeline-config and --chunk-size are for pipeline checkpoints (Qwen3-Omni); %s is one model",
                     model)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        logger.error("--enable-auto-tool-choice needs --tool-call-parser (%s)", ", ".join(TOOL_CALL_PARSERS.names()))
        return 2
    if args.responses_store_size < 0:
        logger.error("--responses-store-size must be >= 0, got %d", args.responses_store_size)
        return 2
    try:
        PoolerConfig().overridden(args.pooler_config)
    except ValueError as exc:
        logger.error("--pooler-config: %s", exc)
        return 2
    served_name = args.served_model_name or args.model
    config = EngineConfig.from_kwargs(model, served_model_name=served_name, **engine_kwargs_from_args(args))
    # The engine process starts loading the model now, while this process imports torch, transformers and the
    # server (seconds each on some machines).
    launch = launch_ahead(config, asynchronous=True)
    try:
        from pellucid.engine.async_llm import AsyncLLM
        from pellucid.engine.core_client import EngineStartupError
        from pellucid.engine.core_proc import freeze_startup_heap, thaw_startup_heap
        from pellucid.server.app import build_app
    except BaseException:
        if launch is not None:
            launch.abandon()
        raise
    try:
        llm = AsyncLLM.from_config(config, launch)
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return 1
    try:
        log_banner(llm, args)
        app = build_app(llm, served_name, api_key=args.api_key, log_stats_interval=args.log_stats_interval,
                        extract_dir=args.extract_dir, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
                        pooler_config=args.pooler_config, responses_store_size=args.responses_store_size)
        server = _GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                                timeout_graceful_shutdown=args.graceful_shutdown_timeout))
        # An engine that dies has already failed its requests; the server stops taking new ones and exits
        # non-zero (a supervisor restarts it) instead of answering 503 forever.
        llm.on_engine_dead(server.engine_died)
        freeze_startup_heap()
        server.run()
    finally:
        # Whatever uvicorn left running is aborted here, so every KV block is returned before exit.
        llm.shutdown()
        thaw_startup_heap()
    if not server.started:
        logger.error("the server did not start (see the error above)")
        return 1
    if server.engine_death is not None:
        logger.error("server stopped: the engine core died (%s)", server.engine_death)
        return 1
    logger.info("server stopped")
    return 0


def log_banner(llm: Any, args: argparse.Namespace) -> None:
    info = llm.engine_info()
    features = ", ".join(f"{name}={value}" for name, value in info["features"].items())
    logger.info("Pellucid %s serving %r (from %s) on http://%s:%d", info["version"], llm.model_name,
                llm.config.model.model, args.host, args.port)
    logger.info("model: dtype=%s device=%s max_model_len=%d; engine core in process %d", info["dtype"],
                info["device"], llm.max_model_len, info["engine_pid"])
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", info["num_blocks"], info["block_size"],
                info["num_blocks"] * info["block_size"])
    logger.info("features: %s; API key %s", features, "required" if args.api_key else "not required")


class _GracefulServer(uvicorn.Server):
    """uvicorn's Server, minus re-raising the caught signal after shutdown (which would exit non-zero).

    A SIGINT/SIGTERM stops accepting connections, lets in-flight requests finish for up to the
    graceful timeout, then closes the rest (their requests are aborted) and returns normally.
    """

    engine_death: str | None = None

    def engine_died(self, reason: str) -> None:
        self.engine_death = reason
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
        if self._captured_signals:
            logger.info("received %s; shut down gracefully",
                        ", ".join(signal.Signals(s).name for s in self._captured_signals))
