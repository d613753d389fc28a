"""Qwen3-Omni's ``code2wav`` decoded as the talker's codec frames arrive, every
sample equal to the whole utterance's decode.

``code2wav`` is a transformer over the frames (causal, a sliding window)
followed by causal convolutions that upsample each frame to 1920 samples. Both
parts are causal, so the decode of the first ``n`` frames is the start of the
whole decode: it only lacks the last few samples, which the final transposed
convolutions drop at an utterance's end. The model's own ``chunked_decode``
does not use that (each chunk is decoded as an utterance of its own, so small
chunks come out short and everything after the first is shifted), so this
module decodes a stream its own way:

- the transformer runs on the new frames only, with its KV cache;
- the convolutions run on the new frames' states behind a few frames of the
  states before them (their receptive field, measured once at load), and the
  samples that window makes past the ones already sent are the next chunk.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import DynamicCache

# frames of random states the convolutions' receptive field is measured on at load
_PROBE_FRAMES = 48


class StreamingCode2Wav:
    """The decoder, and how much context a chunk needs (shared by every stream)."""

    def __init__(self, code2wav: torch.nn.Module):
        self.model = code2wav
        self.samples_per_frame = int(code2wav.total_upsample)
        self.lookback = self._measure_lookback()

    def stream(self) -> Code2WavStream:
        return Code2WavStream(self)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole utterance at once: ``codes`` [groups, frames] to samples [n] (the reference)."""
        return self.model(codes[None].to(self.model.device))[0, 0]

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        model = self.model
        return model.code_embedding(codes[None].to(model.device) + model.code_offset).mean(1)

    def convolve(self, states: torch.Tensor) -> torch.Tensor:
        """The convolutions after the transformer: states [1, frames, width] to samples [n]."""
        hidden = states.permute(0, 2, 1)
        for blocks in self.model.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.model.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)[0, 0]

    @torch.inference_mode()
    def _measure_lookback(self) -> int:
        """Frames of earlier states a window needs before the first sample it sends: the
        convolutions' receptive field, measured as the last sample of a window started
        mid-utterance that differs from the whole decode's, plus a frame of margin."""
        model = self.model
        generator = torch.Generator(device="cpu").manual_seed(0)
        states = torch.randn(1, _PROBE_FRAMES, model.config.hidden_size, generator=generator)
        states = states.to(model.device, model.dtype)
        whole = self.convolve(states)
        start = _PROBE_FRAMES // 2
        window = self.convolve(states[:, start:])
        offset = start * self.samples_per_frame
        apart = (window - whole[offset:offset + len(window)]).abs() > 1e-4 * float(whole.abs().max())
        last_apart = int(apart.nonzero().max()) if apart.any() else -1
        return math.ceil((last_apart + 1) / self.samples_per_frame) + 1


class Code2WavStream:
    """One utterance: ``add`` each batch of frames as the talker makes them; what the
    last ``add`` returns ends the utterance (nothing waits for a frame yet to come)."""

    def __init__(self, decoder: StreamingCode2Wav):
        self.decoder = decoder
        self.cache = DynamicCache(config=decoder.model.pre_transformer.config)
        self.states: torch.Tensor | None = None  # the transformer's states, from frame `first_state` on
        self.first_state = 0
        self.sent = 0  # samples handed out

    @torch.inference_mode()
    def add(self, codes: torch.Tensor) -> torch.Tensor:
        """The samples the new frames (``codes`` [groups, n]) settle: every sample the
        whole decode of the frames so far makes, past those already sent."""
        new = self.decoder.model.pre_transformer(inputs_embeds=self.decoder.embed(codes), past_key_values=self.cache,
                                                 use_cache=True).last_hidden_state
        self.states = new if self.states is None else torch.cat([self.states, new], dim=1)
        per_frame = self.decoder.samples_per_frame
        first = max(0, self.sent // per_frame - self.decoder.lookback)  # the window's first frame
        self.states = self.states[:, first - self.first_state:]  # earlier states no window reads again
        self.first_state = first
        chunk = self.decoder.convolve(self.states)[self.sent - first * per_frame:]
        self.sent += len(chunk)
        return chunk
