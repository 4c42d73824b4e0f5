"""The Qwen3-Omni pipeline in one process (three in-process engines): the same outputs whatever the chunk
size and whatever order chunk deliveries come in, aborts and failures that end a request in every stage
and free what it held there, and the other requests untouched. Against transformers: test_omni_vs_hf.py."""
from __future__ import annotations

import pytest
import torch

import pellucid.pipeline.pipeline as pipeline_module
from pellucid.config import EngineConfig
from pellucid.engine.core_client import EngineStartupError, make_client
from pellucid.engine.core_launch import EngineLaunch
from pellucid.pipeline.connectors import ChunkKey, open_connector
from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.omni import OmniLLM, OmniOutput
from pellucid.pipeline.pipeline import sizes_kv_cache_from_free_memory
from pellucid.pipeline.qwen3_omni import AudioRequest
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import apply_chat_template
from tests.pipeline.doubles import DroppingDelivery, LosingConnector, ShuffledDelivery, install
from tests.processes import engine_children

TEXT = SamplingParams(temperature=0, max_tokens=14)
# Greedy, with transformers' default repetition penalty; some requests end at the talker's EOS, others by length.
TALKER = SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=24)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you today?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Tell me about the old clock in the hall."}],
    [{"role": "user", "content": "The weather is cold."}],
]
VOICES = ["ethan", "chelsie", "ethan"]


def make_omni(omni_dir: str, chunk_size: int | str, first_chunk_size: int | None = None, **kwargs) -> OmniLLM:
    # Small decode windows, so a short utterance spans several of them.
    graph = qwen3_omni_graph(chunk_size, decode_chunk=5, left_context=3, first_chunk_size=first_chunk_size)
    return OmniLLM(omni_dir, graph, device="cpu", max_model_len=256, num_kv_blocks=256, **kwargs)


def run(omni: OmniLLM, params: list[SamplingParams] | None = None) -> dict[str, OmniOutput]:
    prompts = [apply_chat_template(omni.tokenizer, c) for c in CONVERSATIONS]
    for i, (prompt, voice) in enumerate(zip(prompts, VOICES)):
        omni.add_request(f"r{i}", prompt, (params or [TEXT] * 3)[i], AudioRequest(voice, TALKER))
    done = {}
    while omni.has_unfinished_requests():
        for out in omni.step():
            done[out.request_id] = out
    return done


# code2wav batches the windows of whichever requests have one ready: batch shapes differ from run to run,
# and float32 rounding with them (measured ~1e-6). Tokens and every frame's codes are exact.
AUDIO_TOLERANCE = 1e-5


def assert_same(a: OmniOutput, b: OmniOutput) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.token_ids == b.token_ids
    assert a.stage_token_ids == b.stage_token_ids
    assert len(a.audio) == len(b.audio) > 0
    assert torch.allclose(a.audio, b.audio, rtol=0, atol=AUDIO_TOLERANCE), (a.audio - b.audio).abs().max()


def assert_everything_freed(omni: OmniLLM) -> None:
    for stage, stats in omni.stats().items():
        assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0), stage
    for spec in omni.pipeline.connectors.values():
        assert len(open_connector(spec)) == 0, "chunks left behind"


@pytest.fixture(scope="module")
def reference(omni_dir) -> dict[str, OmniOutput]:
    """Stage after stage: each stage gets everything in one chunk once the previous one is done."""
    with make_omni(omni_dir, "all") as omni:
        outputs = run(omni)
        assert_everything_freed(omni)
    talker_ends = [len(o.stage_token_ids["talker"]) < TALKER.max_tokens for o in outputs.values()]
    assert any(talker_ends) or not all(talker_ends)
    return outputs


@pytest.mark.parametrize("chunk_size,first_chunk_size", [(1, None), (7, None), (7, 1)])
def test_async_chunks_equal_stage_after_stage(omni_dir, reference, chunk_size: int, first_chunk_size: int | None
                                              ) -> None:
    with make_omni(omni_dir, chunk_size, first_chunk_size) as omni:
        outputs = run(omni)
        assert_everything_freed(omni)
        relayed = omni.pipeline.num_relayed
    for rid, ref in reference.items():
        assert_same(outputs[rid], ref)
    # Streaming really streamed: audio came before the talker finished, and many chunks went through.
    assert relayed > 20 if chunk_size == 1 else relayed > 6
    first_audio = [o.metrics["time_to_first_audio"] for o in outputs.values()]
    assert all(t < o.metrics["latency"] for t, o in zip(first_audio, outputs.values()))


def test_stages_in_threads_equal_stage_after_stage(omni_dir, reference) -> None:
    """Each stage's engine in a thread of its own, stepping by itself (the GPU's way to share one device)."""
    with make_omni(omni_dir, 2, first_chunk_size=1, stage_threads=True) as omni:
        outputs = run(omni)
        assert_everything_freed(omni)
        threads = {type(client).__name__ for client in omni.pipeline.clients.values()}
    assert threads == {"ThreadedClient"}
    for rid, ref in reference.items():
        assert_same(outputs[rid], ref)


def test_stages_in_threads_keep_requests_independent(omni_dir, reference) -> None:
    """With each engine in its own thread: a lost chunk fails its request only, an abort mid-utterance
    ends that request in every stage, and the third request is untouched; everything is freed."""
    with make_omni(omni_dir, 1, stage_threads=True) as omni:
        install(omni.pipeline, lambda real: LosingConnector(real, {ChunkKey("r1", "thinker", "talker", 2)}))
        prompts = [apply_chat_template(omni.tokenizer, c) for c in CONVERSATIONS]
        for i, (prompt, voice) in enumerate(zip(prompts, VOICES)):
            omni.add_request(f"r{i}", prompt, TEXT, AudioRequest(voice, TALKER))
        done: dict[str, OmniOutput] = {}
        aborted = False
        while omni.has_unfinished_requests():
            for out in omni.step():
                done[out.request_id] = out
            # r0 is cut off once it has spoken (its audio so far is held in OmniLLM until it ends)
            if not aborted and omni._audio.get("r0"):
                omni.abort_request("r0")
                aborted = True
        assert_everything_freed(omni)
    assert aborted and done["r0"].error is None and 0 < len(done["r0"].audio) < len(reference["r0"].audio)
    assert done["r1"].error is not None and "chunk 2" in done["r1"].error, done["r1"].error
    assert_same(done["r2"], reference["r2"])


def record_releases(monkeypatch) -> list[int]:
    """How many stage processes had been sent their settings when each make_client call of the pipeline began."""
    released: list[EngineLaunch] = []
    seen: list[int] = []
    release = EngineLaunch.release

    def recording_release(launch: EngineLaunch) -> None:
        if launch not in released:
            released.append(launch)
        release(launch)

    def recording_make_client(*args, **kwargs):
        seen.append(len(released))
        return make_client(*args, **kwargs)
    monkeypatch.setattr(EngineLaunch, "release", recording_release)
    monkeypatch.setattr(pipeline_module, "make_client", recording_make_client)
    return seen


def test_stages_in_engine_processes_equal_stage_after_stage(omni_dir, reference, monkeypatch) -> None:
    """Each stage's engine in a process of its own (the server's way): with fixed KV pools no stage waits for
    another, so all three processes build their engines at once; the outputs are the one-process pipeline's."""
    seen = record_releases(monkeypatch)
    before = engine_children()      # another test's engine (a session fixture's) may share this worker
    with make_omni(omni_dir, 2, first_chunk_size=1, engine_process=True) as omni:
        assert seen == [3, 3, 3]
        outputs = run(omni)
        for stage, stats in omni.stats().items():
            assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0), stage
        pids = [client.pid for client in omni.pipeline.clients.values()]
    assert len(set(pids)) == 3 and engine_children() == before
    for rid, ref in reference.items():
        assert_same(outputs[rid], ref)


@pytest.mark.parametrize("sized_from_free_memory", [False, True])
def test_a_stage_that_cannot_start_stops_every_stage_process(omni_dir, monkeypatch, sized_from_free_memory: bool
                                                             ) -> None:
    """The talker's engine cannot start (a KV pool too small for one sequence): the error is its own, and every
    other stage process exits: the thinker, already running, and code2wav, building (fixed KV pools: all stages
    build at once) or still waiting for its settings (stages that size their KV caches from free GPU memory,
    simulated here, build one after another)."""
    monkeypatch.setattr(pipeline_module, "sizes_kv_cache_from_free_memory", lambda config: sized_from_free_memory)
    seen = record_releases(monkeypatch)
    before = engine_children()
    graph = qwen3_omni_graph(2).with_stage_args("talker", num_kv_blocks=1)
    with pytest.raises(EngineStartupError, match="at least 2 blocks"):
        OmniLLM(omni_dir, graph, engine_process=True, device="cpu", max_model_len=256, num_kv_blocks=64)
    assert seen == ([0, 1] if sized_from_free_memory else [3, 3])
    assert engine_children() == before


def test_only_stages_on_a_gpu_without_a_fixed_kv_pool_wait_for_the_stages_before_them(monkeypatch) -> None:
    assert not sizes_kv_cache_from_free_memory(EngineConfig.from_kwargs("m", device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sizes_kv_cache_from_free_memory(EngineConfig.from_kwargs("m", device="cuda"))
    assert sizes_kv_cache_from_free_memory(EngineConfig.from_kwargs("m", device="auto"))
    assert not sizes_kv_cache_from_free_memory(EngineConfig.from_kwargs("m", device="cuda", num_kv_blocks=512))


def test_stage_threads_and_engine_processes_exclude_each_other(omni_dir) -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        OmniLLM(omni_dir, engine_process=True, stage_threads=True, device="cpu")


@pytest.mark.parametrize("seed", [0, 1])
def test_delayed_reordered_deliveries_give_identical_outputs(omni_dir, reference, seed: int) -> None:
    with make_omni(omni_dir, 1) as omni:
        doubles = install(omni.pipeline, lambda real: ShuffledDelivery(real, seed))
        outputs = run(omni)
        assert not omni.has_unfinished_requests()
    assert sum(d.num_reordered for d in doubles) > 5       # deliveries really came out of order
    for rid, ref in reference.items():
        assert_same(outputs[rid], ref)


def test_abort_mid_utterance_frees_every_stage(omni_dir, reference) -> None:
    with make_omni(omni_dir, 1) as omni:
        pipeline = omni.pipeline
        prompts = [apply_chat_template(omni.tokenizer, c) for c in CONVERSATIONS[:2]]
        for i, prompt in enumerate(prompts):
            omni.add_request(f"r{i}", prompt, TEXT, AudioRequest(VOICES[i], TALKER))
        audio: dict[str, list[torch.Tensor]] = {"r0": [], "r1": []}
        finals = {}
        pipeline.step()      # the thinker prefilled; the talker and code2wav wait for chunks without steps
        assert not pipeline.clients["talker"].core.has_unfinished_requests()
        assert not pipeline.clients["code2wav"].core.has_unfinished_requests()
        assert pipeline.clients["talker"].core.scheduler.num_waiting == 2

        def step() -> None:
            for report in pipeline.step():
                audio[report.request_id].append(report.audio)
                if report.finished:
                    finals[report.request_id] = report

        while not any(len(a) for a in audio["r0"]):
            step()      # until r0 speaks: the talker and code2wav hold it
        assert {"talker", "code2wav"} <= pipeline.requests["r0"].open_stages
        omni.abort_request("r0")
        while omni.has_unfinished_requests():
            step()
        assert finals["r0"].error is None and len(torch.cat(audio["r0"])) < len(reference["r0"].audio)
        r1 = finals["r1"]
        assert r1.error is None and list(r1.text.outputs[0].token_ids) == reference["r1"].token_ids
        assert r1.stage_token_ids == reference["r1"].stage_token_ids
        assert torch.allclose(torch.cat(audio["r1"]), reference["r1"].audio, rtol=0, atol=AUDIO_TOLERANCE)
        assert_everything_freed(omni)
        for stage, client in pipeline.clients.items():
            assert client.core.stats().num_aborted == 1, stage


def test_lost_chunk_fails_its_request_only(omni_dir, reference) -> None:
    with make_omni(omni_dir, 1) as omni:
        lost = ChunkKey("r1", "thinker", "talker", 2)
        install(omni.pipeline, lambda real: LosingConnector(real, {lost}))
        outputs = run(omni)
        assert_everything_freed(omni)
    failed = outputs["r1"]
    assert failed.error is not None and "talker" in failed.error and "chunk 2" in failed.error, failed.error
    assert "not in the connector" in failed.error
    for rid in ("r0", "r2"):
        assert_same(outputs[rid], reference[rid])


def test_a_notice_never_delivered_is_an_error_not_a_hang(omni_dir) -> None:
    """A request whose next chunk is never announced fails with an error naming where it waits; the
    others finish."""
    with make_omni(omni_dir, 1) as omni:
        install(omni.pipeline, lambda real: DroppingDelivery(real, {ChunkKey("r0", "talker", "code2wav", 1)}))
        outputs = run(omni)
        assert_everything_freed(omni)
    assert "stalled" in outputs["r0"].error and "code2wav" in outputs["r0"].error
    assert outputs["r1"].error is None and outputs["r2"].error is None


def test_the_end_of_text_is_not_shown(omni_dir) -> None:
    """A text that ends at the thinker's EOS does not show it, even with special tokens kept (as LLM does)."""
    with make_omni(omni_dir, 7) as omni:
        eos = sorted(omni.pipeline.clients[omni.pipeline.first].info.eos_token_ids)[0]
        prompt = apply_chat_template(omni.tokenizer, CONVERSATIONS[0])
        params = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[eos], skip_special_tokens=False)
        omni.add_request("eos", prompt, params, None)
        done = {}
        while omni.has_unfinished_requests():
            for out in omni.step():
                done[out.request_id] = out
        out = done["eos"]
        assert out.error is None and out.token_ids == [eos] and out.finish_reason == "stop"
        assert out.text == ""
        assert_everything_freed(omni)
