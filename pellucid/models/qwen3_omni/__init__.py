"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`) as three stage models, one per engine of the speech
pipeline (pellucid/pipeline), each loading its own part of the checkpoint:

- `thinker` (thinker.py): the mixture-of-experts LLM that writes the text; its text path (text input;
  the audio and image encoders are not implemented). It also hands the talker, per position, its input
  embedding and the hidden state of the layer the talker's config names (`accept_hidden_layer`);
- `talker` (talker.py, code_predictor.py, talker_head.py): the mixture-of-experts LLM that turns the
  thinker's text into codec frames; its head samples a frame's first code and its code predictor the
  frame's other codebooks;
- `code2wav` (code2wav.py): the codec decoder, frames -> waveform, decoded in windows with left context
  as transformers' `chunked_decode` does.

Module paths are transformers' (`thinker.model.layers.3`, `talker.code_predictor.lm_head.0`, ...), so
tracing and extraction sites on the thinker read `thinker.model.layers.3.output`. stage_io.py holds what
flows between the stages and how the talker's inputs are assembled from it.
"""
