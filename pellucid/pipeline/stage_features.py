"""A pipeline stage's outputs and inputs as request features (pellucid/engine/features.py).

`stage_output` (extras: a StageOutputSpec): the request's rows for the next stages. While some request
carries it, a runner step hook takes the model's `stage_outputs` of each step (the thinker's per-position
hidden states, the talker's frames), copies the carriers' rows to the host and hands them to the
request's ChunkSender per edge; after the step, the rows that are final are cut into chunks, put in the
edge's connector, and noticed in the request's `events["chunks"]` (to_stage, index, final), which the
pipeline relays to the next stage. Rows of "tokens" models are final once fed (positions below the
sequence's last token), rows of "samples" models once the token they go with is fed (HF's stages never
feed a sequence's last token).

`stage_input` (extras: a StageInputSpec): the request's inputs come from the previous stage. The model
makes its state (`make_stage_input`); the pipeline calls the engine utility `stage_input.arrived` with
each notice; chunks are taken from the connector in order and applied, and the request's input_limit
rises with them (the scheduler passes the request over meanwhile, keeping its blocks). A step hook asks
the model for the step's inputs (`stage_step_inputs`) and records the frames the model samples
(`record_frame`) for the positions that feed them back. A chunk that is announced but missing, delivered
twice, or broken fails that request with the reason.

Requests of either feature compute every position themselves (no prefix cache: their positions are
more than token ids), run eagerly (the thinker's capture hooks its forward) and step serially.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pellucid.engine.features import EngineFeature, RequestFeature, register_feature
from pellucid.logger import get_logger
from pellucid.pipeline.chunks import ChunkReceiver, ChunkSender
from pellucid.pipeline.connectors import ChunkKey, ConnectorSpec, Notice, open_connector
from pellucid.runner.cuda_graphs import require_eager_for_extras_key
from pellucid.runner.sampler import host_to_device
from pellucid.runner.step_hooks import StepHook, copy_to_host

logger = get_logger(__name__)

STAGE_OUTPUT_KEY = "stage_output"
STAGE_INPUT_KEY = "stage_input"


@dataclass(frozen=True)
class OutputEdge:
    to_stage: str
    chunk_size: int                 # rows per chunk; 0: everything in one chunk at the end
    connector: ConnectorSpec
    first_chunk_size: int | None = None     # rows of the first chunk (None: chunk_size)


@dataclass(frozen=True)
class StageOutputSpec:
    stage: str                      # this stage's name
    edges: tuple[OutputEdge, ...]


@dataclass(frozen=True)
class StageInputSpec:
    stage: str                      # this stage's name
    from_stage: str
    connector: ConnectorSpec
    params: Any = None              # the model's own (Qwen3-Omni's talker: a TalkerLayout)


class _OutputState:
    def __init__(self, spec: StageOutputSpec, senders: list[ChunkSender]) -> None:
        self.spec = spec
        self.senders = senders


class _InputState:
    def __init__(self, spec: StageInputSpec, receiver: ChunkReceiver, inputs: Any) -> None:
        self.spec = spec
        self.receiver = receiver
        self.inputs = inputs            # the model's state (make_stage_input)


def _check_spec(value: Any, kind: type, params: Any) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"extras must hold a {kind.__name__}, got {type(value).__name__}")
    if params.n != 1:
        raise ValueError(f"a pipeline stage's request runs one sequence (n=1), got n={params.n}")
    if params.stop_strings:
        raise ValueError("stop strings are found after later steps already ran, and a pipeline stage may have "
                         "passed those tokens on: use stop_token_ids in a pipeline")
    return value


# ---- stage_output -----------------------------------------------------------------------------------
class StageOutput(RequestFeature):
    key = STAGE_OUTPUT_KEY

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        return _check_spec(value, StageOutputSpec, params)

    def for_engine(self, engine: Any) -> EngineFeature:
        return EngineStageOutput(engine.runner)


class EngineStageOutput(EngineFeature):
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model = runner.model
        self.hook = _OutputHook(self.model)

    def prepare(self, request: Any) -> None:
        spec = _check_spec(request.extras[STAGE_OUTPUT_KEY], StageOutputSpec, request.sampling_params)
        rows = getattr(self.model, "stage_output_rows", None)
        if rows not in ("tokens", "samples"):
            raise ValueError(f"{type(self.model).__name__} has no output for a next pipeline stage")
        base = request.num_prompt_tokens if rows == "tokens" else 0
        header_fn = getattr(self.model, "stage_header", None)
        header = header_fn() if header_fn is not None else None
        senders = [ChunkSender(request.request_id, spec.stage, edge.to_stage, open_connector(edge.connector),
                               edge.chunk_size, base, header, edge.first_chunk_size) for edge in spec.edges]
        request.extras[STAGE_OUTPUT_KEY] = _OutputState(spec, senders)
        request.read_prefix_cache = False       # every position's rows are computed, and sent
        request.publish_prefix_cache = False

    def set_active(self, active: bool) -> None:
        capture = getattr(self.model, "set_stage_capture", None)
        if capture is not None:
            capture(active)
        if active:
            self.runner.add_step_hook(self.hook)
        else:
            self.runner.remove_step_hook(self.hook)

    def after_step(self, changed: list[Any]) -> None:
        samples = getattr(self.model, "stage_output_rows", "tokens") == "samples"
        for request in changed:
            state = request.extras.get(STAGE_OUTPUT_KEY) if request.extras else None
            if not isinstance(state, _OutputState):
                continue
            status = request.status.value
            if status in ("abort", "error"):
                continue            # the pipeline ends the next stages' requests
            final = request.is_finished
            # Rows of positions fed back (the last token never is): "samples" rows go with output tokens.
            limit = request.num_output_tokens - 1 if samples else request.num_tokens - 1
            notices = []
            for sender in state.senders:
                for key, chunk in sender.release(max(limit, 0), final):
                    sender.connector.put(key, chunk)
                    notices.append([key.to_stage, key.index, chunk.final])
            if notices:
                events = request.events if request.events is not None else {}
                events.setdefault("chunks", []).extend(notices)
                request.events = events

    def after_finish(self, requests: list[Any]) -> None:
        pass        # aborted: the pipeline ends the next stages' requests


class _OutputHook(StepHook):
    """Copies the carriers' rows of each step's stage outputs to the host."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def after_sampling(self, so: Any, batch: Any, hidden: Any, sampled: Any) -> Any:
        samples = self.model.stage_output_rows == "samples"
        carriers = batch.sample_requests if samples else so.requests
        wanted = [(i, r) for i, r in enumerate(carriers) if r.extras and STAGE_OUTPUT_KEY in r.extras]
        if not wanted or (samples and sampled is None):
            return None
        outputs = self.model.stage_outputs(batch, sampled)
        pieces = []         # (request, first row index, row slice in the step's rows)
        if samples:
            for i, request in wanted:
                pieces.append((request, request.num_output_tokens, slice(i, i + 1)))
        else:
            start = 0
            starts = []
            for count in so.num_scheduled_tokens:
                starts.append(start)
                start += count
            for i, request in wanted:
                first = so.num_computed_tokens[i]
                pieces.append((request, first, slice(starts[i], starts[i] + so.num_scheduled_tokens[i])))
        rows = [row for piece in pieces for row in range(piece[2].start, piece[2].stop)]
        # Pinned and queued: a pageable copy would wait for the step's kernels here.
        index = host_to_device(rows, torch.int64, next(iter(outputs.values())).device)
        host = {name: copy_to_host(value.index_select(0, index)) for name, value in outputs.items()}
        return pieces, host

    def after_readback(self, handle: Any) -> None:
        if handle is None:
            return
        pieces, host = handle
        offset = 0
        for request, first, rows in pieces:
            n = rows.stop - rows.start
            payload = {name: value[offset:offset + n] for name, value in host.items()}
            offset += n
            if self.model.stage_output_rows == "tokens":
                ids = request.all_token_ids[first:first + n]
                payload["token_ids"] = torch.tensor(ids, dtype=torch.int64)
            state = request.extras.get(STAGE_OUTPUT_KEY)
            if isinstance(state, _OutputState):
                for sender in state.senders:
                    sender.add(first, payload)


# ---- stage_input ------------------------------------------------------------------------------------
class StageInput(RequestFeature):
    key = STAGE_INPUT_KEY

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        return _check_spec(value, StageInputSpec, params)

    def for_engine(self, engine: Any) -> EngineFeature:
        return EngineStageInput(engine)


class EngineStageInput(EngineFeature):
    def __init__(self, engine: Any) -> None:
        self.runner = engine.runner
        self.model = engine.runner.model
        self.scheduler = engine.scheduler
        # A weak reference: the engine holds its features (see RequestFeature.for_engine).
        self._fail: Callable[[list[str], str], None] = weakref.WeakMethod(engine.fail_requests)  # type: ignore
        self.hook = _InputHook(self.model)

    def prepare(self, request: Any) -> None:
        spec = _check_spec(request.extras[STAGE_INPUT_KEY], StageInputSpec, request.sampling_params)
        make = getattr(self.model, "make_stage_input", None)
        if make is None:
            raise ValueError(f"{type(self.model).__name__} takes no input from a previous pipeline stage")
        inputs = make(spec.params)
        request.extras[STAGE_INPUT_KEY] = _InputState(spec, ChunkReceiver(request.request_id, spec.from_stage,
                                                                           spec.stage), inputs)
        request.input_limit = inputs.input_limit
        request.read_prefix_cache = False
        request.publish_prefix_cache = False

    def set_active(self, active: bool) -> None:
        if active:
            self.runner.add_step_hook(self.hook)
        else:
            self.runner.remove_step_hook(self.hook)

    def utilities(self) -> dict[str, Callable[..., Any]]:
        return {"arrived": self.arrived}

    def arrived(self, request_id: str, from_stage: str, to_stage: str, index: int, final: bool) -> bool:
        """A notice relayed by the pipeline: take the chunk and apply what is now in order. False when the
        request is gone here (its chunk is dropped)."""
        request = self.scheduler.requests.get(request_id)
        state = request.extras.get(STAGE_INPUT_KEY) if request is not None else None
        if not isinstance(state, _InputState):
            return False        # ended here already; the pipeline drops the chunk
        key = ChunkKey(request_id, from_stage, to_stage, index)
        connector = open_connector(state.spec.connector)
        try:
            for chunk in state.receiver.arrived(Notice(key, final), connector):
                state.inputs.apply(chunk.payload, chunk.num_rows)
                if chunk.final:
                    state.inputs.finish()
        except Exception as exc:     # this request's inputs are broken: it fails, the others go on
            message = f"stage {state.spec.stage} input from {from_stage}: {type(exc).__name__}: {exc}"
            logger.error("request %s: %s", request_id, message)
            fail = self._fail()
            if fail is not None:
                fail([request_id], message)
            return False
        limit = state.inputs.input_limit
        if limit != request.input_limit:
            request.input_limit = limit
            self.scheduler.inputs_changed()
        return True


class _InputHook(StepHook):
    """The model's inputs of each step, and the frames it samples (for the positions that feed them back)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def before_forward(self, so: Any, batch: Any) -> dict[str, Any] | None:
        states = []
        for request in so.requests:
            state = request.extras.get(STAGE_INPUT_KEY) if request.extras else None
            if not isinstance(state, _InputState):
                raise RuntimeError(f"request {request.request_id} reached a pipeline stage without its inputs")
            states.append(state.inputs)
        device = batch.input_ids.device
        return self.model.stage_step_inputs(states, so.num_computed_tokens, so.num_scheduled_tokens, device)

    def after_sampling(self, so: Any, batch: Any, hidden: Any, sampled: Any) -> Any:
        codes = getattr(sampled, "extra_token_ids", None) if sampled is not None else None
        if codes is None:
            return None
        return list(batch.sample_requests), copy_to_host(codes)

    def after_readback(self, handle: Any) -> None:
        if handle is None:
            return
        requests, codes = handle
        for request, row in zip(requests, codes.tolist()):
            request.extras[STAGE_INPUT_KEY].inputs.record_frame(request.num_output_tokens, row)


register_feature(StageOutput())
register_feature(StageInput())
require_eager_for_extras_key(STAGE_OUTPUT_KEY)
require_eager_for_extras_key(STAGE_INPUT_KEY)
