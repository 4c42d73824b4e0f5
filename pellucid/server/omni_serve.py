"""`pellucid serve DIR` on a Qwen3-Omni checkpoint: the speech pipeline (thinker -> talker -> code2wav)
behind the OpenAI-compatible app of omni_app.py."""
from __future__ import annotations

import argparse
from typing import Any

from pellucid.logger import get_logger

logger = get_logger(__name__)


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline (speech models such as Qwen3-Omni)")
    g.add_argument("--pipeline-config", default=None,
                   help="YAML file declaring the pipeline's stages and edges (pellucid/pipeline/graph.py); "
                        "default: Qwen3-Omni's thinker -> talker -> code2wav")
    g.add_argument("--chunk-size", default=None,
                   help="rows per chunk between stages, on every edge (a number, or 'all': stage after stage); "
                        "default: the pipeline's (25)")


def is_pipeline_checkpoint(model_dir: str) -> bool:
    from pellucid.models.config_file import read_config_json
    from pellucid.models.qwen3_omni.configs import ARCHITECTURE

    # Read as plain JSON: through transformers, this check would cost a single model's server the seconds
    # of transformers' import before its engine process starts (core_client.start_engine overlaps them).
    architectures = (read_config_json(model_dir) or {}).get("architectures") or []
    return bool(architectures) and architectures[0] == ARCHITECTURE


def run_pipeline_server(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from pellucid.engine.core_client import EngineStartupError
    from pellucid.pipeline.async_omni import AsyncOmni
    from pellucid.pipeline.graph import PipelineGraph, parse_chunk_size
    from pellucid.server.omni_app import build_omni_app
    from pellucid.server.serve import _GracefulServer

    graph = PipelineGraph.from_yaml(args.pipeline_config) if args.pipeline_config else None
    chunk_size = None
    if args.chunk_size is not None:
        chunk_size = "all" if args.chunk_size == "all" else parse_chunk_size(int(args.chunk_size))
    engine_process = engine_kwargs.pop("engine_process", None)
    engine_process = True if engine_process is None else engine_process
    served_name = args.served_model_name or args.model
    try:
        omni = AsyncOmni(model, graph, engine_process=engine_process, chunk_size=chunk_size,
                         served_model_name=served_name, **engine_kwargs)
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return 1
    try:
        log_pipeline_banner(omni, args)
        app = build_omni_app(omni, served_name, api_key=args.api_key)
        server = _GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                                timeout_graceful_shutdown=args.graceful_shutdown_timeout))
        omni.on_engine_dead(server.engine_died)
        server.run()
    finally:
        omni.shutdown()
    if not server.started:
        logger.error("the server did not start (see the error above)")
        return 1
    if server.engine_death is not None:
        logger.error("server stopped: %s", server.engine_death)
        return 1
    logger.info("server stopped")
    return 0


def log_pipeline_banner(omni: Any, args: argparse.Namespace) -> None:
    import pellucid
    pipeline = omni.pipeline
    logger.info("Pellucid %s serving %r (from %s) as a pipeline on http://%s:%d", pellucid.__version__,
                omni.model_name, omni.model, args.host, args.port)
    for stage in pipeline.graph.order:
        info = pipeline.clients[stage].info
        logger.info("stage %s: %s, dtype=%s device=%s, pid %d; KV cache %d blocks x %d tokens; max_num_seqs=%d",
                    stage, info.architecture, info.dtype, info.device, info.pid, info.num_blocks, info.block_size,
                    info.max_num_seqs)
    for edge in pipeline.graph.edges:
        first = f" (first chunk {edge.first_chunk_size})" if edge.first_chunk_size else ""
        logger.info("edge %s -> %s: %s connector, chunk size %s%s", edge.src, edge.dst, edge.connector,
                    edge.chunk_size or "all", first)
    logger.info("voices: %s; audio %d Hz; API key %s", ", ".join(pipeline.omni.speakers), pipeline.sample_rate,
                "required" if args.api_key else "not required")
