"""The speech pipeline behind the OpenAI-compatible server, driven by the official openai client: text and
decodable WAV audio, streamed and not, equal to the offline pipeline; per-stage metrics, time to first
audio and real-time factor in /metrics; tracing on the thinker; bad requests refused by name. The stages run
in threads of the test's process here; test_serve_omni_process below runs `pellucid serve` for real."""
from __future__ import annotations

import base64
import io
import wave

import httpx
import pytest
import torch

from pellucid.pipeline.async_omni import AsyncOmni
from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.omni import OmniLLM
from pellucid.sampling_params import SamplingParams
from pellucid.server.omni_app import build_omni_app
from tests.server.server_harness import (PELLUCID_CLI, free_port, parse_metric, run_app_in_thread, start_serve_process,
                                         wait_healthy)

openai = pytest.importorskip("openai")

MODEL = "tiny-omni"
ENGINE_KWARGS = dict(device="cpu", num_kv_blocks=256, max_model_len=256)
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
GRAPH = qwen3_omni_graph(3, decode_chunk=6, left_context=3)
# The server's talker samples (transformers' defaults) from the request's seed: the same seed, the same audio.
SEED = 1234


def decode_wav(data: bytes) -> tuple[int, torch.Tensor]:
    with wave.open(io.BytesIO(data)) as f:
        assert (f.getnchannels(), f.getsampwidth()) == (1, 2)
        frames = f.readframes(f.getnframes())
        rate = f.getframerate()
    return rate, torch.frombuffer(bytearray(frames), dtype=torch.int16).float() / 32767.0


@pytest.fixture(scope="module")
def offline(omni_dir):
    """The offline pipeline's answer to the same request (greedy text, the talker as the server samples it)."""
    from pellucid.pipeline.qwen3_omni import default_talker_params
    with OmniLLM(omni_dir, GRAPH, **ENGINE_KWARGS) as omni:
        return omni.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, seed=SEED), voice="ethan",
                         talker_params=default_talker_params(SEED))[0]


@pytest.fixture(scope="module")
def omni_server(omni_dir):
    omni = AsyncOmni(omni_dir, GRAPH, engine_process=False, served_model_name=MODEL, **ENGINE_KWARGS)
    url, server, thread = run_app_in_thread(build_omni_app(omni, MODEL))
    yield url, omni
    server.should_exit = True
    thread.join(30)
    omni.shutdown()


def ask(client, stream: bool, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text", "audio"],
                                          audio={"voice": "ethan", "format": kwargs.pop("format", "wav")},
                                          temperature=0, max_tokens=12, seed=SEED, stream=stream, **kwargs)


def test_openai_client_gets_text_and_wav(omni_server, offline) -> None:
    url, omni = omni_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = ask(client, stream=False)
    message = reply.choices[0].message
    assert message.content is None and message.audio.transcript == offline.text
    rate, audio = decode_wav(base64.b64decode(message.audio.data))
    assert rate == offline.sample_rate == 24000
    assert audio.shape == offline.audio.shape and torch.allclose(audio, offline.audio, atol=1.5 / 32767)
    assert reply.choices[0].finish_reason == offline.finish_reason
    assert reply.usage.completion_tokens == len(offline.token_ids)

    transcript, data, expires = "", b"", None
    for chunk in ask(client, stream=True):
        delta = chunk.choices[0].delta
        if delta.audio is not None:
            transcript += delta.audio.transcript or ""
            data += base64.b64decode(delta.audio.data) if delta.audio.data else b""
            expires = delta.audio.expires_at or expires
    assert transcript == offline.text and expires is not None
    rate, streamed = decode_wav(data[:44] + data[44:])          # a WAV stream: header, then PCM as it came
    assert rate == 24000 and torch.allclose(streamed[:len(audio)], audio, atol=1.5 / 32767)
    assert len(streamed) == len(audio)

    pcm = base64.b64decode(ask(client, stream=False, format="pcm16").choices[0].message.audio.data)
    assert torch.allclose(torch.frombuffer(bytearray(pcm), dtype=torch.int16).float() / 32767.0, audio, atol=1e-6)

    text_only = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    assert text_only.choices[0].message.content == offline.text and text_only.choices[0].message.audio is None

    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert parse_metric(metrics, "pellucid:time_to_first_audio_seconds_count") >= 3
    assert parse_metric(metrics, "pellucid:real_time_factor_count") >= 3
    for stage in ("thinker", "talker", "code2wav"):
        assert f'pellucid:stage_num_requests_running{{model_name="{MODEL}",stage="{stage}"}} 0.0' in metrics
        assert f'stage="{stage}"' in metrics
    assert all(s.num_used_blocks == 0 for s in omni.stats().values())


def test_tracing_runs_on_the_thinker_at_hf_paths(omni_server) -> None:
    url, _ = omni_server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "chelsie", "format": "wav"},
            "interventions": [{"op": "save", "site": "thinker.model.layers.1", "name": "h"}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    assert choice["message"]["audio"]["data"] and "h" in choice["save_positions"]
    body["interventions"] = [{"op": "save", "site": "model.layers.1"}]
    refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "model.layers.1" in refused.json()["error"]["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"modalities": ["text", "audio"]}, "audio", "audio parameter"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio", "ethan"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "mp3"}}, "audio", "wav"),
    ({"modalities": ["audio"], "audio": {"voice": "ethan"}}, "modalities", "['text', 'audio']"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan"}, "stop": ["x"]}, "stop", "stop_token_ids"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan"}, "max_tokens": 1}, "max_tokens",
     "max_tokens must be >= 2"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"prompt_logprobs": 2}, "prompt_logprobs", "speech pipeline"),
])
def test_bad_audio_requests_are_refused_by_name(omni_server, body, param, words) -> None:
    url, _ = omni_server
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_serve_omni_process(omni_dir, offline) -> None:
    """`pellucid serve` on an Omni checkpoint starts the pipeline, each stage in its own process."""
    port = free_port()
    proc = start_serve_process(PELLUCID_CLI, omni_dir, port, "--chunk-size", "3")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=120, interval=0.25)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, modalities=["text", "audio"],
                                               audio={"voice": "ethan", "format": "wav"}, temperature=0,
                                               max_tokens=12, seed=SEED)
        assert reply.choices[0].message.audio.transcript == offline.text
        _, audio = decode_wav(base64.b64decode(reply.choices[0].message.audio.data))
        assert len(audio) > 0
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["pellucid"]["pipeline"] == \
            ["thinker", "talker", "code2wav"]
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "stage talker" in output and "edge thinker -> talker: shm connector, chunk size 3" in output
