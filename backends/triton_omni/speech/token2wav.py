"""Qwen2.5-Omni's ``token2wav`` decoded as codes arrive: its DiT's mel a block at a time, then its vocoder.

``token2wav`` is a DiT sampled with an ODE (10 time points, 36 passes of the DiT, guided) from noise
to a mel spectrogram, two mel frames a code, then a BigVGAN vocoder to 24 kHz samples. Its
attention is block-wise (a block: ``block_size`` mel frames, 12 codes), each layer seeing its own
block and, in a few layers, the one before or after; chained over 36 passes that reach, in
principle, the whole utterance, but in practice a frame's mel depends on codes a block or two away
only (``benchmarks/records/research/qwen25_token2wav_chunks.py``: with blocks of context either
side, the whole decode's mel within float noise; with none, or a window off the block boundaries,
far from it). So a stream decodes each block once ``context_blocks`` more have arrived after it,
from a window that starts on a block boundary ``context_blocks`` before it, with the noise the
whole decode would give those frames (drawn from the stream's generator in order, a code's frames
at a time: the same numbers as one draw for the whole). The vocoder's convolutions reach a
measured number of mel frames either side (``vocoder_reach``): a frame's samples leave once that
many frames after it are there, decoded from a window that reaches as far back.

``Token2WavDecoder`` runs the streams' decodes on a thread of their own, one chunk at a time,
beside the talker's steps.
"""

from __future__ import annotations

import math
import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

# frames of random mel the vocoder's reach is measured on at load
_PROBE_FRAMES = 96


class StreamingToken2Wav:
    """The decoder, and how far each of its parts reaches (shared by every stream)."""

    def __init__(self, token2wav: torch.nn.Module, context_blocks: int = 2, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        """``token2wav``: a ``Qwen2_5OmniToken2WavModel`` (float32, as the model's ``generate`` runs
        it); the other arguments are ``generate``'s for it, ``context_blocks`` the DiT's context a
        block is decoded with either side."""
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.repeats = self.dit.repeats  # mel frames a code
        self.block_codes = self.dit.block_size // self.repeats
        self.context_blocks = context_blocks
        self.num_steps, self.guidance_scale, self.sway_coefficient = num_steps, guidance_scale, sway_coefficient
        self.mel_bins = self.dit.mel_dim
        self.samples_per_frame = math.prod(self.vocoder.config.upsample_rates)
        self.samples_per_code = self.repeats * self.samples_per_frame
        self.lags = True  # a code's samples leave once the context after it has come (the runner reads it)
        self.vocoder_reach = self._measure_vocoder_reach()

    def stream(self, conditioning: torch.Tensor, reference_mel: torch.Tensor,
               generator: torch.Generator | None = None) -> Token2WavStream:
        """One utterance in a voice (its ``cond`` [1, C] and ``ref_mel`` [1, T, mel_bins]); its noise
        from ``generator`` (a CPU one: a CUDA generator's numbers depend on how they are drawn)."""
        return Token2WavStream(self, conditioning, reference_mel, generator)

    @torch.inference_mode()
    def mel(self, codes: torch.Tensor, noise: torch.Tensor, conditioning: torch.Tensor,
            reference_mel: torch.Tensor) -> torch.Tensor:
        """The DiT's ``sample`` for ``codes`` [1, n] from the given ``noise`` [1, repeats n, mel_bins]
        (``sample`` draws its own): the mel [1, mel_bins, repeats n]."""
        device = next(self.dit.parameters()).device
        codes, noise = codes.to(device), noise.to(device)
        frames = codes.shape[1] * self.repeats
        speaker = conditioning.to(device).unsqueeze(1).repeat(1, frames, 1)
        reference_mel = reference_mel.to(device)

        def velocity(time_step, states):
            guided, null = self.dit(hidden_states=states, quantized_code=codes, speaker_embedding=speaker,
                                    condition_vector=reference_mel, time_step=time_step, apply_cfg=True).chunk(2)
            return guided + (guided - null) * self.guidance_scale

        times = torch.linspace(0, 1, self.num_steps, device=device, dtype=speaker.dtype)
        times += self.sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1].permute(0, 2, 1)

    @torch.inference_mode()
    def samples(self, mel: torch.Tensor) -> torch.Tensor:
        """The vocoder on ``mel`` [1, mel_bins, frames]: float32 samples [frames x samples_per_frame]."""
        return self.vocoder(mel.to(next(self.vocoder.parameters()).device)).reshape(-1)

    @torch.inference_mode()
    def _measure_vocoder_reach(self) -> int:
        """Mel frames the vocoder's samples for a frame depend on either side: the farthest frame
        from a window's edges whose samples differ from the whole decode's, plus one of margin."""
        generator = torch.Generator().manual_seed(0)
        mel = torch.randn(1, self.mel_bins, _PROBE_FRAMES, generator=generator) - 4.0
        mel = mel.to(next(self.vocoder.parameters()).device)
        whole = self.samples(mel)
        start, end = _PROBE_FRAMES // 4, 3 * _PROBE_FRAMES // 4
        window = self.samples(mel[..., start:end])
        per = self.samples_per_frame
        apart = (window - whole[start * per:end * per]).abs() > 1e-4 * float(whole.abs().max())
        half, where = len(window) // 2, apart.nonzero()[:, 0]
        left = math.ceil((int(where[where < half].max()) + 1) / per) if (where < half).any() else 0
        right = math.ceil((len(window) - int(where[where >= half].min())) / per) if (where >= half).any() else 0
        return max(left, right) + 1


class Token2WavStream:
    """One utterance: ``add`` each batch of codes as the talker makes them (``final`` on the last):
    what the whole decode of every code makes, in order, as soon as enough context has come."""

    def __init__(self, decoder: StreamingToken2Wav, conditioning: torch.Tensor, reference_mel: torch.Tensor,
                 generator: torch.Generator | None):
        self.decoder = decoder
        self.conditioning, self.reference_mel = conditioning, reference_mel
        self.generator = generator
        self.codes: list[int] = []
        self.noise = torch.empty(1, 0, decoder.mel_bins)
        self.mel = torch.empty(1, decoder.mel_bins, 0)  # the mel of every code decoded so far
        self.sent_frames = 0  # mel frames whose samples have left

    def add(self, codes: list[int], final: bool = False) -> torch.Tensor:
        """Float32 samples: those of every mel frame settled by now and not sent yet."""
        decoder = self.decoder
        self.codes.extend(codes)
        if codes:
            self.noise = torch.cat([self.noise, torch.randn(1, len(codes) * decoder.repeats, decoder.mel_bins,
                                                            generator=self.generator)], dim=1)
        self._decode_blocks(final)
        return self._vocode(final)

    def _decode_blocks(self, final: bool) -> None:
        """The mel of every block whose context after it is there (all of them at the end)."""
        decoder = self.decoder
        block, context = decoder.block_codes, decoder.context_blocks
        done_codes = self.mel.shape[2] // decoder.repeats
        ready = len(self.codes) if final else (len(self.codes) // block - context) * block
        if ready <= done_codes:
            return
        first = max(0, done_codes - context * block)  # on a block boundary: done_codes is one
        end = len(self.codes) if final else min(len(self.codes), ready + context * block)
        noise = self.noise[:, first * decoder.repeats:end * decoder.repeats]
        mel = decoder.mel(torch.tensor([self.codes[first:end]]), noise, self.conditioning, self.reference_mel)
        new = mel[..., (done_codes - first) * decoder.repeats:(ready - first) * decoder.repeats]
        self.mel = torch.cat([self.mel, new.cpu()], dim=2)

    def _vocode(self, final: bool) -> torch.Tensor:
        """The samples of the mel frames whose vocoder reach after them is there (all at the end)."""
        decoder = self.decoder
        frames, reach = self.mel.shape[2], decoder.vocoder_reach
        ready = frames if final else frames - reach
        if ready <= self.sent_frames:
            return torch.zeros(0)
        first = max(0, self.sent_frames - reach)
        end = frames if final else min(frames, ready + reach)
        samples = decoder.samples(self.mel[..., first:end]).cpu()
        per = decoder.samples_per_frame
        new = samples[(self.sent_frames - first) * per:(ready - first) * per]
        self.sent_frames = ready
        return new


class Token2WavDecoder:
    """The speech stage's decoder thread for ``token2wav`` streams (``Code2WavBatcher``'s interface):
    each chunk decoded in turn, on a daemon thread of its own (a stub's exit never waits for it).
    (One stream's blocks at a time: its DiT's passes over several streams' windows together are not
    batched yet, and ``urgent`` chunks go in turn.)"""

    warmed_shapes: tuple = ()  # nothing planned at load

    def __init__(self, decoder: StreamingToken2Wav):
        self.decoder = decoder
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="omni-token2wav", daemon=True)
        self._thread.start()

    def decode(self, stream: Token2WavStream, codes: torch.Tensor, urgent: bool = False,
               final: bool = False) -> Future:
        """The samples ``codes`` ([1, n]) settle in ``stream`` (all it holds, ``final``), float32."""
        future: Future = Future()
        if self._stopped:
            future.set_exception(RuntimeError("the speech stage's decoder is shutting down"))
        else:
            self._jobs.put((stream, codes, final, future))
        return future

    def stop(self, timeout_s: float = 30) -> None:
        """Decode what is queued, fail what comes after, and wait for the thread (``timeout_s`` at most)."""
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            stream, codes, final, future = job
            if not future.set_running_or_notify_cancel():  # its caller left
                continue
            try:
                future.set_result(stream.add(codes[0].tolist(), final).numpy().astype(np.float32))
            except Exception as exc:  # this stream hears of it; the thread decodes on
                future.set_exception(exc)
        while True:  # queued as stop() came (decode() fails the later ones itself)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[3].set_running_or_notify_cancel():
                job[3].set_exception(RuntimeError("the speech stage's decoder is shutting down"))
