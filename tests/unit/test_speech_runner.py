"""The speech stage's runner on the tiny Qwen3-Omni, without a server: its streamed decode, its
step batching and its sampling; the talker's steps over the fixed-buffer ``SlotCache`` (what a GPU
replays as CUDA graphs, ``talker_graphs.py``) run eagerly, held to the ``PaddedCache`` steps; and
``talker_max_len``, which bounds an utterance as vLLM's ``max_model_len`` bounds a request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, DynamicCache
from triton_omni.channel import ReplyReader, ReplyWriter
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestCancelledError, RequestValidationError
from triton_omni.speech import talker_graphs, talker_regions
from triton_omni.speech.runner import SpeechConfig, SpeechRunner
from triton_omni.speech.talker import TalkerBatcher

from tests.support import fake_pb_utils

TALKER = {"temperature": 0.0, "max_tokens": 12, "min_tokens": 3}


@pytest.fixture(scope="module")
def runner():
    runner = SpeechRunner(SpeechConfig(model="demo:tiny-qwen3-omni"))
    yield runner
    runner.close()


@functools.cache
def templated(prompt: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("demo:tiny-qwen3-omni"))
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def request(runner, prompt: str = "a red fox", reply: tuple[int, ...] = (40, 41, 42, 43, 3), **options):
    return runner.parse({"text_input": templated(prompt), "reply_ids": list(reply), **(TALKER | options)})


def speak(runner, *requests, steps: list | None = None) -> list[list]:
    """Each request's chunks, the requests spoken together; ``steps``: the talker's step count at each
    chunk of the first request."""
    async def all_of():
        chunks = [[] for _ in requests]

        def keep(index):
            def on_chunk(chunk):
                chunks[index].append(chunk)
                if index == 0 and steps is not None:
                    steps.append(runner.batcher.steps)
            return on_chunk

        await asyncio.gather(*(runner.speak(r, keep(i)) for i, r in enumerate(requests)))
        return chunks

    return runner.loop.run(all_of())


def joined(chunks) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([c.samples for c in chunks]), np.concatenate([c.codes for c in chunks], axis=1)


@contextlib.contextmanager
def talker_held(runner, until: threading.Event, after_steps: int = 0):
    """The talker's steps past ``after_steps`` wait for ``until`` (at most 30 s): what a test
    needs to have happened meanwhile does, however slowly this host runs the other threads."""
    batcher = runner.batcher
    step = batcher._step

    def held():
        if batcher.steps >= after_steps:
            until.wait(timeout=30)
        step()

    batcher._step = held
    try:
        yield
    finally:
        del batcher._step


def test_audio_leaves_before_the_talker_has_finished(runner):
    """Two frames a chunk: the first chunk is decoded while the talker still speaks (fewer talker
    steps behind it than behind the last), and the chunks join into the whole decode of the frames.
    The talker waits after 4 steps until a chunk is out: were decoding to wait for the end of speech,
    no chunk would come, and after 30 s the first would come behind every step."""
    first_chunk = threading.Event()

    class Steps(list):  # speak() appends the talker's step count at each chunk
        def append(self, value):
            super().append(value)
            first_chunk.set()

    steps = Steps()
    with talker_held(runner, first_chunk, after_steps=4):
        [chunks] = speak(runner, request(runner, chunk_frames=2, min_tokens=12), steps=steps)
    assert len(chunks) > 2 and steps[0] < steps[-1]
    audio, codes = joined(chunks)
    whole = runner.decoder.decode(torch.from_numpy(codes)).numpy()
    assert audio.shape == whole.shape and np.abs(audio - whole).max() < 1e-5
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_chunks_grow_from_the_first_frame_to_chunk_frames(runner):
    """By default the first chunk is one frame (the prefill's), and each after it at most twice the
    one before, up to ``chunk_frames``: 1, 2, 4, 8, 8, ... and what is left at the end."""
    [chunks] = speak(runner, request(runner, chunk_frames=8, max_tokens=30, min_tokens=30))
    sizes = [c.codes.shape[1] for c in chunks]
    assert sizes == [1, 2, 4, 8, 8, 6], sizes  # max_tokens 30: the last code drawn makes no frame
    [chunks] = speak(runner, request(runner, chunk_frames=8, first_chunk_frames=3, max_tokens=30, min_tokens=30))
    assert [c.codes.shape[1] for c in chunks] == [3, 6, 8, 8, 4]


def test_the_first_chunk_says_where_its_wait_went(runner):
    """The first chunk carries its wait split into ``FIRST_AUDIO_PHASES`` (the speech model's
    ``omni_speech_first_audio_phase_seconds``, whose phases are the same names), which add up to
    no more than the wait itself; the chunks after it carry none."""
    from triton_omni.speech.runner import FIRST_AUDIO_PHASES

    fake_pb_utils.install()
    from triton_omni.triton.metrics import SPEECH_PHASES

    started = time.monotonic()
    arrived = []
    [chunks] = speak(runner, request(runner, chunk_frames=4, max_tokens=12, min_tokens=12),
                     steps=arrived)
    first_wait = time.monotonic() - started
    assert SPEECH_PHASES == FIRST_AUDIO_PHASES
    phases = chunks[0].phases
    assert list(phases) == list(FIRST_AUDIO_PHASES) and all(value >= 0 for value in phases.values()), phases
    assert 0 < sum(phases.values()) <= first_wait and len(chunks) > 1
    assert all(chunk.phases is None for chunk in chunks[1:])
    # the talker marked when the utterance joined its batch: without that mark the first frame's
    # wait would read as the time between two clock reads, and the join phase as all of it
    assert phases["first_frame"] > 1e-4 and phases["join"] > 0, phases


@pytest.mark.parametrize("frames", [1, 5])
def test_a_streamed_decode_equals_the_whole_one_where_the_models_own_chunking_does_not(runner, frames):
    codes = torch.randint(0, 32, (runner.talker.groups, 40), generator=torch.Generator().manual_seed(frames))
    whole = runner.decoder.decode(codes)
    stream = runner.decoder.stream()
    streamed = torch.cat([stream.add(codes[:, i:i + frames]) for i in range(0, codes.shape[1], frames)])
    assert streamed.shape == whole.shape and float((streamed - whole).abs().max()) < 1e-5
    with torch.no_grad():
        own = runner.decoder.model.chunked_decode(codes[None], chunk_size=frames, left_context_size=25).flatten()
    assert own.shape != whole.shape  # each of its chunks loses samples at its edge


def test_chunks_of_streams_decoded_together_equal_each_decoded_alone(runner):
    """Streams at their first chunk and behind earlier frames, with as many new frames or not: the
    transformer runs once for the streams with as many new frames (their cached keys padded to the
    longest: five streams, one of them new, one past the sliding window), the convolutions once for
    the windows behind earlier frames (padded on the left) and once for each length of first
    windows; every chunk, and the transformer's states under it, are its stream's alone, and the
    streams' caches go on as theirs would (a second chunk)."""
    decoder = runner.decoder
    generator = torch.Generator().manual_seed(3)
    # (frames decoded before, frames of this chunk) for each stream; (80, 8): its cache holds the
    # sliding window's 71 frames, not all 80
    plan = [(0, 2), (0, 2), (0, 5), (12, 8), (20, 3), (16, 4), (3, 8), (0, 8), (25, 8), (80, 8)]
    codes = [torch.randint(0, 32, (runner.talker.groups, 100), generator=generator) for _ in plan]
    alone, together = [], []
    for (before, _), stream_codes in zip(plan, codes, strict=True):
        for streams in (alone, together):
            stream = decoder.stream()
            if before:
                stream.add(stream_codes[:, :before])
            streams.append(stream)
    chunks = [[c[:, b:b + f] for c, (b, f) in zip(codes, plan, strict=True)],
              [c[:, b + f:b + f + 4] for c, (b, f) in zip(codes, plan, strict=True)]]
    expected = [[], []]  # each stream's (samples, states) alone, at each chunk
    for index, stream in enumerate(alone):
        for turn in (0, 1):
            window = stream.window(chunks[turn][index])
            states = window.states.clone()
            expected[turn].append((stream.settle(decoder.convolve_windows([window])[0]), states))
    transformed, convolved = [], []
    decoder.transform, transform = (lambda streams, c: transformed.append(len(streams)) or transform(streams, c),
                                    decoder.transform)
    decoder.convolve, convolve = (lambda states: convolved.append(len(states)) or convolve(states)), decoder.convolve
    try:
        for turn in (0, 1):
            windows = decoder.windows(together, chunks[turn])
            states = [w.states.clone() for w in windows]
            samples = [s.settle(c) for s, c in zip(together, decoder.convolve_windows(windows), strict=True)]
            if turn == 0:
                heads = {w.frames for w in windows if not w.behind}
                assert sorted(transformed) == [1, 1, 1, 2, 5] and sum(convolved) == len(plan)
                assert len(convolved) == 1 + len(heads) < len(plan)
            for index, (wanted_samples, wanted_states) in enumerate(expected[turn]):
                # the states too: this demo's convolutions all but hide a wrong position
                assert states[index].shape == wanted_states.shape, plan[index]
                assert float((states[index] - wanted_states).abs().max()) < 1e-5, (plan[index], turn)
                assert samples[index].shape == wanted_samples.shape, plan[index]
                assert float((samples[index] - wanted_samples).abs().max()) < 1e-5, (plan[index], turn)
    finally:
        del decoder.transform, decoder.convolve
    assert float((expected[0][0][0] - expected[0][1][0]).abs().max()) > 100 * 1e-5  # other codes, other samples


def decoded_together(decoder, codes: list[torch.Tensor], chunks: list[int]) -> list[torch.Tensor]:
    """``codes``' streams decoded together, chunk by chunk (``chunks``' sizes), as the codec thread
    decodes streams that step together: each stream's samples."""
    streams, samples, start = [decoder.stream() for _ in codes], [[] for _ in codes], 0
    for size in chunks:
        windows = decoder.windows(streams, [c[:, start:start + size] for c in codes])
        for index, (stream, chunk) in enumerate(zip(streams, decoder.convolve_windows(windows), strict=True)):
            samples[index].append(stream.settle(chunk))
        start += size
    return [torch.cat(parts) for parts in samples]


def test_a_warmed_decoder_meets_only_the_shapes_it_planned_and_decodes_the_same(runner):
    """``warm`` runs each convolution shape a stage meets (its batches padded to ``CONV_ROWS``, each
    window length the default chunks make) once: five streams through the default chunks and a
    last, shorter chunk (padded to a full one's window), and then more streams than it was warmed
    for (cut into batches it planned), meet no shape it did not plan, and decode the samples of a
    decoder that pads nothing, which meets a batch of five. A first chunk of another size is a
    shape it did not plan, and is counted."""
    from triton_omni.speech.codec import StreamingCode2Wav, chunk_schedule

    plain, warmed = StreamingCode2Wav(runner.decoder.model), StreamingCode2Wav(runner.decoder.model)
    shapes = warmed.warm(6, 1, 8)
    assert {rows for rows, _ in shapes} == {1, 2, 4, 8} and warmed.unplanned == 0
    # a full chunk behind its lookback, and one frame more: the decode of n frames ends a little
    # short of n frames' samples, so a window's first frame is the one before
    assert warmed.behind_lengths == (warmed.lookback + 1 + 8,)
    generator = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 32, (runner.talker.groups, 40), generator=generator) for _ in range(11)]
    chunks = list(itertools.islice(chunk_schedule(1, 8), 6))
    assert chunks == [1, 2, 4, 8, 8, 8]
    for streams, sizes in ((5, [*chunks, 5]), (11, chunks)):
        expected = decoded_together(plain, codes[:streams], sizes)
        found = decoded_together(warmed, codes[:streams], sizes)
        assert warmed.unplanned == 0, (streams, sizes)
        for wanted, got in zip(expected, found, strict=True):
            assert wanted.shape == got.shape and float((wanted - got).abs().max()) < 1e-5
    assert {(5, warmed.lookback + 1 + 5), (11, warmed.lookback + 1 + 8)} <= plain.planned  # what padding spared
    decoded_together(warmed, codes[:1], [5])
    assert warmed.unplanned == 1


def test_warm_runs_a_stream_until_its_windows_settle(runner):
    """Chunks of one frame take more chunks than the lookback's frames to reach a full chunk's window
    behind the lookback; the warm-up runs until they do, whatever the chunk size."""
    from triton_omni.speech.codec import StreamingCode2Wav

    decoder = StreamingCode2Wav(runner.decoder.model)
    decoder.warm(2, 1, 1)
    assert decoder.lookback >= 6 and decoder.behind_lengths == (decoder.lookback + 1 + 1,)


@contextlib.contextmanager
def first_batch_held(decoder):
    """The codec thread's first batch waits for ``release`` (``busy`` set once it does), so that
    the chunks decoded next queue behind it; ``batches``: each batch's chunk lengths, in order."""
    busy, release, batches = threading.Event(), threading.Event(), []
    windows = decoder.windows

    def held(streams, parts):
        batches.append([part.shape[1] for part in parts])
        if not busy.is_set():
            busy.set()
            release.wait(30)
        return windows(streams, parts)

    decoder.windows = held
    try:
        yield busy, release, batches
    finally:
        del decoder.windows


def test_a_chunk_cancelled_while_queued_is_dropped_and_its_batch_decodes_on(runner):
    """A client gone while its chunk waits: its job is dropped (its future cancelled), the chunks
    decoded with it get the samples each stream makes alone, and after ``stop`` a decode fails
    at once instead of waiting for a thread that is gone."""
    from triton_omni.speech.codec import Code2WavBatcher

    decoder = runner.decoder
    batcher = Code2WavBatcher(decoder)
    generator = torch.Generator().manual_seed(7)
    codes = [torch.randint(0, 32, (runner.talker.groups, 8), generator=generator) for _ in range(4)]
    expected = [decoder.stream().add(c) for c in codes]
    try:
        with first_batch_held(decoder) as (busy, release, _):
            first = batcher.decode(decoder.stream(), codes[0])
            assert busy.wait(30)
            queued = [batcher.decode(decoder.stream(), c) for c in codes[1:]]
            assert queued[1].cancel()
            release.set()
            results = [first.result(30), queued[0].result(30), queued[2].result(30)]
    finally:
        batcher.stop()
    assert queued[1].cancelled() and batcher.max_batch_seen == 2  # the two left of the three queued
    for samples, wanted in zip(results, [expected[0], expected[1], expected[3]], strict=True):
        assert samples.shape == wanted.shape and np.abs(samples - wanted.numpy()).max() < 1e-5
    with pytest.raises(RuntimeError, match="shutting down"):
        batcher.decode(decoder.stream(), codes[0]).result(1)


def test_urgent_chunks_queued_behind_a_batch_are_decoded_ahead_of_the_others(runner):
    """Chunks queued while a batch decodes: the urgent ones (a stream's first) are decoded in a
    batch of their own before the rest, each still giving the samples its stream makes alone."""
    from triton_omni.speech.codec import Code2WavBatcher

    decoder = runner.decoder
    batcher = Code2WavBatcher(decoder)
    generator = torch.Generator().manual_seed(8)
    codes = [torch.randint(0, 32, (runner.talker.groups, frames), generator=generator) for frames in (8, 8, 8, 1, 2)]
    expected = [decoder.stream().add(c) for c in codes]
    try:
        with first_batch_held(decoder) as (busy, release, batches):
            first = batcher.decode(decoder.stream(), codes[0])
            assert busy.wait(30)
            queued = [batcher.decode(decoder.stream(), c, urgent=c.shape[1] < 8) for c in codes[1:]]
            release.set()
            results = [future.result(30) for future in [first, *queued]]
    finally:
        batcher.stop()
    assert batches == [[8], [1, 2], [8, 8]]
    for samples, wanted in zip(results, expected, strict=True):
        assert samples.shape == wanted.shape and np.abs(samples - wanted.numpy()).max() < 1e-5


def test_utterances_spoken_together_equal_each_alone(runner):
    first, second = request(runner), request(runner, "a small boat", (50, 51, 3), voice="chelsie")
    alone = [joined(speak(runner, r)[0]) for r in (first, second)]
    runner.batcher.max_rows_seen = 0
    both_in, submitted = threading.Event(), []
    submit = runner.batcher.submit

    def counted(utterance):  # the second's prompt is built after the first is in: the talker waits for it
        submit(utterance)
        submitted.append(utterance)
        if len(submitted) == 2:
            both_in.set()

    runner.batcher.submit = counted
    try:
        with talker_held(runner, both_in):
            together = [joined(chunks) for chunks in speak(runner, first, second)]
    finally:
        del runner.batcher.submit
    assert runner.batcher.max_rows_seen == 2
    for (audio, codes), (audio_alone, codes_alone) in zip(together, alone, strict=True):
        np.testing.assert_array_equal(codes, codes_alone)
        assert np.abs(audio - audio_alone).max() < 1e-5
    assert not np.array_equal(alone[0][1], alone[1][1][:, :alone[0][1].shape[1]])  # the inputs matter


def test_utterances_arriving_together_are_prefilled_in_one_pass_and_speak_as_each_alone(runner):
    """Three utterances (prompts of three lengths, left-padded to the longest) that arrive together
    join in one prefill; each speaks the codes it speaks alone, and its waveform within 1e-5."""
    spoken = [request(runner, "a red fox", (40, 41, 42, 43, 3)),
              request(runner, "a small boat drifts down a long and winding river at dusk", (50, 51, 3),
                      voice="chelsie"),
              request(runner, "hi", (60, 61, 62, 3))]
    alone = [joined(speak(runner, r)[0]) for r in spoken]
    batcher = runner.batcher
    joins, arrived = [], []
    join_all, submit = batcher._join_all, batcher.submit

    def together_once_all_are_here(utterance):
        arrived.append(utterance)
        if len(arrived) == len(spoken):
            with batcher._wake:  # (re-entrant) the talker's loop takes them all at once, or none
                for each in arrived:
                    submit(each)

    batcher._join_all = lambda utterances: joins.append(len(utterances)) or join_all(utterances)
    batcher.submit = together_once_all_are_here
    try:
        together = [joined(chunks) for chunks in speak(runner, *spoken)]
    finally:
        del batcher._join_all, batcher.submit
    assert joins == [3], joins
    assert len({len(u.prompt.embeds) for u in arrived}) == 3
    for (audio, codes), (audio_alone, codes_alone) in zip(together, alone, strict=True):
        np.testing.assert_array_equal(codes, codes_alone)
        assert np.abs(audio - audio_alone).max() < 1e-5


def test_a_seed_repeats_its_speech_and_another_seed_changes_it(runner):
    sampled = {"temperature": 0.9, "top_k": 50}
    first, again, other = (joined(speak(runner, request(runner, seed=seed, **sampled))[0])[1]
                           for seed in (1, 1, 2))
    np.testing.assert_array_equal(first, again)
    assert first.shape != other.shape or not np.array_equal(first, other)


@pytest.mark.parametrize(("values", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"reply_ids": []}, "reply_ids"),
    ({"text_input": " "}, "text_input"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_tokens": 20}, "min_tokens"),
])
def test_bad_requests_name_their_field(runner, values, field):
    with pytest.raises(RequestValidationError) as error:
        runner.parse({"text_input": templated("a fox"), "reply_ids": [3], **TALKER, **values})
    assert error.value.parameter == field


@pytest.mark.parametrize("name", ["chunk_frames", "first_chunk_frames"])
def test_a_chunk_default_out_of_bounds_fails_the_load_not_every_request(name):
    with pytest.raises(ValueError, match=f"model parameter {name} must be in"):
        SpeechConfig(**{name: 0})


@pytest.mark.parametrize("value", ["vae", "predictor,blocks", "thinker"])
def test_compile_naming_no_part_of_the_stage_fails_the_load(value):
    with pytest.raises(ValueError, match="model parameter compile must name parts of predictor, talker "):
        SpeechConfig(compile=value)
    assert SpeechConfig(compile=" predictor ").compile_parts() == ("predictor",)
    assert SpeechConfig(compile="predictor, talker").compile_parts() == ("predictor", "talker")
    assert SpeechConfig(compile="off").compile_parts() == ()


@pytest.fixture(params=[(), ("talker",)], ids=["layers", "compiled regions"])
def slots(runner, monkeypatch, request):
    """The runner's talker on a slot cache of 64 columns, read 16, 32 or 64 wide; its steps through
    transformers' layers, or through their width-independent regions compiled (``compile: talker``)."""
    monkeypatch.setattr(talker_graphs, "SMALLEST_WIDTH", 16)
    monkeypatch.setattr(talker_graphs, "SMALLEST_PREFILL", 16)
    eager = runner.batcher
    runner.batcher = TalkerBatcher(runner.talker, 4, cuda_graphs=False, max_len=64, slot_cache=True,
                                   compile=request.param)
    yield runner.batcher
    runner.batcher.stop()
    runner.batcher = eager


SPOKEN = [("a red fox", (40, 41, 42, 43, 3), {}),
          ("a small boat drifts down a long and winding river at dusk", (50, 51, 3), {"voice": "chelsie"}),
          ("hi", (60, 61, 62, 3), {"max_tokens": 5}),  # leaves first: the others move down a slot
          ("a tall tree", (70, 71, 3), {"max_tokens": 20})]  # joins later, on the slot that left


def test_slot_steps_speak_the_padded_steps_codes(runner, slots):
    spoken = [request(runner, prompt, reply, **options) for prompt, reply, options in SPOKEN]
    runner.batcher = TalkerBatcher(runner.talker, 4, cuda_graphs=False, slot_cache=False)  # the PaddedCache's
    try:
        alone = [joined(speak(runner, r)[0]) for r in spoken]
    finally:
        runner.batcher.stop()
        runner.batcher = slots
    joins, arrived, three_in, all_in = [], [], threading.Event(), threading.Event()
    join_all, submit = slots._join_all, slots.submit

    def first_three_together(utterance):
        arrived.append(utterance)
        if len(arrived) == 3:
            with slots._wake:
                for each in arrived:
                    submit(each)
        elif len(arrived) == 4:
            three_in.wait(timeout=30)  # (the talker's thread joins them without this loop)
            submit(utterance)
            all_in.set()

    def counted(utterances):
        joins.append(len(utterances))
        join_all(utterances)
        three_in.set()

    slots._join_all = counted
    slots.submit = first_three_together
    prefill, prefilled = slots.talker_steps.prefill, []

    def lone_prefill(embeds, *positions):
        found = prefill(embeds, *positions)
        prefilled.append((len(embeds), found is not None))
        return found

    slots.talker_steps.prefill = lone_prefill
    with talker_held(runner, all_in, after_steps=2):  # the fourth joins at the third step
        together = [joined(chunks) for chunks in speak(runner, *spoken)]
    assert joins == [3, 1], joins
    [(length, into_its_slot)] = prefilled  # the fourth joined alone: prefilled straight into its slot
    assert into_its_slot and 16 < length <= 32  # (a width above the smallest, the padding after it)
    assert slots.max_rows_seen == 4
    widths = {w for _, w in slots.talker_steps.steps}
    assert widths == {16, 32, 64}
    for (audio, codes), (audio_alone, codes_alone) in zip(together, alone, strict=True):
        np.testing.assert_array_equal(codes, codes_alone)
        assert np.abs(audio - audio_alone).max() < 1e-5
    assert max(len(u.prompt.embeds) + len(u.output_ids) for u in arrived) > 32  # the widest width was read


@pytest.mark.parametrize(("part", "attribute", "wrong"), [
    # a step's row reads one column too few: the prompt's first position hidden
    (talker_graphs.TalkerStep, "columns", lambda columns: torch.where(columns == 0, len(columns), columns)),
    # a lone prompt's prefill into its slot at positions one further on
    (talker_graphs.TalkerPrefill, "positions", lambda positions: positions + 1),
], ids=["a column short", "a prefill one position on"])
def test_a_wrong_column_or_position_moves_the_codes(runner, slots, monkeypatch, part, attribute, wrong):
    """The comparisons above can fail: a step or a lone prefill that reads the slot cache wrongly
    speaks other codes."""
    r = request(runner)
    right = joined(speak(runner, r)[0])[1]
    run = part.run

    def wrongly(self):
        kept = getattr(self, attribute)
        setattr(self, attribute, wrong(kept))
        try:
            run(self)
        finally:
            setattr(self, attribute, kept)

    monkeypatch.setattr(part, "run", wrongly)
    wrong_codes = joined(speak(runner, r)[0])[1]
    assert right.shape != wrong_codes.shape or not np.array_equal(right, wrong_codes)


def test_the_talkers_compiled_regions_step_as_its_layers_once_for_every_layer_and_width(runner, monkeypatch):
    """Steps of 4, 3 (the 4 padded), 2 and 1 rows over prompts of three lengths, across two widths:
    through the compiled regions (``compile: talker``), each row's state and logits are those of
    transformers' layers; each region compiled at most once per batch size (automatic dynamic: the
    first size, then one for all sizes but 1), shared by both layers and every width; and a row
    whose keys are wrong gets other logits (the comparison can fail)."""
    monkeypatch.setattr(talker_graphs, "SMALLEST_WIDTH", 16)
    model = runner.batcher.model
    assert len(model.model.layers) > 1  # the sharing below is across layers
    layers, regions = (talker_graphs.TalkerSteps(model, 4, 64, capture=False, compile=compiled)
                       for compiled in (False, True))
    width, generator = model.model.config.hidden_size, torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (4, 3, 2, 1):
            lengths = [14, 9, 6, 3][:rows]
            mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
            cache = DynamicCache()
            model.model(inputs_embeds=torch.randn(rows, max(lengths), width, generator=generator), attention_mask=mask,
                        past_key_values=cache, use_cache=True)
            for steps in (layers, regions):
                steps.cache.clear()
                steps.cache.add_rows(cache, mask)
            for _ in range(6):  # the longest crosses from width 16 to 32
                inputs = torch.randn(rows, 1, width, generator=generator)
                (hidden, logits), (hidden_compiled, logits_compiled) = layers(inputs), regions(inputs)
                torch.testing.assert_close(logits_compiled, logits)
                torch.testing.assert_close(hidden_compiled, hidden)
        assert max(regions.cache.lengths) > 16
        for keys in layers.cache.keys:  # row 0's keys of its prompt, wrong
            keys[0, :, :3] = 0
        inputs = torch.randn(1, 1, width, generator=generator)
        (_, wrong), (_, logits_compiled) = layers(inputs), regions(inputs)
    compiled = regions.regions
    for region in (compiled.before, compiled.after):  # 2 or 3 as the sizes came (1, 2, 4 or 4, 2, 1); per layer, 6
        variants = torch._dynamo.eval_frame._debug_get_cache_entry_list(region._torchdynamo_orig_callable.__code__)
        assert 1 <= len(variants) <= 3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits_compiled, wrong)


def test_a_rows_experts_run_as_reductions_and_give_the_blocks_output(runner, monkeypatch):
    """A step of one row (``talker_regions.FEW_ROWS``) runs the MoE block's chosen experts as
    reductions over their weights (``_chosen_experts``), two rows as the model's
    ``experts_implementation``: each gives transformers' block's output, and a row routed to other
    experts gets another (the comparison can fail)."""
    block = runner.batcher.model.model.layers[0].mlp
    reduced, forward = [], talker_regions._chosen_experts

    def counted(*args):
        reduced.append(args[1].shape[0])
        return forward(*args)

    monkeypatch.setattr(talker_regions, "_chosen_experts", counted)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (2, 1):
            hidden = torch.randn(rows, 1, block.experts.gate_up_proj.shape[-1], generator=generator)
            right = block(hidden)
            torch.testing.assert_close(talker_regions._moe(block, hidden), right)
        assert reduced == [1]
        route = block.gate.forward
        others = block.experts.num_experts
        monkeypatch.setattr(block.gate, "forward", lambda x: (*route(x)[:2], (route(x)[2] + 1) % others))
        rerouted = talker_regions._moe(block, hidden)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(rerouted, right)


def with_image(runner, prompt: str = "what is it", reply: tuple[int, ...] = (40, 41, 42, 43, 3), **options):
    """A request whose prompt holds an image of 2 x 2 tokens at the start of its user turn, as ``ar``
    hands it on: the prompt's ids, the thinker's states at the image (random here) and its rotary
    positions (the image's tokens at their rows and columns, the text after them one past the largest)."""
    thinker = runner.talker.config.thinker_config
    ids = runner.prompt_ids(templated(prompt))
    start = 4  # <|im_start|> user \n <|vision_start|>, then the image
    vision_start, vision_end = runner.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    ids = ids[:3] + [vision_start] + [thinker.image_token_id] * 4 + [vision_end] + ids[3:]
    positions = np.stack([np.arange(len(ids))] * 3)
    positions[:, start:start + 4] = start + np.array([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]])
    positions[:, start + 4:] -= 2  # the text after it from start + 2 on
    states = torch.randn(4, thinker.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    return runner.parse({"text_input": templated(prompt), "reply_ids": list(reply), "prompt_ids": ids,
                         "heard_states": states, "prompt_positions": positions, **(TALKER | options)})


def test_slot_steps_speak_a_prompt_with_an_image_as_the_padded_steps_do(runner, slots):
    """A prompt whose rotary positions are not its columns (an image's rows and columns, the steps after
    it shifted): prefilled alone into its slot, or joining beside a text prompt, the slot cache's steps
    speak the padded cache's codes; and its positions move them (the comparison can fail)."""
    seen, text = with_image(runner, max_tokens=20, min_tokens=20), request(runner, "a small boat", (50, 51, 3))
    alone_in_slot = joined(speak(runner, seen)[0])[1]
    together = [joined(chunks)[1] for chunks in speak(runner, seen, text)]
    runner.batcher = TalkerBatcher(runner.talker, 4, cuda_graphs=False, slot_cache=False)  # the PaddedCache's
    try:
        padded, padded_text = (joined(chunks)[1] for chunks in speak(runner, seen, text))
        plain = joined(speak(runner, replace(seen, positions=None))[0])[1]
    finally:
        runner.batcher.stop()
        runner.batcher = slots
    for codes in (alone_in_slot, together[0]):
        np.testing.assert_array_equal(codes, padded)
    np.testing.assert_array_equal(together[1], padded_text)
    assert not np.array_equal(plain, padded)


def test_prompt_positions_are_refused_by_name_unless_they_number_prompt_ids(runner):
    seen = with_image(runner)
    for positions in (np.zeros((2, len(seen.prompt_ids)), np.int64), np.zeros((3, 4), np.int64),
                      np.full((3, len(seen.prompt_ids)), -1)):
        with pytest.raises(RequestValidationError) as error:
            runner.parse({"text_input": seen.prompt, "reply_ids": seen.reply_ids, "prompt_ids": seen.prompt_ids,
                          "heard_states": seen.heard, "prompt_positions": positions})
        assert error.value.parameter == "prompt_positions"
    with pytest.raises(RequestValidationError, match="comes with prompt_ids") as error:
        runner.parse({"text_input": seen.prompt, "reply_ids": seen.reply_ids, "prompt_positions": seen.positions})


def test_talker_max_len_bounds_a_default_max_tokens_and_refuses_a_given_one(runner):
    config = runner.config
    prompt = len(runner.talker.prompt(runner.prompt_ids(request(runner).prompt), [40, 41, 42, 43, 3], "ethan").embeds)
    runner.config = replace(config, talker_max_len=prompt + 4)
    try:
        default = request(runner, max_tokens=None, min_tokens=4)  # no end of speech before the bound
        assert not default.max_tokens_given
        chunks = speak(runner, default)[0]
        assert chunks[-1].finish_reason == "length" and joined(chunks)[1].shape[1] == 3  # 4 codes, the last unspoken
        with pytest.raises(RequestValidationError) as error:
            speak(runner, request(runner, max_tokens=5, min_tokens=0))
        assert error.value.parameter == "max_tokens" and "at most 4" in str(error.value)
        runner.config = replace(config, talker_max_len=prompt)
        with pytest.raises(RequestValidationError) as error:
            speak(runner, default)
        assert error.value.parameter == "text_input"
    finally:
        runner.config = config


def test_a_talker_max_len_below_two_fails_the_load():
    with pytest.raises(ValueError, match="talker_max_len must be at least 2"):
        SpeechConfig(talker_max_len=1)


@pytest.mark.parametrize("slot_cache", [False, True])
def test_a_reply_still_being_written_speaks_as_the_whole_reply(runner, tmp_path, slot_cache):
    """The thinker's reply reaching the talker a token at a time, slower than it steps (it waits,
    alone and beside an utterance whose reply is whole): the codes and waveform of the whole reply
    given at once, on either KV cache."""
    reply = (40, 41, 42, 43, 44, 45, 46, 3)
    whole = request(runner, reply=reply, min_tokens=12)
    first = request(runner, reply=reply[:1], min_tokens=12)
    other = request(runner, "a small boat", (50, 51, 3), voice="chelsie")
    eager, runner.batcher = runner.batcher, TalkerBatcher(runner.talker, 4, cuda_graphs=False, max_len=256,
                                                          slot_cache=slot_cache)
    try:
        alone = [joined(speak(runner, r)[0]) for r in (whole, other)]
        writer = ReplyWriter(tmp_path)

        async def written_slowly():
            for token in reply[1:]:
                await asyncio.sleep(0.03)  # a step takes a few ms here: the talker waits for each token
                writer.add([token])
            writer.end()

        async def spoken():
            chunks: list[list] = [[], []]
            await asyncio.gather(runner.speak(first, chunks[0].append, ReplyReader(writer.name, tmp_path)),
                                 runner.speak(other, chunks[1].append), written_slowly())
            return chunks

        together = [joined(chunks) for chunks in runner.loop.run(spoken())]
        waits = runner.batcher.waits
    finally:
        runner.batcher.stop()
        runner.batcher = eager
    for (audio, codes), (audio_alone, codes_alone) in zip(together, alone, strict=True):
        np.testing.assert_array_equal(codes, codes_alone)
        assert np.abs(audio - audio_alone).max() < 1e-5
    assert waits > 0


def test_replies_written_together_speak_as_each_whole_and_a_bad_one_fails_alone(runner, tmp_path):
    """Two replies written at once (each poll projects every reply's new tokens in one pass) speak as
    their whole replies; a third, whose thinker wrote an id past the embedding table, is cancelled
    alone, the others never failing in its pass."""
    replies = [(40, 41, 42, 43, 44, 3), (50, 51, 52, 53, 3), (60, 61, 10**6, 62, 3)]
    whole = [joined(speak(runner, request(runner, reply=reply, min_tokens=10))[0]) for reply in replies[:2]]
    writers = [ReplyWriter(tmp_path) for _ in replies]

    async def written_together():
        for index in range(1, max(len(reply) for reply in replies)):
            await asyncio.sleep(0.02)
            for writer, reply in zip(writers, replies, strict=True):
                if index < len(reply):
                    writer.add([reply[index]])
        for writer in writers:
            writer.end()

    async def spoken():
        chunks: list[list] = [[], [], []]
        speaking = [runner.speak(request(runner, reply=reply[:1], min_tokens=10), chunks[i].append,
                                 ReplyReader(writer.name, tmp_path))
                    for i, (reply, writer) in enumerate(zip(replies, writers, strict=True))]
        outcomes = await asyncio.gather(*speaking, written_together(), return_exceptions=True)
        return chunks, outcomes

    chunks, outcomes = runner.loop.run(spoken())
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], RequestCancelledError), outcomes
    for spoken_now, (audio, codes) in zip(chunks[:2], whole, strict=True):
        np.testing.assert_array_equal(joined(spoken_now)[1], codes)
        assert np.abs(joined(spoken_now)[0] - audio).max() < 1e-5


def test_an_aborted_reply_ends_its_speech(runner, tmp_path):
    """The thinker failed (the scheduler wrote ``abort``): the utterance ends, cancelled."""
    writer = ReplyWriter(tmp_path)

    async def aborted():
        chunks: list = []

        async def abort_soon():
            await asyncio.sleep(0.05)
            writer.remove()

        await asyncio.gather(runner.speak(request(runner, reply=(40,), min_tokens=12), chunks.append,
                                          ReplyReader(writer.name, tmp_path)), abort_soon())
        return chunks

    with pytest.raises(RequestCancelledError):
        runner.loop.run(aborted())
    assert not runner._following  # the reply no longer followed


@pytest.mark.parametrize(("inputs", "field", "says"), [
    ({"reply_ids": [40, 10**6]}, "reply_ids", "outside the thinker's vocabulary"),
    ({"reply_ids": [40, -1]}, "reply_ids", "outside the thinker's vocabulary"),
    ({"prompt_ids": [3, 10**6]}, "prompt_ids", "outside the thinker's vocabulary"),
    ({"prompt_ids": [3] * 6000}, "prompt_ids", "more than this model's talker_max_len"),
    ({"heard_states": torch.zeros(2, 4)}, "heard_states", "comes with prompt_ids"),
    ({"prompt_ids": [40, 41], "heard_states": torch.zeros(2, 4)}, "heard_states", "holds 2 states for the 0 audio"),
])
def test_ids_the_talker_cannot_read_are_refused_by_name(runner, inputs, field, says):
    """An id past the thinker's embedding table would fail the device (and every request after it),
    not the request: refused when the request is read, naming its input."""
    with pytest.raises(RequestValidationError, match=says) as error:
        runner.parse({"text_input": templated("a red fox"), "reply_ids": [40, 41], **TALKER, **inputs})
    assert error.value.parameter == field
