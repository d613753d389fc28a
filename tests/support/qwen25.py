"""Qwen2.5-Omni's talker driven one utterance at a time, as the model's ``generate`` drives it: the
reference a reply the thinker did not write (``/v1/audio/speech``'s ``input``) is held to, the
talker's prompt and the decoder being held to ``generate`` itself in the unit tests. And the
model's processor, for prompts with audio and images (the reference ``ar``'s hearing and seeing are
held to)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    DynamicCache,
    Qwen2_5OmniProcessor,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from triton_omni.speech.qwen25_talker import Qwen25Talker

MARKERS = {"audio_token": "<|AUDIO|>", "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
           "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
           "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


def processor(folder) -> Qwen2_5OmniProcessor:
    """The model's processor, assembled from the checkpoint's parts (the tiny demo saves no processor
    config; its image side is the PIL image processor at the family's defaults, as ``ar`` reads a
    checkpoint that saved only its audio side)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    made = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)  # no video processor without torchvision
    made.tokenizer, made.feature_extractor = tokenizer, WhisperFeatureExtractor.from_pretrained(folder)
    made.image_processor = made.video_processor = Qwen2VLImageProcessorPil()
    for name, token in MARKERS.items():
        setattr(tokenizer, name, token)
        setattr(made, name, token)
    return made


def user_turn(tokenizer, text: str, clips: int, images: int = 0) -> str:
    """The chat template's prompt of one user message: ``clips`` audio parts, ``images`` image parts,
    then ``text``."""
    content = [{"type": "audio"}] * clips + [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def noise(height: int, width: int, seed: int) -> Image.Image:
    """An image of random pixels (the tiny vision tower tells two apart)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def thinker_states(model, ids, reply):
    """What the ar stage's thinker hands on: layer 0's input plus the last layer's state at the prompt
    and every reply token but the last (here from one pass over them)."""
    tokens = torch.tensor([ids[0].tolist() + reply[:-1]])
    with torch.no_grad():
        states = model.thinker(input_ids=tokens, output_hidden_states=True).hidden_states
    return states[0][0] + states[-1][0]


@torch.no_grad()
def greedy_codes(talker: Qwen25Talker, prompt, max_codes: int, min_codes: int = 0) -> list[int]:
    """One utterance through the talker a step at a time, greedy, as generate draws (its end of speech
    held off for ``min_codes``)."""
    model, cache = talker.talker, DynamicCache()
    positions = torch.arange(len(prompt.embeds))[None, None].expand(3, 1, -1)
    hidden = model.model(inputs_embeds=prompt.embeds[None], position_ids=positions, past_key_values=cache,
                         use_cache=True).last_hidden_state
    drawn: list[int] = []
    for step in range(max_codes):
        logits = model.codec_head(hidden[:, -1]).float()[0]
        seen = torch.tensor(sorted(set(prompt.prompt_codes + drawn)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.05, logits[seen] * 1.05)
        logits[talker.suppressed] = float("-inf")
        if step < min_codes:
            logits[talker.stop_ids] = float("-inf")
        code = int(logits.argmax())
        if code in talker.stop_ids:
            break
        drawn.append(code)
        inputs = talker.step_inputs(torch.tensor([code]), prompt.step_state(step)[None])
        position = torch.full((3, 1, 1), len(prompt.embeds) + step)
        hidden = model.model(inputs_embeds=inputs, position_ids=position, past_key_values=cache,
                             use_cache=True).last_hidden_state
    return drawn


def generate_seen(model, inputs: dict, voice: str, **options) -> tuple[list[int], dict, torch.Tensor]:
    """The model's ``generate(return_audio=True)`` on ``inputs`` (the tokenizer's or the processor's),
    with ``options`` (its keywords; a seed is the caller's ``torch.manual_seed``): the reply's ids, what
    it handed its talker (the talker's keywords, and ``codes``: the codes ``token2wav`` decoded), and
    its waveform."""
    seen = {}
    talker_generate, token2wav = model.talker.generate, model.token2wav.forward

    def keep_talker(*args, **kwargs):
        seen.update(kwargs)
        return talker_generate(*args, **kwargs)

    def keep_codes(code, *args, **kwargs):
        seen["codes"] = code[0].tolist()
        return token2wav(code, *args, **kwargs)

    model.talker.generate, model.token2wav.forward = keep_talker, keep_codes
    try:
        with torch.no_grad():
            sequences, wav = model.generate(**inputs, speaker=voice, **options)
    finally:
        del model.talker.generate, model.token2wav.forward
    return sequences[0, inputs["input_ids"].shape[1]:].tolist(), seen, wav.flatten()
