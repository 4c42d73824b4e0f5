"""A pipeline, declared: its stages and the edges between them (Python or YAML).

```yaml
stages:
  - name: thinker
    submodel: thinker            # which model of the checkpoint this stage's engine serves
    emits: [text, hidden]        # what leaves it: text to the client, hidden states to the next stage
    engine_args: {max_num_seqs: 64, gpu_memory_utilization: 0.5}
  - name: talker
    submodel: talker
    emits: [codes]
    engine_args: {max_num_seqs: 64, gpu_memory_utilization: 0.7}     # cumulative: the thinker's 0.5 counts as used
  - name: code2wav
    submodel: code2wav
    emits: [audio]
    core: pellucid.pipeline.code2wav_core:Code2WavCore     # an engine core that is no LLM
    params: {chunk_size: 25, left_context: 25, first_chunk_size: 5}   # decode windows, in frames
edges:
  - {from: thinker, to: talker, connector: shm, chunk_size: 7, first_chunk_size: 2}
  - {from: talker, to: code2wav, connector: shm, chunk_size: 7}
```

`engine_args` take the engine's vLLM-style names (device, dtype, gpu_memory_utilization, max_num_seqs,
max_model_len, num_kv_blocks, enforce_eager, ...). A chunk size counts the producer's rows (thinker
positions past the prompt, talker frames); `all` sends everything in one chunk when the producer is
done: stage after stage, through the same code path. `first_chunk_size` makes an edge's first chunk
smaller than the steady ones (and code2wav's `first_chunk_size` its first window), so the next stage
starts, and the first audio packet comes, sooner. Each stage takes input from one edge at most, and
the graph is a chain from its first stage (the one the client's prompt goes to).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pellucid.pipeline.chunks import ALL, check_first_chunk_size

EMITS = ("text", "hidden", "codes", "audio")
CONNECTORS = ("inproc", "shm")


@dataclass(frozen=True)
class StageSpec:
    name: str
    submodel: str
    emits: tuple[str, ...]
    engine_args: dict[str, Any] = field(default_factory=dict)
    core: str | None = None                 # "module:Class" of an engine core that is no LLM
    params: dict[str, Any] = field(default_factory=dict)     # the stage's own settings (code2wav windows)


@dataclass(frozen=True)
class EdgeSpec:
    src: str
    dst: str
    connector: str = "inproc"
    chunk_size: int = ALL                   # rows per chunk; ALL (0): one chunk at the end
    first_chunk_size: int | None = None     # rows of the first chunk, if fewer than chunk_size: the next stage starts sooner


@dataclass(frozen=True)
class PipelineGraph:
    stages: tuple[StageSpec, ...]
    edges: tuple[EdgeSpec, ...]
    order: tuple[str, ...] = field(init=False, default=())     # stage names from the first along the chain

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a pipeline needs stages with distinct names, got {names}")
        for stage in self.stages:
            bad = [e for e in stage.emits if e not in EMITS]
            if bad:
                raise ValueError(f"stage {stage.name!r} emits {bad}; known outputs: {', '.join(EMITS)}")
        inputs: dict[str, str] = {}
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if end not in names:
                    raise ValueError(f"edge {edge.src} -> {edge.dst}: no stage {end!r}")
            if edge.connector not in CONNECTORS:
                raise ValueError(f"edge {edge.src} -> {edge.dst}: unknown connector {edge.connector!r}; "
                                 f"known: {', '.join(CONNECTORS)}")
            if edge.chunk_size < 0:
                raise ValueError(f"edge {edge.src} -> {edge.dst}: chunk_size must be >= 1 or 'all'")
            try:
                check_first_chunk_size(edge.first_chunk_size, edge.chunk_size)
            except ValueError as exc:
                raise ValueError(f"edge {edge.src} -> {edge.dst}: {exc}") from None
            if edge.dst in inputs:
                raise ValueError(f"stage {edge.dst!r} has two inputs ({inputs[edge.dst]}, {edge.src}); one at most")
            inputs[edge.dst] = edge.src
        # A chain from the first stage: every other stage is fed, and following the edges visits each once.
        order = [names[0]]
        while True:
            nxt = [e.dst for e in self.edges if e.src == order[-1]]
            if not nxt:
                break
            if len(nxt) > 1 or nxt[0] in order:
                raise ValueError(f"the pipeline must be a chain from {names[0]!r}; stage {order[-1]!r} feeds {nxt}")
            order.append(nxt[0])
        if sorted(order) != sorted(names):
            raise ValueError(f"stages {sorted(set(names) - set(order))} are not reached from {names[0]!r}")
        object.__setattr__(self, "order", tuple(order))

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"the pipeline has no stage {name!r}; its stages: {', '.join(self.order)}")

    def edge_into(self, name: str) -> EdgeSpec | None:
        return next((e for e in self.edges if e.dst == name), None)

    def edges_from(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.src == name]

    @property
    def first(self) -> StageSpec:
        return self.stage(self.order[0])

    @property
    def last(self) -> StageSpec:
        return self.stage(self.order[-1])

    def with_chunk_size(self, chunk_size: int | str) -> "PipelineGraph":
        """The same pipeline with every edge's chunk size set (`"all"`: stage after stage, with no first chunk
        sizes; otherwise an edge keeps its first chunk size)."""
        size = parse_chunk_size(chunk_size)
        return dataclasses.replace(self, edges=tuple(
            dataclasses.replace(e, chunk_size=size, first_chunk_size=None if size == ALL else e.first_chunk_size)
            for e in self.edges))

    def with_connector(self, connector: str) -> "PipelineGraph":
        return dataclasses.replace(self, edges=tuple(dataclasses.replace(e, connector=connector) for e in self.edges))

    def with_engine_args(self, **engine_args: Any) -> "PipelineGraph":
        """Every stage's engine arguments, updated (its own keep precedence for keys it sets itself)."""
        return dataclasses.replace(self, stages=tuple(
            dataclasses.replace(s, engine_args={**engine_args, **s.engine_args}) for s in self.stages))

    def with_stage_args(self, stage: str, **engine_args: Any) -> "PipelineGraph":
        """One stage's engine arguments, updated."""
        self.stage(stage)       # StopIteration -> a clear error below
        return dataclasses.replace(self, stages=tuple(
            dataclasses.replace(s, engine_args={**s.engine_args, **engine_args}) if s.name == stage else s
            for s in self.stages))

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "PipelineGraph":
        try:
            stages = tuple(StageSpec(name=s["name"], submodel=s.get("submodel", s["name"]),
                                     emits=tuple(s.get("emits", ())), engine_args=dict(s.get("engine_args") or {}),
                                     core=s.get("core"), params=dict(s.get("params") or {}))
                           for s in config["stages"])
            edges = tuple(EdgeSpec(src=e["from"], dst=e["to"], connector=e.get("connector", "inproc"),
                                   chunk_size=parse_chunk_size(e.get("chunk_size", "all")),
                                   first_chunk_size=e.get("first_chunk_size"))
                          for e in config.get("edges", ()))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad pipeline config: {type(exc).__name__}: {exc}") from exc
        return cls(stages, edges)

    @classmethod
    def from_yaml(cls, path: str) -> "PipelineGraph":
        import yaml
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(yaml.safe_load(f))


def parse_chunk_size(value: int | str) -> int:
    if value == "all":
        return ALL
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or 'all', got {value!r}")
    return value


def qwen3_omni_graph(chunk_size: int | str = 25, connector: str = "inproc", decode_chunk: int = 25,
                     left_context: int = 25, first_chunk_size: int | None = None,
                     first_decode_chunk: int | None = None) -> PipelineGraph:
    """Qwen3-Omni's three stages. `chunk_size` on both edges (thinker positions, talker frames; "all" for
    stage after stage); code2wav decodes windows of `decode_chunk` frames with `left_context` frames before
    each (transformers' generate: chunked_decode with 300 and 25). `first_chunk_size`: the thinker -> talker
    edge's first chunk (the talker starts after that many thinker tokens); `first_decode_chunk`: code2wav's
    first window, and the talker -> code2wav edge's first chunk with it (a window cannot be decoded before
    its frames arrive: a larger first chunk would hold it back). With "all" both are unused."""
    size = parse_chunk_size(chunk_size)
    windows: dict[str, Any] = {"chunk_size": decode_chunk, "left_context": left_context}
    streaming = size != ALL
    if first_decode_chunk is not None and streaming:
        windows["first_chunk_size"] = first_decode_chunk
    return PipelineGraph(
        stages=(StageSpec("thinker", "thinker", ("text", "hidden")),
                StageSpec("talker", "talker", ("codes",)),
                StageSpec("code2wav", "code2wav", ("audio",), core="pellucid.pipeline.code2wav_core:Code2WavCore",
                          params=windows)),
        edges=(EdgeSpec("thinker", "talker", connector, size, first_chunk_size if streaming else None),
               EdgeSpec("talker", "code2wav", connector, size, first_decode_chunk if streaming else None)))
