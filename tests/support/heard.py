"""Audio a thinker hears, and the model's own answer to it: the reference that ``ar``'s replies to
prompts with ``input_audio`` are held to.

The reference is transformers' own path: ``Qwen3OmniMoeProcessor`` (its feature extractor, and its
audio markers widened to each clip's tokens) and the whole model's ``thinker.generate`` with the
features. The processor is assembled from the checkpoint's parts (the tiny demo saves no processor
config; its image side is the PIL image processor, which audio-only prompts never call)."""

from __future__ import annotations

import functools
import io
import wave

import numpy as np
import torch
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
    WhisperFeatureExtractor,
)
from triton_omni.demo_models import resolve_model

DEMO = "demo:tiny-qwen3-omni"
MARKERS = {"audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
           "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
           "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}


def tone(seconds: float, hertz: float, seed: int = 0, rate: int = 16000) -> np.ndarray:
    """A tone with noise, mono float32 in [-1, 1]."""
    n = int(rate * seconds)
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.3 * np.sin(np.arange(n) * 2 * np.pi * hertz / rate) + 0.05 * noise).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV file of ``samples`` (``[n]``, or ``[n, channels]`` interleaved)."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return out.getvalue()


def as_heard(samples: np.ndarray) -> np.ndarray:
    """What a 16-bit WAV of ``samples`` decodes to (the reference's input)."""
    return (np.clip(np.round(samples * 32767), -32768, 32767) / 32768).astype(np.float32)


@functools.cache
def model():
    folder = resolve_model(DEMO)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Qwen3OmniMoeProcessor.__new__(Qwen3OmniMoeProcessor)  # no video processor without torchvision
    processor.tokenizer, processor.feature_extractor = tokenizer, WhisperFeatureExtractor.from_pretrained(folder)
    # its image processor: the model's vision grid (16-pixel patches, 2 x 2 merged)
    processor.image_processor = processor.video_processor = Qwen2VLImageProcessorPil(patch_size=16)
    for name, token in MARKERS.items():
        setattr(tokenizer, name, token)
        setattr(processor, name, token)
    return tokenizer, processor, Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()


def prompt(question: str, clips: int) -> str:
    """The chat template's prompt of one user message: ``clips`` audio parts, then ``question``."""
    tokenizer, _, _ = model()
    content = [{"type": "audio"}] * clips + [{"type": "text", "text": question}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def reference(text: str, clips: list[np.ndarray], max_tokens: int) -> list[int]:
    """The thinker's greedy reply to ``text`` with ``clips``, as transformers generates it: its token ids."""
    _, processor, omni = model()
    inputs = processor(text=text, audio=clips, return_tensors="pt")
    with torch.inference_mode():
        out = omni.thinker.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def spoken_reference(text: str, clips: list[np.ndarray], thinker_tokens: int, talker_tokens: int,
                     voice: str = "ethan") -> tuple[list[int], np.ndarray, np.ndarray]:
    """The whole model's ``generate(..., return_audio=True)`` for ``text`` with ``clips`` (through the
    processor), greedy in the thinker and the talker: the reply's ids, its codec frames, its waveform."""
    return generate_spoken(model()[1](text=text, audio=clips, return_tensors="pt"), thinker_tokens, talker_tokens,
                           voice)


def generate_spoken(inputs, thinker_tokens: int, talker_tokens: int,
                    voice: str = "ethan") -> tuple[list[int], np.ndarray, np.ndarray]:
    """The whole model's ``generate(..., return_audio=True)`` on ``inputs`` (the tokenizer's or the
    processor's), greedy in the thinker and the talker (the talker held to ``talker_tokens`` frames):
    the reply's ids, its codec frames (as they go to its decoder), its waveform."""
    tokenizer, _, omni = model()
    codes = {}
    decode = omni.code2wav.chunked_decode

    def keep(frames, **options):
        codes["frames"] = frames[0].numpy()
        return decode(frames, **options)

    omni.code2wav.chunked_decode = keep
    try:
        with torch.inference_mode():
            ids, wav = omni.generate(**inputs, speaker=voice, thinker_max_new_tokens=thinker_tokens,
                                     thinker_do_sample=False, talker_do_sample=False,
                                     thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                     talker_max_new_tokens=talker_tokens, talker_min_new_tokens=talker_tokens)
    finally:
        omni.code2wav.chunked_decode = decode
    return ids[0, inputs["input_ids"].shape[1]:].tolist(), codes["frames"], wav.flatten().numpy()


def thinker_states(text: str, clips: list[np.ndarray], layer: int) -> torch.Tensor:
    """The whole model's thinker's hidden states of ``layer`` at the prompt's audio tokens."""
    _, processor, omni = model()
    inputs = processor(text=text, audio=clips, return_tensors="pt")
    with torch.inference_mode():
        out = omni.thinker(**inputs, output_hidden_states=True)
    return out.hidden_states[layer][0, inputs["input_ids"][0] == omni.config.thinker_config.audio_token_id]
