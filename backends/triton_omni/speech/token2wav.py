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

``Token2WavDecoder`` runs the streams' decodes on a thread of their own, beside the talker's steps:
the chunks of every stream waiting are decoded together (``decode_round``), the DiT's ODE run once
for all the windows of the same length and voice reference (stacked as a batch: each row its own
codes, noise and voice), then the vocoder once for the streams' windows of one length (a steady
stream's: a block's frames and the vocoder's reach either side).

An ODE is 36 passes of a small DiT over a window of a few hundred frames, thousands of small
kernels each launched from Python. On a GPU its windows of the usual
shapes (a stream's first and its steady ones, a few windows together) are captured at load as
CUDA graphs (``OdeGraphs``), each replayed as one launch; the ODE itself is ``integrate``,
transformers' Runge-Kutta steps without the host syncs its interpolation makes. The DiT's speaker
encoder (an ECAPA-TDNN over the voice's reference mel) reads the same input at every pass: an ODE
runs it once (``_speaker_encoded_once``), not 36 times.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from triton_omni import transfers

# frames of random mel the vocoder's reach is measured on at load
_PROBE_FRAMES = 96
# the windows an ODE graph is captured for, stacked: a larger round's windows run eagerly, their
# launches shared by their rows
GRAPH_ROWS = (1, 2, 4, 8)


def integrate(velocity, value: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """transformers' ``RungeKutta4ODESolver(velocity, value).integrate(times)[-1]``, its arithmetic in
    its order (the same numbers), without its host syncs: its interpolation compares time points on
    the host, and each comparison waits for the device (and cannot be captured)."""
    for start, end in itertools.pairwise(times):
        step = end - start
        k1 = velocity(start, value)
        k2 = velocity(start + step * (1 / 3), value + step * k1 * (1 / 3))
        k3 = velocity(start + step * (2 / 3), value + step * (k2 - k1 * (1 / 3)))
        k4 = velocity(end, value + step * (k1 - k2 + k3))
        value = value + (k1 + 3 * (k2 + k3) + k4) * step / 8
    return value


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
        self.graphs: OdeGraphs | None = None  # the ODE's captured shapes (``capture``)
        self._solving = threading.Lock()

    def capture(self, voices: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int) -> None:
        """On a GPU: the ODE of the usual windows captured as CUDA graphs (``OdeGraphs``), for each of
        ``voices`` (their ``cond`` and ``ref_mel``), up to ``max_rows`` windows together."""
        self.graphs = OdeGraphs(self, voices, max_rows, capture=True)

    @property
    def window_codes(self) -> tuple[int, ...]:
        """The codes of a stream's usual windows as its blocks settle one at a time: its first (its first
        block and the context after it), the ones after it (the context before it growing), and the
        steady one (a block and its context either side)."""
        block, context = self.block_codes, self.context_blocks
        return tuple((context + 1 + before) * block for before in range(context + 1))

    def stream(self, conditioning: torch.Tensor, reference_mel: torch.Tensor,
               generator: torch.Generator | None = None) -> Token2WavStream:
        """One utterance in a voice (its ``cond`` [1, C] and ``ref_mel`` [1, T, mel_bins]); its noise
        from ``generator`` (a CPU one: a CUDA generator's numbers depend on how they are drawn)."""
        return Token2WavStream(self, conditioning, reference_mel, generator)

    def decode_round(self, chunks: list[tuple[Token2WavStream, list[int], bool]]) -> list[torch.Tensor | Exception]:
        """Each ``(stream, codes, final)`` (one a stream) as ``stream.add`` decodes it alone, the DiT's
        windows of the same length and reference stacked into one ODE, then the vocoder's windows of
        the same length into one run: each stream's new samples, or the error that stopped its chunk
        (the other batches' decode on)."""
        results: list[torch.Tensor | Exception | None] = [None] * len(chunks)
        plans: dict[int, Window] = {}
        batches: dict[tuple, list[int]] = {}  # the windows that stack: the same length and reference's shape
        for i, (stream, codes, final) in enumerate(chunks):
            stream.extend(codes)
            if (window := stream.window(final)) is not None:
                plans[i] = window
                batches.setdefault((len(window.codes), tuple(stream.reference_mel.shape)), []).append(i)
        for rows in batches.values():
            streams = [chunks[i][0] for i in rows]
            try:
                mel = self.mel(torch.tensor([plans[i].codes for i in rows]), torch.cat([plans[i].noise for i in rows]),
                               torch.cat([stream.conditioning for stream in streams]),
                               torch.cat([stream.reference_mel for stream in streams]))
            except Exception as exc:  # each stream of this batch hears of it
                for i in rows:
                    results[i] = exc
                continue
            for row, (i, stream) in enumerate(zip(rows, streams, strict=True)):
                stream.settle(plans[i], mel[row:row + 1])
        self._vocode_round(chunks, results)
        return results

    def _vocode_round(self, chunks: list[tuple[Token2WavStream, list[int], bool]],
                      results: list[torch.Tensor | Exception | None]) -> None:
        """The vocoder for each stream not failed yet, its windows of one length in one run (a steady
        stream's window is a block's frames and the reach either side: the same for every one)."""
        windows: dict[int, VocoderWindow] = {}
        batches: dict[int, list[int]] = {}
        for i, (stream, _, final) in enumerate(chunks):
            if results[i] is None:
                if (window := stream.vocoder_window(final)) is None:
                    results[i] = torch.zeros(0)
                else:
                    windows[i] = window
                    batches.setdefault(window.end - window.first, []).append(i)
        for rows in batches.values():
            try:
                samples = self.samples(torch.cat([chunks[i][0].mel[..., windows[i].first:windows[i].end]
                                                  for i in rows]))
            except Exception as exc:  # each stream of this batch hears of it
                for i in rows:
                    results[i] = exc
                continue
            for row, i in enumerate(rows):
                results[i] = chunks[i][0].sent(windows[i], samples[row])

    @torch.inference_mode()
    def mel(self, codes: torch.Tensor, noise: torch.Tensor, conditioning: torch.Tensor,
            reference_mel: torch.Tensor) -> torch.Tensor:
        """The DiT's ``sample`` for ``codes`` [B, n] from the given ``noise`` [B, repeats n, mel_bins]
        (``sample`` draws its own), each row with its voice (``conditioning`` [B, C], ``reference_mel``
        [B, T, mel_bins]): the mel [B, mel_bins, repeats n]. A captured shape's graph replayed, where
        one holds them."""
        if self.graphs is not None and (mel := self.graphs(codes, noise, conditioning, reference_mel)) is not None:
            return mel
        device = next(self.dit.parameters()).device
        return self.solve(*(transfers.to_device(tensor, device) for tensor in (codes, noise, conditioning,
                                                                               reference_mel)))

    def solve(self, codes: torch.Tensor, noise: torch.Tensor, conditioning: torch.Tensor,
              reference_mel: torch.Tensor) -> torch.Tensor:
        """``mel``'s ODE on the DiT's device, every step queued there (nothing waits for the device)."""
        frames = codes.shape[1] * self.repeats
        speaker = conditioning.unsqueeze(1).repeat(1, frames, 1)

        def velocity(time_step, states):
            guided, null = self.dit(hidden_states=states, quantized_code=codes, speaker_embedding=speaker,
                                    condition_vector=reference_mel, time_step=time_step, apply_cfg=True).chunk(2)
            return guided + (guided - null) * self.guidance_scale

        # one ODE at a time: the speaker encoder's output is held on the shared DiT for its passes
        with self._solving, _speaker_encoded_once(self.dit, reference_mel):
            return integrate(velocity, noise, self._times(noise.device)).permute(0, 2, 1)

    def _times(self, device: torch.device) -> torch.Tensor:
        """The ODE's time points (``sample``'s: evenly spaced, swayed toward the start)."""
        times = torch.linspace(0, 1, self.num_steps, device=device, dtype=torch.float32)
        return times + self.sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)

    @torch.inference_mode()
    def samples(self, mel: torch.Tensor) -> torch.Tensor:
        """The vocoder on ``mel`` [B, mel_bins, frames]: float32 samples [B, frames x samples_per_frame],
        on the host."""
        return self.vocoder(mel.to(next(self.vocoder.parameters()).device)).reshape(mel.shape[0], -1).cpu()

    @torch.inference_mode()
    def _measure_vocoder_reach(self) -> int:
        """Mel frames the vocoder's samples for a frame depend on either side: the farthest frame
        from a window's edges whose samples differ from the whole decode's, plus one of margin."""
        generator = torch.Generator().manual_seed(0)
        mel = torch.randn(1, self.mel_bins, _PROBE_FRAMES, generator=generator) - 4.0
        mel = mel.to(next(self.vocoder.parameters()).device)
        whole = self.samples(mel)[0]
        start, end = _PROBE_FRAMES // 4, 3 * _PROBE_FRAMES // 4
        window = self.samples(mel[..., start:end])[0]
        per = self.samples_per_frame
        apart = (window - whole[start * per:end * per]).abs() > 1e-4 * float(whole.abs().max())
        half, where = len(window) // 2, apart.nonzero()[:, 0]
        left = math.ceil((int(where[where < half].max()) + 1) / per) if (where < half).any() else 0
        right = math.ceil((len(window) - int(where[where >= half].min())) / per) if (where >= half).any() else 0
        return max(left, right) + 1


@contextlib.contextmanager
def _speaker_encoded_once(dit: torch.nn.Module, reference_mel: torch.Tensor):
    """Meanwhile, the DiT's passes read its speaker encoder's output for ``reference_mel`` [B, T, mel
    bins] from one run of it, made here: each guided pass encodes the same thing, the references
    then zeros for the unguided half (the same input, the same kernels: the same numbers)."""
    encoder = dit.input_embed.spk_encoder
    encoded = encoder(torch.cat([reference_mel, torch.zeros_like(reference_mel)]))

    def held(condition: torch.Tensor) -> torch.Tensor:
        if condition.shape != (2 * reference_mel.shape[0], *reference_mel.shape[1:]):
            raise RuntimeError(f"token2wav's speaker encoder held for {list(reference_mel.shape)}, "
                               f"called on {list(condition.shape)}")
        return encoded

    before = encoder.__dict__.get("forward")  # an instance's own forward (a wrapper's), put back after
    encoder.forward = held  # the instance's, over the class's; the module's hooks still run
    try:
        yield
    finally:
        if before is None:
            del encoder.forward
        else:
            encoder.forward = before


class _Ode:
    """The ODE of ``rows`` windows of ``codes`` codes in voices whose reference is ``reference_frames``
    mel frames long, every tensor allocated once: the inputs copied into ``codes``, ``noise``,
    ``conditioning`` and ``reference``; ``mel`` out (rows past a batch's keep what they held: the
    rows do not meet in the DiT)."""

    def __init__(self, decoder: StreamingToken2Wav, rows: int, codes: int, reference: torch.Tensor,
                 conditioning: torch.Tensor, device: torch.device):
        self.decoder = decoder
        self.codes = torch.zeros(rows, codes, dtype=torch.long, device=device)
        self.noise = torch.zeros(rows, codes * decoder.repeats, decoder.mel_bins, device=device)
        self.conditioning = conditioning.to(device, torch.float32).expand(rows, -1).clone()
        self.reference = reference.to(device, torch.float32).expand(rows, -1, -1).clone()
        self.mel: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self) -> None:
        self.mel = self.decoder.solve(self.codes, self.noise, self.conditioning, self.reference)

    def __call__(self, codes: torch.Tensor, noise: torch.Tensor, conditioning: torch.Tensor,
                 reference: torch.Tensor, graph: torch.cuda.CUDAGraph | None) -> torch.Tensor:
        rows, device = codes.shape[0], self.codes.device
        for buffer, value in ((self.codes, codes), (self.noise, noise), (self.conditioning, conditioning),
                              (self.reference, reference)):
            buffer[:rows].copy_(transfers.to_device(value, device))
        if graph is not None:
            graph.replay()
        else:
            self.run()
        return self.mel[:rows].clone()


class OdeGraphs:
    """The ODE of the usual windows (``window_codes``, up to ``GRAPH_ROWS`` of a length together) for
    each voice's reference length, each captured as a CUDA graph where ``capture`` (all in one memory
    pool: one replays at a time), run as they are otherwise (the CPU tests hold that path to the
    eager one). A batch of windows runs on the smallest captured batch that holds it; a window of
    another length (a stream's last, several blocks settling at once) runs eagerly."""

    def __init__(self, decoder: StreamingToken2Wav, voices: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int, capture: bool):
        """``voices``: each voice's ``cond`` [1, C] and ``ref_mel`` [1, T, mel_bins]."""
        device = next(decoder.dit.parameters()).device
        ladder = dict.fromkeys([n for n in GRAPH_ROWS if n < max_rows] + [min(max_rows, GRAPH_ROWS[-1])])
        references = {reference.shape[1]: (conditioning, reference) for conditioning, reference in voices}
        self.odes = {(rows, codes, frames): _Ode(decoder, rows, codes, reference, conditioning, device)
                     for frames, (conditioning, reference) in references.items()
                     for codes in decoder.window_codes for rows in ladder}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        if capture:
            from triton_omni.speech.predictor_graphs import captured

            pool = torch.cuda.graph_pool_handle()
            with torch.cuda.device(device):  # the largest first: the others fit in its pool
                for key in sorted(self.odes, key=lambda k: k[0] * k[1], reverse=True):
                    self.graphs[key] = captured(self.odes[key].run, pool, warmups=1)

    def __call__(self, codes: torch.Tensor, noise: torch.Tensor, conditioning: torch.Tensor,
                 reference: torch.Tensor) -> torch.Tensor | None:
        """``StreamingToken2Wav.mel`` of a batch of windows on its captured shape; None where none holds it."""
        rows, length, frames = codes.shape[0], codes.shape[1], reference.shape[1]
        key = min(((n, c, f) for n, c, f in self.odes if n >= rows and c == length and f == frames), default=None)
        if key is None:
            return None
        return self.odes[key](codes, noise, conditioning, reference, self.graphs.get(key))


@dataclass(frozen=True)
class Window:
    """The codes ``first:end`` the DiT decodes for a stream, whose codes ``done:ready`` it keeps."""

    first: int
    done: int
    ready: int
    end: int
    codes: list[int]
    noise: torch.Tensor  # [1, frames, mel_bins]


@dataclass(frozen=True)
class VocoderWindow:
    """The mel frames ``first:end`` the vocoder reads for a stream, whose samples up to frame ``ready``
    it sends."""

    first: int
    end: int
    ready: int


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
        """Float32 samples: those of every mel frame settled by now and not sent yet (a round of
        ``decode_round`` for this stream alone)."""
        [samples] = self.decoder.decode_round([(self, codes, final)])
        if isinstance(samples, Exception):
            raise samples
        return samples

    def extend(self, codes: list[int]) -> None:
        """Take the talker's new codes, and draw their frames' noise (in order: the whole decode's)."""
        decoder = self.decoder
        self.codes.extend(codes)
        if codes:
            self.noise = torch.cat([self.noise, torch.randn(1, len(codes) * decoder.repeats, decoder.mel_bins,
                                                            generator=self.generator)], dim=1)

    def window(self, final: bool) -> Window | None:
        """The DiT's window for every block whose context after it is there (all of them at the end),
        from a block boundary ``context_blocks`` before the first; None when no block is ready."""
        decoder = self.decoder
        block, context = decoder.block_codes, decoder.context_blocks
        done = self.mel.shape[2] // decoder.repeats
        ready = len(self.codes) if final else (len(self.codes) // block - context) * block
        if ready <= done:
            return None
        first = max(0, done - context * block)  # on a block boundary: done is one
        end = len(self.codes) if final else min(len(self.codes), ready + context * block)
        return Window(first, done, ready, end, self.codes[first:end],
                      self.noise[:, first * decoder.repeats:end * decoder.repeats])

    def settle(self, window: Window, mel: torch.Tensor) -> None:
        """Keep the new blocks' frames of the window's ``mel`` [1, mel_bins, frames]."""
        repeats = self.decoder.repeats
        new = mel[..., (window.done - window.first) * repeats:(window.ready - window.first) * repeats]
        self.mel = torch.cat([self.mel, new.cpu()], dim=2)

    def vocoder_window(self, final: bool) -> VocoderWindow | None:
        """The mel frames the vocoder reads for the frames whose reach after them is there (all of them
        at the end); None when no frame is ready."""
        frames, reach = self.mel.shape[2], self.decoder.vocoder_reach
        ready = frames if final else frames - reach
        if ready <= self.sent_frames:
            return None
        return VocoderWindow(max(0, self.sent_frames - reach), frames if final else min(frames, ready + reach),
                             ready)

    def sent(self, window: VocoderWindow, samples: torch.Tensor) -> torch.Tensor:
        """The new frames' part of the vocoder's ``samples`` of ``window``, now sent."""
        per = self.decoder.samples_per_frame
        new = samples[(self.sent_frames - window.first) * per:(window.ready - window.first) * per]
        self.sent_frames = window.ready
        return new


class Token2WavDecoder:
    """The speech stage's decoder thread for ``token2wav`` streams (``Code2WavBatcher``'s interface):
    the chunks waiting decoded together (``decode_round``: a chunk a stream a round, in the order they
    came), on a daemon thread of its own (a stub's exit never waits for it). ``urgent`` chunks go in
    their turn: every round takes all the streams waiting."""

    @property
    def warmed_shapes(self) -> list[tuple[int, int, int]]:
        """The ODE's shapes captured at load (windows, codes, reference frames): none on a CPU."""
        return list(self.decoder.graphs.graphs) if self.decoder.graphs is not None else []

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
        stopping = False
        while not stopping and (job := self._jobs.get()) is not None:
            waiting = [job]
            while True:  # every chunk queued meanwhile joins this round (a stream's second waits for the next)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                waiting.append(job)
            while waiting:
                round_, later, streams = [], [], set()
                for job in waiting:
                    (later if id(job[0]) in streams else round_).append(job)
                    streams.add(id(job[0]))
                self._decode(round_)
                waiting = later
        while True:  # queued as stop() came (decode() fails the later ones itself)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[3].set_running_or_notify_cancel():
                job[3].set_exception(RuntimeError("the speech stage's decoder is shutting down"))

    def _decode(self, jobs: list) -> None:
        """One round: a chunk a stream, decoded together; each future gets its samples or its error."""
        jobs = [job for job in jobs if job[3].set_running_or_notify_cancel()]  # their callers left otherwise
        try:
            results = self.decoder.decode_round([(stream, codes[0].tolist(), final)
                                                 for stream, codes, final, _ in jobs])
        except Exception as exc:  # these streams hear of it; the thread decodes on
            results = [exc] * len(jobs)
        for (_, _, _, future), result in zip(jobs, results, strict=True):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result.numpy().astype(np.float32))
