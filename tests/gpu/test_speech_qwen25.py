"""Qwen2.5-Omni's speech on a GPU, the tiny demo in float32: the transformers engine hands on the
thinker's states the CPU hands on, and the speech stage (its talker's steps and lone prefill replayed
as CUDA graphs, then ``token2wav`` on its thread) speaks the codes and the waveform it speaks on the
CPU, the talker's step queueing its work without waiting for the GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration
from triton_omni.ar.engine_transformers import TransformersEngine
from triton_omni.ar.language_model import language_model
from triton_omni.ar.sampling import ArLimits, SamplingOptions
from triton_omni.demo_models import resolve_model
from triton_omni.speech.runner import SpeechConfig, SpeechRunner

from tests.support.host_syncs import no_host_syncs
from tests.support.qwen25 import thinker_states

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DEMO = "demo:tiny-qwen2.5-omni"
DEVICES = ("cpu", "cuda:0")


@pytest.fixture(scope="module")
def prompt():
    folder = resolve_model(DEMO)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a red fox"}], add_generation_prompt=True,
                                         tokenize=False)
    return text, tokenizer(text)["input_ids"]


def thinker_states_on(device: str, prompt_ids: list[int]) -> torch.Tensor:
    """The states the transformers engine on ``device`` hands on over a greedy reply of 6 tokens."""
    folder = Path(resolve_model(DEMO))
    engine = TransformersEngine(str(language_model(folder, folder)), device, torch.float32, max_num_seqs=2)
    options = SamplingOptions.from_values({"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}, ArLimits())

    async def states():
        return [delta.states async for delta in engine.generate(prompt_ids, options, device, keep_states=True)
                if delta.states is not None]

    try:
        return torch.cat(asyncio.run(states()))
    finally:
        asyncio.run(engine.shutdown())


def test_the_thinker_hands_on_the_states_it_hands_on_on_the_cpu(prompt):
    cpu, gpu = (thinker_states_on(device, prompt[1]) for device in DEVICES)
    assert cpu.shape == gpu.shape and float((cpu - gpu).abs().max()) < 1e-4


REPLY = [40, 41, 42, 43, 3]


@pytest.fixture(scope="module")
def states(prompt):
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(resolve_model(DEMO)).eval()
    return thinker_states(model, torch.tensor([prompt[1]]), REPLY)


def speak(runner: SpeechRunner, prompt, states, chunk_frames: int = 12) -> list:
    """A greedy utterance of 60 codes over the demo's reply: its chunks, every one ``chunk_frames``
    codes (the first too: with 64, nothing is decoded before the talker is done)."""
    text, ids = prompt
    request = runner.parse({"text_input": text, "reply_ids": REPLY, "prompt_ids": ids, "thinker_states": states,
                            "temperature": 0.0, "max_tokens": 60, "min_tokens": 60, "seed": 5,
                            "chunk_frames": chunk_frames, "first_chunk_frames": chunk_frames})
    chunks = []
    runner.loop.run(runner.speak(request, chunks.append))
    return chunks


@pytest.fixture(scope="module")
def runners():
    # cuDNN's convolutions run in TF32 unless told not to: the vocoder's samples would differ from the CPU's
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    made = {device: SpeechRunner(SpeechConfig(model=DEMO, device=device, dtype="float32")) for device in DEVICES}
    yield made
    for runner in made.values():
        runner.close()
    torch.backends.cudnn.allow_tf32 = tf32


def test_the_speech_stage_speaks_on_the_gpu_what_it_speaks_on_the_cpu(prompt, states, runners):
    captured = runners["cuda:0"].batcher.talker_steps  # a dense talker's steps are captured in float32 too
    assert captured is not None and captured.graphs and captured.prefill_graphs
    cpu, gpu = (speak(runners[device], prompt, states) for device in DEVICES)
    assert [c.codes.tolist() for c in gpu] == [c.codes.tolist() for c in cpu] and len(cpu) > 1
    for ours, theirs in zip(gpu, cpu, strict=True):
        assert ours.samples.shape == theirs.samples.shape and abs(ours.samples - theirs.samples).max() < 1e-4


def test_the_talkers_step_never_waits_for_the_gpu(prompt, states, runners):
    """The talker's step (a CUDA graph's replay over the slot cache) queues its work: the host reads
    only the codes drawn from its logits."""
    gpu = runners["cuda:0"]
    speak(gpu, prompt, states)  # warm: the first run's allocations and lazy inits may synchronise
    # one chunk, decoded (and read back) once the talker is done, so that the decoder's read is not the step's
    with no_host_syncs(gpu.batcher, "_talker_forward") as failures:
        chunks = speak(gpu, prompt, states, chunk_frames=64)
    assert not failures, failures[0]
    assert sum(c.codes.shape[-1] for c in chunks) == 60


def test_token2wavs_captured_ode_replays_the_eager_one_without_waiting_for_the_gpu():
    """The ODE of one window and of three together (on the batch of four), replayed from the graphs
    captured at load: the eager ODE's mel within float noise, each replay queued without a host sync;
    another window's codes move it (the comparison can fail)."""
    from triton_omni.speech.token2wav import StreamingToken2Wav

    from tests.support.host_syncs import no_host_syncs

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(resolve_model(DEMO)).eval()
    token2wav = model.token2wav.to("cuda:0").float()
    voices = [(model.speaker_map[v]["cond"].float(), model.speaker_map[v]["ref_mel"].float())
              for v in ("Chelsie", "Ethan")]
    captured, eager = StreamingToken2Wav(token2wav), StreamingToken2Wav(token2wav)
    captured.capture(voices, max_rows=8)
    first, second, steady = captured.window_codes
    assert {(rows, codes) for rows, codes, _ in captured.graphs.graphs} == {
        (rows, codes) for rows in (1, 2, 4, 8) for codes in (first, second, steady)}
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        codes = torch.randint(0, 60, (rows, steady), generator=generator)
        noise = torch.randn(rows, steady * captured.repeats, captured.mel_bins, generator=generator)
        conditioning, reference = (torch.cat([part] * rows) for part in voices[0])
        with no_host_syncs(captured, "mel") as failures:
            mel = captured.mel(codes, noise, conditioning, reference)
        assert not failures, failures[0]
        expected = eager.mel(codes, noise, conditioning, reference)
        torch.testing.assert_close(mel, expected, atol=1e-4, rtol=1e-4)
    moved = captured.mel(torch.roll(codes, 1, dims=1), noise, conditioning, reference)
    assert float((moved - expected).abs().max()) > 1e-2
