"""The speech stage on a GPU, the tiny Qwen3-Omni in float32: the talker speaks what it speaks on
the CPU, and its code predictor (15 passes a frame at the real shapes) only queues work."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from triton_omni.demo_models import resolve_model
from triton_omni.speech.runner import SpeechConfig, SpeechRunner

from tests.support.host_syncs import no_host_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DEMO = "demo:tiny-qwen3-omni"


def spoken(runner: SpeechRunner, sampled: bool) -> list:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEMO))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "a red fox"}], add_generation_prompt=True,
                                           tokenize=False)
    options = {"temperature": 0.9, "seed": 3} if sampled else {"temperature": 0.0}
    request = runner.parse({"text_input": prompt, "reply_ids": [40, 41, 42, 43, 3], "max_tokens": 12,
                            "min_tokens": 12, **options})
    chunks: list = []

    async def speak():
        await runner.speak(request, chunks.append)

    runner.loop.run(speak())
    return chunks


@pytest.fixture(scope="module")
def runners():
    made = {device: SpeechRunner(SpeechConfig(model=DEMO, device=device, dtype="float32"))
            for device in ("cpu", "cuda:0")}
    yield made
    for runner in made.values():
        runner.close()


def test_the_talker_speaks_on_the_gpu_the_codes_it_speaks_on_the_cpu(runners):
    """Greedy, float32: the same codec frames on both devices, and waveforms within 1e-4."""
    cpu, gpu = (spoken(runners[d], sampled=False) for d in ("cpu", "cuda:0"))
    assert [c.codes.tolist() for c in gpu] == [c.codes.tolist() for c in cpu]
    for ours, theirs in zip(gpu, cpu, strict=True):
        assert abs(ours.samples - theirs.samples).max() < 1e-4


@pytest.mark.parametrize("sampled", [False, True])
def test_the_code_predictor_never_waits_for_the_gpu(runners, sampled):
    """One frame's 15 predictor passes and their draws (sampled: top-k, top-p, a generator per
    utterance) queue their work without a host sync; the frame is read once it is whole."""
    gpu = runners["cuda:0"]
    spoken(gpu, sampled)  # warm: the first run's allocations and lazy inits may synchronise
    with no_host_syncs(gpu.batcher, "_predict_residuals") as failures:
        chunks = spoken(gpu, sampled)
    assert not failures, failures[0]
    assert sum(c.codes.shape[1] for c in chunks) == 11  # max_tokens 12: the last code drawn makes no frame
