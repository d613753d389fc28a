"""The tiny Qwen3-Omni demo (``demo:tiny-qwen3-omni``, built locally): its own ``generate`` makes
text and a 24 kHz waveform, the same twice for the same inputs, and another prompt, voice or seed
each moves the waveform far past what a parity check of the served speech will allow (the built
demo's changes measured 0.69 to 0.84 of full scale at their peak; this holds them above 0.1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.speech.demos import CODE_GROUPS, VOICES

PROMPT = "a red fox"


@pytest.fixture(scope="module")
def demo():
    folder = resolve_model("demo:tiny-qwen3-omni")
    return AutoTokenizer.from_pretrained(folder), Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()


def speak(demo, prompt: str = PROMPT, voice: str = VOICES[0], seed: int | None = None) -> tuple[str, torch.Tensor]:
    """The reply's text and waveform from the model's own generate: greedy, or sampled from ``seed``."""
    tokenizer, model = demo
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = tokenizer(text, return_tensors="pt")
    torch.manual_seed(seed or 0)
    ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=8, thinker_do_sample=False,
                              thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                              talker_max_new_tokens=12, talker_min_new_tokens=3, talker_do_sample=seed is not None)
    return tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:]), wav.flatten()


def apart(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(len(a), len(b))
    return float((a[:n] - b[:n]).abs().max()) if len(a) == len(b) else float("inf")


def test_the_demo_speaks_the_same_twice_and_each_input_moves_its_waveform(demo):
    text, wav = speak(demo)
    assert text and wav.dtype == torch.float32 and 0.05 < float(wav.abs().max()) <= 1.0
    assert demo[1].config.talker_config.num_code_groups == CODE_GROUPS
    again = speak(demo)
    assert again[0] == text and torch.equal(again[1], wav)
    moved = {"prompt": apart(wav, speak(demo, "a small boat on a calm lake")[1]),
             "voice": apart(wav, speak(demo, voice=VOICES[1])[1]),
             "seed": apart(speak(demo, seed=1)[1], speak(demo, seed=2)[1])}
    assert all(peak > 0.1 for peak in moved.values()), moved
