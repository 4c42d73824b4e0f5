"""The frontend of a pipeline: one engine per stage, and every client request's life across them.

A client request becomes one engine request per stage, all with the client's request id, sent at once;
the first stage starts at once, the others when their first chunk arrives (the scheduler passes them
over until then). Chunks go from stage to stage through the edges' connectors; their notices come back
here in the producers' outputs (`events["chunks"]`) and are relayed to the consumers (the engine utility
"stage_input.arrived"), through the connector's `deliver`. The first stage's tokens become text
(detokenized here, as LLM does), the last stage's audio is collected; a request is done when every stage
finished it. A stage that fails or aborts a request ends it in every stage, with that stage's error; an
abort reaches every stage; notices of chunks nobody will read are dropped from the connectors.

`Pipeline` is driven by its owner: OmniLLM (offline: `step()` steps in-process engines in turn, or reads
engine processes' outputs) and the server's AsyncOmni (one task per stage's outputs). It is not
thread-safe: one thread (or event loop) drives it.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from pellucid.config import EngineConfig, resolve_device
from pellucid.engine.core_client import EngineCoreClient, make_client
from pellucid.engine.core_launch import EngineLaunch, launch_ahead
from pellucid.engine.input_processor import InputProcessor
from pellucid.engine.messages import EngineCoreOutput, EngineCoreOutputs
from pellucid.engine.output_processor import OutputProcessor
from pellucid.logger import get_logger
from pellucid.models.config_file import read_config_json
from pellucid.models.loader import read_hf_config
from pellucid.models.qwen3_omni.configs import ARCHITECTURE, OmniConfig
from pellucid.outputs import RequestOutput
from pellucid.pipeline.connectors import ChunkKey, ConnectorSpec, Notice, forget_inproc, open_connector
from pellucid.pipeline.graph import PipelineGraph, qwen3_omni_graph
from pellucid.pipeline.qwen3_omni import SAMPLE_RATE, AudioRequest, Qwen3OmniRequests, check_audio_params
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import load_tokenizer

logger = get_logger(__name__)

ARRIVED = "stage_input.arrived"


@dataclass
class OmniRequestOutput:
    """A client request's progress: its text (the first stage's RequestOutput, cumulative) and its audio."""

    request_id: str
    text: RequestOutput | None
    audio: torch.Tensor                 # float32 samples new since the previous output of this request
    sample_rate: int
    finished: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # The token ids each later stage produced (the talker: each frame's first code), once finished.
    stage_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _Request:
    request_id: str
    arrival: float
    open_stages: set[str] = field(default_factory=set)
    text: RequestOutput | None = None
    new_audio: list[torch.Tensor] = field(default_factory=list)
    num_samples: int = 0
    error: str | None = None
    ending: bool = False                # ended in every stage (failed or aborted): only reports are left
    first_token: float | None = None
    first_audio: float | None = None
    finished: float | None = None
    stage_first: dict[str, float] = field(default_factory=dict)
    stage_tokens: dict[str, list[int]] = field(default_factory=dict)     # each later stage's output ids
    notices: dict[ChunkKey, bool] = field(default_factory=dict)    # announced, not yet read by a consumer


def sizes_kv_cache_from_free_memory(config: EngineConfig) -> bool:
    """Whether an engine built from `config` sizes its KV cache from the GPU memory free when it starts (and so
    depends on what engines started before it on that GPU took), rather than from a fixed block count or the
    CPU's fixed budget."""
    return config.cache.num_kv_blocks is None and resolve_device(config.runner.device).startswith("cuda")


class Pipeline:
    def __init__(self, model: str, graph: PipelineGraph | None = None, *, engine_process: bool = False,
                 asynchronous: bool = False, tokenizer: str | None = None, **engine_kwargs: Any) -> None:
        # config.json as JSON: its Hugging Face config (seconds to import on some machines) is read once the stages'
        # engine processes are importing theirs.
        fields = read_config_json(model)
        if fields is None:
            read_hf_config(model)       # raises, saying why config.json cannot be read
        architecture = (fields.get("architectures") or [""])[0]
        if architecture != ARCHITECTURE:
            raise ValueError(f"{model}: pipelines serve {ARCHITECTURE} checkpoints, this one is {architecture!r}")
        self.graph = graph or qwen3_omni_graph()
        self.sample_rate = SAMPLE_RATE
        name = f"pellucid-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.connectors = {(e.src, e.dst): ConnectorSpec(e.connector, f"{name}-{e.src}") for e in self.graph.edges}
        if engine_process and any(spec.kind == "inproc" for spec in self.connectors.values()):
            raise ValueError("stages in their own processes need a connector between processes: connector='shm'")
        self.clients: dict[str, EngineCoreClient] = {}
        launches: dict[str, EngineLaunch | None] = {}
        try:
            configs = {stage: self._stage_config(stage, model, tokenizer, engine_process, engine_kwargs)
                       for stage in self.graph.order}
            # Every stage's engine process starts now and imports its modules (seconds each), all at once. A stage
            # that sizes its KV cache from free GPU memory builds its engine only once make_client releases it,
            # after the stage before it is ready, so that it counts the memory the earlier ones took. Where no
            # stage does (CPU, or a fixed num_kv_blocks), no stage depends on another, and all build at once.
            launches = {stage: launch_ahead(config, asynchronous, hold=True) for stage, config in configs.items()}
            if not any(sizes_kv_cache_from_free_memory(config) for config in configs.values()):
                for launch in launches.values():
                    if launch is not None:
                        launch.release()
            self.omni = OmniConfig(read_hf_config(model))
            self.requests_builder = Qwen3OmniRequests(self.omni, self.graph, self.connectors)
            self.tokenizer = load_tokenizer(tokenizer or model)
            for stage_name in self.graph.order:
                self.clients[stage_name] = make_client(configs[stage_name], asynchronous, launch=launches[stage_name])
        except BaseException:
            for launch in launches.values():
                if launch is not None:
                    launch.abandon()
            self.shutdown()
            raise
        self.first = self.graph.order[0]
        self.last = self.graph.order[-1]
        info = self.clients[self.first].info
        self.input_processor = InputProcessor(self.tokenizer, info)
        self.output_processor = OutputProcessor(self.tokenizer, info.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self.num_relayed = 0
        self.num_discarded = 0
        self.dead: str | None = None          # why the pipeline cannot serve any more (a stage died)
        self._idle_rounds = 0                 # in-process rounds in a row in which no stage could step
        logger.info("pipeline ready: %s; edges: %s", " -> ".join(self.graph.order),
                    ", ".join(f"{e.src}->{e.dst} ({e.connector}, chunk {e.chunk_size or 'all'})"
                              for e in self.graph.edges))

    def _stage_config(self, stage_name: str, model: str, tokenizer: str | None, engine_process: bool,
                      engine_kwargs: dict[str, Any]) -> EngineConfig:
        stage = self.graph.stage(stage_name)
        common = dict(engine_kwargs)
        if stage_name != self.graph.order[0]:
            # The LM head is the text stage's choice; later stages sample with their model's own.
            common.pop("head", None)
            common.pop("head_options", None)
        args = {**common, **stage.engine_args, "engine_process": engine_process}
        config = EngineConfig.from_kwargs(model, submodel=stage.submodel, tokenizer=tokenizer, **args)
        config.core = stage.core
        return config

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    audio: AudioRequest | None = AudioRequest(), extras: dict[str, Any] | None = None) -> None:
        """Send a request to every stage it needs (only the first without audio). ValueError for a bad request
        (nothing sent)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if audio is not None:
            check_audio_params(params)
            self.requests_builder.check_voice(audio.voice)
        processed = self.input_processor.process(request_id, prompt, params, extras, stream=True)
        self.requests_builder.check_prompt(processed.prompt_token_ids)
        stage_requests = self.requests_builder.stage_requests(request_id, processed.prompt_token_ids,
                                                              processed.engine_requests[0], audio)
        state = _Request(request_id, time.monotonic())
        self.output_processor.add(request_id, processed.prompt, processed.prompt_token_ids, params,
                                  processed.child_ids, True, processed.feature_keys)
        sent = []
        try:
            for stage, engine_request in stage_requests.items():
                self.clients[stage].add_request(engine_request)
                sent.append(stage)
        except BaseException:
            for stage in sent:
                self.clients[stage].finish_requests([request_id])
            self.output_processor.forget(request_id)
            raise
        state.open_stages = set(stage_requests)
        self.requests[request_id] = state

    def abort_request(self, request_id: str) -> None:
        """End a request in every stage (its final output reports finish_reason "abort")."""
        state = self.requests.get(request_id)
        if state is None or state.ending:
            return
        state.ending = True
        for stage in state.open_stages:
            self.clients[stage].finish_requests([request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- what the stages report ----------------------------------------------------------------------
    def process(self, stage: str, outputs: EngineCoreOutputs) -> list[OmniRequestOutput]:
        """Apply one stage's report: relay chunk notices, take text and audio, end what finished."""
        if outputs.engine_error is not None:
            return self._stage_died(stage, outputs.engine_error)
        notices: list[Notice] = []
        touched: dict[str, _Request] = {}
        text_outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for out in outputs.outputs:
            state = self.requests.get(out.request_id)
            events = out.events or {}
            for to_stage, index, final in events.get("chunks", ()):
                key = ChunkKey(out.request_id, stage, to_stage, index)
                if state is None or state.ending:
                    self._discard(key)
                else:
                    state.notices[key] = final
                    notices.append(Notice(key, final))
            if state is None:
                continue
            touched[out.request_id] = state
            state.stage_first.setdefault(stage, now)
            audio = events.get("audio")
            if audio is not None and stage == self.last and len(audio):
                state.new_audio.append(audio)
                state.num_samples += len(audio)
                if state.first_audio is None:
                    state.first_audio = now
            if stage == self.first:
                text_outputs.append(out)
            elif out.new_token_ids:
                state.stage_tokens.setdefault(stage, []).extend(out.new_token_ids)
            if out.finished:
                state.open_stages.discard(stage)
                if out.finish_reason in ("abort", "error") and not state.ending:
                    # A stage ended it on its own (a failure, or its engine aborting it): every stage ends it.
                    state.error = (f"{stage} stage: {out.error}" if out.finish_reason == "error"
                                   else f"the {stage} stage aborted the request")
                    self.abort_request(out.request_id)
        if text_outputs:
            for text in self.output_processor.process(text_outputs)[0]:
                state = self.requests.get(text.request_id)
                if state is not None:
                    state.text = text
                    if state.first_token is None and text.outputs and text.outputs[0].token_ids:
                        state.first_token = now
        self._relay(notices)
        return [self._report(state, now) for state in touched.values()]

    def _relay(self, notices: list[Notice]) -> None:
        by_edge: dict[tuple[str, str], list[Notice]] = {}
        for notice in notices:
            by_edge.setdefault((notice.key.from_stage, notice.key.to_stage), []).append(notice)
        for edge, spec in self.connectors.items():
            connector = open_connector(spec)
            for notice in connector.deliver(by_edge.get(edge, [])):
                key = notice.key
                state = self.requests.get(key.request_id)
                if state is None or state.ending or key.to_stage not in state.open_stages:
                    self._discard(key)
                    continue
                state.notices.pop(key, None)
                self.num_relayed += 1
                future = self.clients[key.to_stage].start_utility(ARRIVED, key.request_id, key.from_stage,
                                                                  key.to_stage, key.index, notice.final)
                future.add_done_callback(lambda f, key=key: self._after_delivery(f, key))

    def _after_delivery(self, future: Any, key: ChunkKey) -> None:
        """(Any thread.) A consumer that no longer had the request read nothing: drop the chunk."""
        try:
            taken = future.result()
        except Exception as exc:
            logger.warning("%s: the %s stage could not take it: %s", key, key.to_stage, exc)
            taken = False
        if not taken:
            self._discard(key)

    def _discard(self, key: ChunkKey) -> None:
        open_connector(self.connectors[(key.from_stage, key.to_stage)]).discard([key])
        self.num_discarded += 1

    def flush_deliveries(self) -> None:
        """Hand over notices a connector is holding back (a delaying connector in tests)."""
        self._relay([])

    def _report(self, state: _Request, now: float) -> OmniRequestOutput:
        audio = torch.cat(state.new_audio) if state.new_audio else torch.zeros(0)
        state.new_audio = []
        done = not state.open_stages
        if done and state.finished is None:
            state.finished = now
            for key in list(state.notices):
                self._discard(key)
            state.notices.clear()
            self.requests.pop(state.request_id, None)
        metrics = self._metrics(state)
        return OmniRequestOutput(state.request_id, state.text, audio, self.sample_rate, done, state.error, metrics,
                                 state.stage_tokens if done else {})

    def _metrics(self, state: _Request) -> dict[str, float]:
        m: dict[str, float] = {"arrival_time": state.arrival}
        if state.first_token is not None:
            m["time_to_first_token"] = state.first_token - state.arrival
        if state.first_audio is not None:
            m["time_to_first_audio"] = state.first_audio - state.arrival
        for stage, t in state.stage_first.items():
            m[f"{stage}_first_output"] = t - state.arrival
        m["audio_seconds"] = state.num_samples / self.sample_rate
        if state.finished is not None:
            m["latency"] = state.finished - state.arrival
            if state.num_samples:
                m["real_time_factor"] = m["latency"] / m["audio_seconds"]
        return m

    def _stage_died(self, stage: str, error: str) -> list[OmniRequestOutput]:
        """A stage's engine is gone: every request fails (the pipeline cannot serve any more)."""
        self.dead = f"the {stage} stage died: {error}"
        now = time.monotonic()
        reports = []
        for state in list(self.requests.values()):
            state.error = state.error or self.dead
            for other in state.open_stages - {stage}:
                self.clients[other].finish_requests([state.request_id])
            state.open_stages.clear()
            state.ending = True
            reports.append(self._report(state, now))
        return reports

    # ---- driving ---------------------------------------------------------------------------------------
    # In-process engines: this many rounds in a row with requests left but no stage able to step is a stall
    # (a request waits for inputs nothing will produce): its requests fail instead of the caller spinning.
    MAX_IDLE_ROUNDS = 1000

    def step(self) -> list[OmniRequestOutput]:
        """In-process engines: one round, each stage's outputs in pipeline order (each stage with work
        steps once). Deliveries held back by a connector are offered again."""
        reports = []
        busy = False
        for stage in self.graph.order:
            client = self.clients[stage]
            if client.holds_work():
                busy = True
                reports += self.process(stage, client.get_outputs())
        self.flush_deliveries()
        self._idle_rounds = 0 if busy or not self.requests else self._idle_rounds + 1
        if self._idle_rounds > self.MAX_IDLE_ROUNDS:
            logger.error("pipeline stalled: requests %s wait for inputs no stage will produce",
                         ", ".join(sorted(self.requests)))
            reports += self._fail_stalled()
        return reports

    def _fail_stalled(self) -> list[OmniRequestOutput]:
        now = time.monotonic()
        reports = []
        for state in list(self.requests.values()):
            state.error = state.error or ("the pipeline stalled: the request waited for a chunk no stage will send "
                                          f"(stages still holding it: {', '.join(sorted(state.open_stages))})")
            for stage in state.open_stages:
                self.clients[stage].finish_requests([state.request_id])
            state.open_stages.clear()
            state.ending = True
            reports.append(self._report(state, now))
        self._idle_rounds = 0
        return reports

    def stats(self) -> dict[str, Any]:
        """Each stage's engine stats (the newest its engine reported)."""
        out = {}
        for stage, client in self.clients.items():
            latest = getattr(client, "latest_stats", None)
            if latest is None:
                try:
                    latest = client.core.stats()
                except RuntimeError:
                    latest = None
            out[stage] = latest
        return out

    def shutdown(self) -> None:
        for client in self.clients.values():
            try:
                client.shutdown()
            except Exception:
                logger.exception("shutting a stage down failed")
        for spec in getattr(self, "connectors", {}).values():
            if spec.kind == "inproc":
                forget_inproc(spec.name)
