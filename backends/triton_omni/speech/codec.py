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

``Code2WavBatcher`` decodes the chunks of every stream waiting at once: the
transformer in one pass for the streams with as many new frames (each
stream's cached keys, its sliding window's, padded on the left to the
longest and masked as its own pass masks them), the convolutions in one
batch. A window behind earlier frames is padded
on the left to the batch's longest: its first ``lookback`` frames only feed
samples already sent, so nothing sent depends on the padding. A stream's
first window has no such frames, and joins only windows of its own length.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

# frames of random states the convolutions' receptive field is measured on at load
_PROBE_FRAMES = 48
# Once ``warm`` has run, a convolution batch of n windows is padded with zero rows to the smallest
# of these that holds it. A GPU plans each new convolution shape the first time it runs (cuDNN, for
# every layer of the decoder): unbounded batch sizes would make new shapes for as long as the
# server runs, each a stall in every stream waiting for that batch. Past the last, multiples of it.
CONV_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# the most chunks a warmed stream runs before its windows settle to a full chunk's length
_WARM_CHUNKS_MAX = 4096


def chunk_schedule(first: int, full: int):
    """A stream's chunk sizes in frames: ``first``, then each at most twice the one before, up to
    ``full`` (1, 2, 4, 8, 8, ...): a chunk's audio lasts while the next one's frames are spoken."""
    size = first
    while True:
        yield size
        size = min(full, 2 * size)


def conv_rows(windows: int) -> int:
    """The rows a convolution batch of ``windows`` windows is padded to once warmed (``CONV_ROWS``)."""
    return next((n for n in CONV_ROWS if n >= windows), -(-windows // CONV_ROWS[-1]) * CONV_ROWS[-1])


class StreamingCode2Wav:
    """The decoder, and how much context a chunk needs (shared by every stream)."""

    def __init__(self, code2wav: torch.nn.Module):
        self.model = code2wav
        self.samples_per_frame = int(code2wav.total_upsample)
        self.lags = False  # every frame's samples leave with it (the runner reads it)
        self.padded = False  # convolution batches padded to ``conv_rows`` (``warm``)
        self.max_rows = 0  # once padded: the most windows one convolution batch takes
        self.behind_lengths: tuple[int, ...] = ()  # once padded: the lengths windows behind earlier frames take
        self.planned: set[tuple[int, int]] = set()  # the convolution shapes (rows, frames) run so far
        self.unplanned = 0  # shapes first met while serving, after ``warm``
        self.lookback = self._measure_lookback()

    def stream(self) -> Code2WavStream:
        return Code2WavStream(self)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole utterance at once: ``codes`` [groups, frames] to samples [n] (the reference)."""
        return self.model(codes[None].to(self.model.device))[0, 0]

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` [groups, n] or [batch, groups, n] to the transformer's inputs [batch, n, width]."""
        model = self.model
        codes = codes[None] if codes.dim() == 2 else codes
        return model.code_embedding(codes.to(model.device) + model.code_offset).mean(1)

    @torch.inference_mode()
    def windows(self, streams: list[Code2WavStream], codes: list[torch.Tensor]) -> list[Window]:
        """Each stream's ``window`` for its new frames, the streams with as many new frames
        through the transformer together (``transform``)."""
        groups: dict[int, list[int]] = defaultdict(list)
        for index, frames in enumerate(codes):
            groups[frames.shape[1]].append(index)
        found: list[Window | None] = [None] * len(streams)
        for members in groups.values():
            states = self.transform([streams[i] for i in members], [codes[i] for i in members])
            for i, new in zip(members, states, strict=True):
                found[i] = streams[i].take(new)
        return found

    def transform(self, streams: list[Code2WavStream], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The transformer on each stream's new frames (``codes`` [groups, n], one n for all) in one
        pass: each stream's cached keys (its sliding window's) left-padded to the longest and masked
        as its own pass would mask them; each stream's cache then takes its new keys as after its
        own pass. Each stream's new states [1, n, width]."""
        model = self.model.pre_transformer
        window, new = model.config.sliding_window, codes[0].shape[1]
        assert new > 0, "a chunk of no frames has nothing to transform"  # [..., -0:] would take every key
        seen = [stream.cache.get_seq_length() for stream in streams]
        kept = [min(count, window - 1) for count in seen]  # what a sliding layer keeps
        longest = max(kept)
        batch = DynamicCache()
        for index in range(len(model.layers) if longest else 0):
            layers = [stream.cache.layers[index] for stream in streams]
            some = next(layer for layer, count in zip(layers, kept, strict=True) if count)
            keys, values = [], []
            for layer, count in zip(layers, kept, strict=True):
                pad = (0, 0, longest - count, 0)
                keys.append(torch.nn.functional.pad(layer.keys if count else some.keys[:, :, :0], pad))
                values.append(torch.nn.functional.pad(layer.values if count else some.values[:, :, :0], pad))
            batch.update(torch.cat(keys), torch.cat(values), index)
        device = model.norm.weight.device
        column = torch.arange(longest + new, device=device)[None, None, :]  # a key's column
        query = torch.arange(new, device=device)[None, :, None]
        distance = column - longest - query  # the key's position less the query's, for every stream
        first_kept = torch.tensor([longest - count for count in kept], device=device)[:, None, None]
        visible = (column >= first_kept) & (distance <= 0) & (distance > -window)
        # additive, as every attention implementation but FlashAttention's reads a 4-D mask
        mask = torch.zeros(visible.shape, dtype=model.norm.weight.dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(mask.dtype).min)
        positions = torch.tensor(seen, device=device)[:, None] + torch.arange(new, device=device)[None]
        states = model(inputs_embeds=self.embed(torch.stack(codes)), position_ids=positions,
                       attention_mask={"sliding_attention": mask[:, None]}, past_key_values=batch,
                       use_cache=True).last_hidden_state
        for row, stream in enumerate(streams):
            for index, layer in enumerate(batch.layers):
                stream.cache.update(layer.keys[row:row + 1, :, -new:], layer.values[row:row + 1, :, -new:], index)
        return list(states.split(1))

    def convolve(self, states: torch.Tensor) -> torch.Tensor:
        """The convolutions after the transformer: states [batch, frames, width] to samples [batch, n]."""
        shape = tuple(states.shape[:2])
        if shape not in self.planned:
            self.planned.add(shape)
            self.unplanned += self.padded
        hidden = states.permute(0, 2, 1)
        for blocks in self.model.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.model.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)[:, 0]

    @torch.inference_mode()
    def convolve_windows(self, windows: list[Window]) -> list[torch.Tensor]:
        """Each window's samples from its ``start`` on, the windows convolved in as few batches as
        give the same samples: every window behind earlier frames padded on the left to the
        longest of them, the first windows of streams by their length."""
        groups: dict[int | None, list[int]] = defaultdict(list)
        for index, window in enumerate(windows):
            groups[None if window.behind else window.frames].append(index)
        chunks: list[torch.Tensor] = [torch.empty(0)] * len(windows)
        for key, group in groups.items():
            for members in self._batches(group):
                length = max(windows[i].frames for i in members)
                if key is None and self.padded:  # behind earlier frames: padded to a length warmed
                    length = next((n for n in self.behind_lengths if n >= length), length)
                for i, chunk in zip(members, self._convolve_batch([windows[i] for i in members], length), strict=True):
                    chunks[i] = chunk
        return chunks

    def _batches(self, members: list[int]) -> list[list[int]]:
        """``members`` in batches of at most ``max_rows`` once padded (streams whose talker has
        finished still decode their last chunk as new ones start: more than ``max_streams``)."""
        step = self.max_rows if self.padded and self.max_rows else len(members)
        return [members[i:i + step] for i in range(0, len(members), step)]

    def _convolve_batch(self, windows: list[Window], length: int) -> list[torch.Tensor]:
        """One convolution batch: ``windows`` padded on the left to ``length`` frames (and with zero
        rows after them, unread, once padded); each one's samples from its ``start`` on."""
        batch = torch.cat([torch.nn.functional.pad(window.states, (0, 0, length - window.frames, 0))
                           for window in windows])
        if self.padded:
            batch = torch.nn.functional.pad(batch, (0, 0, 0, 0, 0, conv_rows(len(windows)) - len(windows)))
        samples = self.convolve(batch)
        return [samples[row, (length - window.frames) * self.samples_per_frame + window.start:]
                for row, window in enumerate(windows)]

    @torch.inference_mode()
    def warm(self, max_streams: int, first_chunk: int, full_chunk: int) -> list[tuple[int, int]]:
        """Run every convolution shape a stage of ``max_streams`` streams meets with this chunk
        schedule once, and pad batches from now on: each window length a stream's chunks make (its
        first windows, then a full chunk behind its lookback) at each batch size of ``CONV_ROWS`` up
        to ``max_streams``'s. From then on a batch of windows behind earlier frames is padded to the
        next length warmed (an utterance's last, shorter chunk to a full one's), and a larger batch
        than ``max_streams`` is cut into batches of that many. The shapes run, (rows, frames)."""
        generator = torch.Generator().manual_seed(0)
        groups, size = self.model.config.num_quantizers, self.model.config.codebook_size
        stream, first, behind = self.stream(), set(), set()
        last = None
        for chunk in itertools.islice(chunk_schedule(first_chunk, full_chunk), _WARM_CHUNKS_MAX):
            window = stream.window(torch.randint(0, size, (groups, chunk), generator=generator))
            (behind if window.behind else first).add(window.frames)
            [samples] = self.convolve_windows([window])
            stream.settle(samples)
            if (window.frames, window.behind) == last and chunk == full_chunk:
                break  # settled: every later full chunk's window is this one's
            last = window.frames, window.behind
        width = self.model.config.hidden_size
        self.max_rows = conv_rows(max_streams)
        shapes = sorted({(conv_rows(n), frames) for n in range(1, max_streams + 1) for frames in first | behind})
        for rows, frames in shapes:
            self.convolve(torch.zeros(rows, frames, width, device=self.model.device, dtype=self.model.dtype))
        self.behind_lengths = tuple(sorted(behind))
        self.padded = True
        return shapes

    @torch.inference_mode()
    def _measure_lookback(self) -> int:
        """Frames of earlier states a window needs before the first sample it sends: the
        convolutions' receptive field, measured as the last sample of a window started
        mid-utterance that differs from the whole decode's, plus a frame of margin."""
        model = self.model
        generator = torch.Generator(device="cpu").manual_seed(0)
        states = torch.randn(1, _PROBE_FRAMES, model.config.hidden_size, generator=generator)
        states = states.to(model.device, model.dtype)
        whole = self.convolve(states)[0]
        start = _PROBE_FRAMES // 2
        window = self.convolve(states[:, start:])[0]
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
        [chunk] = self.decoder.convolve_windows([self.window(codes)])
        return self.settle(chunk)

    @torch.inference_mode()
    def window(self, codes: torch.Tensor) -> Window:
        """The transformer on the new frames (``codes`` [groups, n]), and the states the
        convolutions run on for their samples."""
        transformer = self.decoder.model.pre_transformer
        return self.take(transformer(inputs_embeds=self.decoder.embed(codes), past_key_values=self.cache,
                                     use_cache=True).last_hidden_state)

    def take(self, new: torch.Tensor) -> Window:
        """The window for the transformer's states of the new frames (``new`` [1, n, width])."""
        self.states = new if self.states is None else torch.cat([self.states, new], dim=1)
        per_frame = self.decoder.samples_per_frame
        first = max(0, self.sent // per_frame - self.decoder.lookback)  # the window's first frame
        self.states = self.states[:, first - self.first_state:]  # earlier states no window reads again
        self.first_state = first
        return Window(self.states, self.sent - first * per_frame, behind=first > 0)

    def settle(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk``, the samples ``window``'s states made past those sent, sent."""
        self.sent += len(chunk)
        return chunk


@dataclass
class Window:
    """The states one chunk's convolutions run on, and where its new samples start."""

    states: torch.Tensor  # [1, frames, width]
    start: int  # the first sample not sent yet
    behind: bool  # it starts behind earlier frames: what it makes of its first `lookback` frames was sent

    @property
    def frames(self) -> int:
        return self.states.shape[1]


class Code2WavBatcher:
    """One thread that decodes the chunks of every stream waiting, together
    (``StreamingCode2Wav.windows`` and ``convolve_windows``); a stream has one chunk in flight at a
    time. A job whose caller cancelled it before its decode (a client gone) is dropped; the others
    in its batch are decoded as if it had never come. Urgent chunks (a stream's first ones,
    shorter than ``chunk_frames``: 1, 2 and 4 frames by default, little audio playing before
    them) are decoded in a batch of their own ahead of the others waiting: at 64 streams a batch
    of full chunks takes a GPU a few hundred ms, which a new stream's first audio, and the next
    chunk of a stream that has sent 80 ms, would otherwise wait for; a full chunk comes with
    seconds of audio still to play."""

    def __init__(self, decoder: StreamingCode2Wav, warm: tuple[int, int, int] | None = None):
        """``warm``: ``decoder.warm``'s (max_streams, first_chunk, full_chunk), run on the thread
        before it decodes (cuDNN keeps its plans per thread); the constructor waits for it."""
        self.decoder = decoder
        self.max_batch_seen = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._warmed: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(warm,), name="omni-codec", daemon=True)
        self._thread.start()
        self.warmed_shapes: list[tuple[int, int]] = self._warmed.result()

    def decode(self, stream: Code2WavStream, codes: torch.Tensor, urgent: bool = False,
               final: bool = False) -> Future:
        """The chunk ``codes`` ([groups, n]) settle in ``stream``, as float32 samples, when decoded;
        ``urgent``: ahead of the chunks that are not. (``final``: the stream's last chunk, which
        settles nothing more here: the decode is causal, every frame's samples leave with it.)"""
        future: Future = Future()
        if self._stopped:
            future.set_exception(RuntimeError("the speech stage's decoder is shutting down"))
        else:
            self._jobs.put((stream, codes, future, bool(urgent)))
        return future

    def stop(self, timeout_s: float = 30) -> None:
        """Decode what is queued, fail what comes after, and wait for the thread."""
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self, warm: tuple[int, int, int] | None) -> None:
        try:
            own_stream = self._own_stream()
            with own_stream:
                self._warmed.set_result(self.decoder.warm(*warm) if warm else [])
        except Exception as exc:  # the load fails with it
            self._warmed.set_exception(exc)
            return
        with own_stream:
            self._serve()

    def _own_stream(self):
        """On a GPU, a CUDA stream of this thread's own: the talker's thread reads every step's
        codes back to the host, and on one shared stream each such read would wait for the decode
        queued there too (at 64 streams, a batch of full chunks is a few hundred ms)."""
        device = self.decoder.model.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the load's work, done before the first decode
        return torch.cuda.stream(stream)

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            jobs = [self._jobs.get(), *self._waiting()]
            stopping = None in jobs
            jobs = [job for job in jobs if job is not None]
            for urgent in (True, False):
                self._decode([job[:3] for job in jobs if job[3] == urgent and job[2].set_running_or_notify_cancel()])
        for job in self._waiting():  # queued as stop() came (decode() fails the later ones itself)
            if job is not None and job[2].set_running_or_notify_cancel():
                job[2].set_exception(RuntimeError("the speech stage's decoder is shutting down"))

    def _waiting(self) -> list:
        """Every job queued now, without waiting for one."""
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _decode(self, jobs: list) -> None:
        if not jobs:
            return
        self.max_batch_seen = max(self.max_batch_seen, len(jobs))
        try:
            empty = [codes.shape[1] == 0 for _, codes, _ in jobs]
            decoding = [job for job, none in zip(jobs, empty, strict=True) if not none]
            windows = self.decoder.windows([stream for stream, _, _ in decoding], [codes for _, codes, _ in decoding])
            chunks = iter(self.decoder.convolve_windows(windows))
            results = [np.zeros(0, np.float32) if none else stream.settle(next(chunks)).float().cpu().numpy()
                       for (stream, _, _), none in zip(jobs, empty, strict=True)]
        except Exception as exc:  # every stream of the batch hears of it; the thread decodes on
            for _, _, future in jobs:
                future.set_exception(exc)
            return
        for (_, _, future), samples in zip(jobs, results, strict=True):
            future.set_result(samples)  # running futures: a caller's cancel() no longer takes them
