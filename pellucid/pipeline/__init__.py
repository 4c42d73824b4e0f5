"""Multi-stage pipelines: several engines, each serving one stage of a model (Qwen3-Omni: thinker ->
talker -> code2wav), streaming chunks of each request to the next stage.

- graph.py: the declared pipeline (stages, their engine arguments and outputs, edges with a connector and
  a chunk size; a chunk size of "all" is stage after stage, on the same code path);
- connectors.py: where chunks wait between stages (in-process, shared memory), keyed by (request id, from
  stage, to stage, chunk index); chunks.py: rows cut into chunks and put back in order;
- stage_features.py: a stage's outputs and inputs as request features of its engine core;
- code2wav_core.py: the engine core of the codec decoder stage (no KV cache: windows of frames);
- pipeline.py: the frontend side: the stages' engines, the relay of chunk notices, request lifecycles
  across stages (aborts and failures reach every stage), metrics;
- omni.py: the offline API (text and waveform), and what the server uses.
"""
