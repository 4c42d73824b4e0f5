"""The declared pipeline: YAML as docs/pipelines.md shows it, and the mistakes it refuses by name."""
from __future__ import annotations

import pytest

from pellucid.pipeline.chunks import ALL
from pellucid.pipeline.graph import PipelineGraph, qwen3_omni_graph

YAML = """
stages:
  - {name: thinker, submodel: thinker, emits: [text, hidden], engine_args: {gpu_memory_utilization: 0.7}}
  - {name: talker, submodel: talker, emits: [codes], engine_args: {max_num_seqs: 64}}
  - name: code2wav
    submodel: code2wav
    emits: [audio]
    core: pellucid.pipeline.code2wav_core:Code2WavCore
    params: {chunk_size: 25, left_context: 25, first_chunk_size: 5}
edges:
  - {from: thinker, to: talker, connector: shm, chunk_size: 7, first_chunk_size: 2}
  - {from: talker, to: code2wav, connector: shm, chunk_size: all}
"""


def test_yaml_pipeline(tmp_path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(YAML)
    graph = PipelineGraph.from_yaml(str(path))
    assert graph.order == ("thinker", "talker", "code2wav")
    assert [(e.connector, e.chunk_size, e.first_chunk_size) for e in graph.edges] == [("shm", 7, 2), ("shm", ALL, None)]
    assert graph.stage("talker").engine_args == {"max_num_seqs": 64}
    assert graph.stage("code2wav").params == {"chunk_size": 25, "left_context": 25, "first_chunk_size": 5}
    assert [(e.chunk_size, e.first_chunk_size) for e in graph.with_chunk_size("all").edges] == [(ALL, None)] * 2
    assert graph.with_chunk_size(3).edges[0].first_chunk_size == 2
    small = qwen3_omni_graph(25, first_chunk_size=3, first_decode_chunk=5)
    assert [e.first_chunk_size for e in small.edges] == [3, 5]      # talker -> code2wav: the first window
    assert small.stage("code2wav").params["first_chunk_size"] == 5
    everything = qwen3_omni_graph("all", first_chunk_size=3, first_decode_chunk=5)
    assert [e.first_chunk_size for e in everything.edges] == [None, None]
    assert "first_chunk_size" not in everything.stage("code2wav").params
    assert graph.with_stage_args("talker", num_kv_blocks=8).stage("talker").engine_args == \
        {"max_num_seqs": 64, "num_kv_blocks": 8}
    assert qwen3_omni_graph(3).order == graph.order


@pytest.mark.parametrize("edit,words", [
    (lambda c: c["edges"][0].update(connector="tcp"), "unknown connector 'tcp'"),
    (lambda c: c["edges"][0].update(chunk_size=0), "chunk_size must be a positive number"),
    (lambda c: c["edges"].append({"from": "thinker", "to": "code2wav"}), "two inputs"),
    (lambda c: c["edges"].pop(), "not reached"),
    (lambda c: c["edges"][1].update(to="vocoder"), "no stage 'vocoder'"),
    (lambda c: c["stages"][0].update(emits=["video"]), "known outputs"),
    (lambda c: c["edges"][1].update(first_chunk_size=2), "needs a chunk size"),
    (lambda c: c["edges"][0].update(first_chunk_size="2"), "first_chunk_size must be a positive number"),
])
def test_bad_pipelines_are_refused_by_name(edit, words) -> None:
    import yaml
    config = yaml.safe_load(YAML)
    edit(config)
    with pytest.raises(ValueError, match=words):
        PipelineGraph.from_dict(config)
