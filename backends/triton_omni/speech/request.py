"""A request to the speech stage, checked once: every refusal names its field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from triton_omni.ar.sampling import SamplingOptions
from triton_omni.errors import RequestValidationError
from triton_omni.validation import as_float, as_int, as_int_list, as_optional_int, as_str, in_range, require


@dataclass(frozen=True)
class SpeechLimits:
    """The model's bounds (its parameters)."""

    max_tokens: int = 4096  # codec frames: Qwen3-Omni's 12.5 a second, about 5.5 minutes
    max_prompt_chars: int = 100_000
    max_reply_tokens: int = 8192
    max_chunk_frames: int = 256
    max_position: int = 1 << 24  # a prompt's rotary positions (a thinker's context is far shorter)


@dataclass(frozen=True)
class SpeechRequest:
    prompt: str
    reply_ids: list[int]
    voice: str
    talker: SamplingOptions  # the talker's sampling (temperature 0: greedy, as generate's talker_do_sample=False)
    chunk_frames: int
    first_chunk_frames: int  # the first chunk's: the first audio leaves after these frames
    max_tokens_given: bool = False  # the request's own max_tokens, not the default (which the runner may bound)
    prompt_ids: list[int] | None = None  # the prompt as the thinker read it (its audio widened), else text_input's
    heard: torch.Tensor | None = None  # [audio tokens, thinker width]: the thinker's states at the prompt's audio
    # [prompt + reply tokens - 1, thinker width]: the thinker's states a Qwen2.5-Omni talker reads
    states: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [3, prompt tokens]: a prompt with images, its rotary positions

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: SpeechLimits, voices: dict[str, int], default_voice: str,
                    defaults: dict[str, Any], chunk_frames: int, first_chunk_frames: int) -> SpeechRequest:
        """``chunk_frames``, ``first_chunk_frames``: the model's; a request's ``chunk_frames``
        bounds the model's first chunk too (a request asking for chunks of 3 gets no first of 4)."""
        prompt = as_str("text_input", inputs.get("text_input"))
        require(bool(prompt.strip()), "text_input", "must be the prompt the thinker answered, not empty", prompt)
        require(len(prompt) <= limits.max_prompt_chars, "text_input",
                f"is longer than this model's max_prompt_chars {limits.max_prompt_chars}", f"{len(prompt)} characters")
        reply = as_int_list("reply_ids", inputs.get("reply_ids"))
        require(bool(reply), "reply_ids", "must hold the thinker's reply (at least one token id)", reply)
        require(len(reply) <= limits.max_reply_tokens, "reply_ids",
                f"is longer than this model's max_reply_tokens {limits.max_reply_tokens}", f"{len(reply)} tokens")
        voice = as_str("voice", inputs.get("voice") or default_voice)
        require(voice.lower() in voices, "voice", f"is not one of this model's voices ({', '.join(sorted(voices))})",
                voice)
        talker = _talker_options(inputs, limits, defaults)
        chunk = as_int("chunk_frames", inputs.get("chunk_frames", chunk_frames))
        in_range("chunk_frames", chunk, 1, limits.max_chunk_frames)
        first = as_int("first_chunk_frames", inputs.get("first_chunk_frames", min(first_chunk_frames, chunk)))
        in_range("first_chunk_frames", first, 1, limits.max_chunk_frames)
        prompt_ids = inputs.get("prompt_ids")
        if prompt_ids is not None:
            prompt_ids = as_int_list("prompt_ids", prompt_ids)
            require(bool(prompt_ids), "prompt_ids", "must hold the prompt's token ids", prompt_ids)
        heard = inputs.get("heard_states")
        if heard is not None:
            require(heard.ndim == 2, "heard_states", "must be [audio tokens, the thinker's width]", list(heard.shape))
            require(bool(torch.isfinite(heard).all()), "heard_states", "must be finite", "nan or inf")
            require(prompt_ids is not None, "heard_states", "comes with prompt_ids (the prompt whose audio they are)",
                    list(heard.shape))
        states = inputs.get("thinker_states")
        if states is not None:
            require(states.ndim == 2, "thinker_states", "must be [positions, the thinker's width]",
                    list(states.shape))
            require(bool(torch.isfinite(states).all()), "thinker_states", "must be finite", "nan or inf")
            require(prompt_ids is not None, "thinker_states", "comes with prompt_ids (the prompt they are the "
                    "states of)", list(states.shape))
        positions = inputs.get("prompt_positions")
        if positions is not None:
            require(prompt_ids is not None, "prompt_positions", "comes with prompt_ids (the prompt they number)",
                    list(positions.shape))
            require(list(positions.shape) == [3, len(prompt_ids)], "prompt_positions",
                    f"must be [3, {len(prompt_ids)}]: time, row and column of each of prompt_ids",
                    list(positions.shape))
            require(bool(((positions >= 0) & (positions < limits.max_position)).all()), "prompt_positions",
                    f"must be in [0, {limits.max_position})", "out of range")
        return cls(prompt, reply, voice.lower(), talker, chunk, first, inputs.get("max_tokens") is not None,
                   prompt_ids, heard, states, positions)


def _talker_options(inputs: dict[str, Any], limits: SpeechLimits, defaults: dict[str, Any]) -> SamplingOptions:
    values = {**defaults, **{k: v for k, v in inputs.items() if v is not None}}
    options = SamplingOptions(
        temperature=as_float("temperature", values["temperature"]),
        top_p=as_float("top_p", values["top_p"]),
        top_k=as_int("top_k", values["top_k"]),
        repetition_penalty=as_float("repetition_penalty", values["repetition_penalty"]),
        max_tokens=as_int("max_tokens", values["max_tokens"]),
        min_tokens=as_int("min_tokens", values.get("min_tokens", 0)),
        seed=as_optional_int("seed", values.get("seed")),
    )
    in_range("temperature", options.temperature, 0.0)
    require(0.0 < options.top_p <= 1.0, "top_p", "must be in (0, 1]", options.top_p)
    in_range("top_k", options.top_k, 0)
    require(options.repetition_penalty > 0, "repetition_penalty", "must be above 0", options.repetition_penalty)
    in_range("max_tokens", options.max_tokens, 1, limits.max_tokens)
    in_range("min_tokens", options.min_tokens, 0, options.max_tokens)
    return options


__all__ = ["RequestValidationError", "SpeechLimits", "SpeechRequest"]
