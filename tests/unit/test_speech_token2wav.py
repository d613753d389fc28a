"""Qwen2.5-Omni's ``token2wav`` streamed (``StreamingToken2Wav``) against the model's own decode of
the whole code sequence, on the tiny demo: the same samples whatever the codes' arrival, the
first of them out before the last code; and a test that can fail: the demo's DiT made to mix its
frames (its attention and gates scaled, as ``benchmarks/records/research/qwen25_token2wav_chunks.py``
measures), where a stream with no context either side of its blocks is far from the whole decode
and one with the default context is not."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2_5OmniForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.speech.token2wav import StreamingToken2Wav

CODES = 70
ARRIVALS = [1, 5, 13, 7, 20, 11, 13]  # codes a batch, as a talker's steps hand them on; 70 in all
SCALED = ("to_q", "to_k", "to_v", "to_out", "attn_norm.linear")
STEPS = 4  # ODE time points (generate's default is 10; as the demo's own test, fewer on a CPU)
TOLERANCE = 1e-5  # of full scale; the demo's samples peak near 0.18


@pytest.fixture(scope="module")
def model():
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(resolve_model("demo:tiny-qwen2.5-omni")).eval()


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 60, (1, CODES), generator=torch.Generator().manual_seed(1))


def whole(token2wav, speaker, codes, seed: int = 7) -> torch.Tensor:
    """The model's own decode, its noise from the global generator seeded as a user seeds ``generate``."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return token2wav(codes, conditioning=speaker["cond"].float(), reference_mel=speaker["ref_mel"].float(),
                         num_steps=STEPS).flatten()


def streamed(decoder, speaker, codes, seed: int = 7) -> list[torch.Tensor]:
    stream = decoder.stream(speaker["cond"].float(), speaker["ref_mel"].float(), torch.Generator().manual_seed(seed))
    ids, parts, start = codes[0].tolist(), [], 0
    for count in ARRIVALS:
        parts.append(stream.add(ids[start:start + count], final=start + count == len(ids)))
        start += count
    return parts


def test_a_stream_gives_the_whole_decodes_samples_the_first_before_the_last_code(model, codes):
    speaker = model.speaker_map["Chelsie"]
    decoder = StreamingToken2Wav(model.token2wav, num_steps=STEPS)
    expected = whole(model.token2wav, speaker, codes)
    parts = streamed(decoder, speaker, codes)
    got = torch.cat(parts)
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < TOLERANCE
    assert len(parts[-2]) > 0 and sum(map(len, parts[:-1])) > len(expected) // 4  # audio before the last code
    other = whole(model.token2wav, speaker, codes, seed=8)  # other noise: far past the tolerance
    assert float((other - expected).abs().max()) > 1000 * TOLERANCE


def test_the_context_either_side_of_a_block_is_what_makes_it_the_whole_decodes(model, codes):
    mixing = copy.deepcopy(model.token2wav)
    with torch.no_grad():
        for name, weight in mixing.code2wav_dit_model.named_parameters():
            if weight.dim() == 2 and any(part in name for part in SCALED):
                weight.mul_(10.0)
    speaker = model.speaker_map["Ethan"]
    expected = whole(mixing, speaker, codes)
    apart = {blocks: float((torch.cat(streamed(StreamingToken2Wav(mixing, blocks, num_steps=STEPS), speaker, codes))
                            - expected).abs().max()) for blocks in (0, 2)}
    # measured: 2.7e-7 with two blocks either side, 1.5e-4 with none (at 10 steps)
    assert apart[2] < TOLERANCE and apart[0] > 10 * TOLERANCE, apart


def test_streams_decoded_together_give_each_stream_s_own_samples_in_fewer_dit_runs(model):
    """Three utterances (two voices, other codes and seeds) whose chunks arrive together: one round a
    batch of their chunks (``decode_round``), the DiT's windows of one length stacked into one ODE and
    the vocoder's into one run; each stream's samples are those it decodes alone, and the DiT and the
    vocoder ran fewer times than once a window."""
    decoder = StreamingToken2Wav(model.token2wav, num_steps=STEPS)
    voices = ["Chelsie", "Ethan", "Chelsie"]
    codes = [torch.randint(0, 60, (CODES,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2, 3)]

    def open_streams():
        return [decoder.stream(model.speaker_map[v]["cond"].float(), model.speaker_map[v]["ref_mel"].float(),
                               torch.Generator().manual_seed(10 + i)) for i, v in enumerate(voices)]

    batches, vocoded = [], []  # the rows of each DiT run, of each vocoder run
    plain_mel, plain_samples = decoder.mel, decoder.samples

    def counted(codes_batch, *args):
        batches.append(codes_batch.shape[0])
        return plain_mel(codes_batch, *args)

    def counted_samples(mel):
        vocoded.append(mel.shape[0])
        return plain_samples(mel)

    decoder.mel, decoder.samples = counted, counted_samples
    alone = []
    for stream, ids in zip(open_streams(), codes, strict=True):
        parts, start = [], 0
        for count in ARRIVALS:
            parts.append(stream.add(ids[start:start + count], final=start + count == len(ids)))
            start += count
        alone.append(torch.cat(parts))
    runs_alone, batches, vocoder_runs_alone, vocoded = len(batches), [], len(vocoded), []
    streams, together, start = open_streams(), [[] for _ in voices], 0
    for count in ARRIVALS:
        final = start + count == CODES
        results = decoder.decode_round([(stream, ids[start:start + count], final)
                                        for stream, ids in zip(streams, codes, strict=True)])
        for parts, samples in zip(together, results, strict=True):
            parts.append(samples)
        start += count
    for mine, expected in zip(together, alone, strict=True):
        got = torch.cat(mine)
        assert got.shape == expected.shape and float((got - expected).abs().max()) < TOLERANCE
    assert max(batches) == 3 and len(batches) * 3 == runs_alone  # every window of the round in one run
    assert max(vocoded) == 3 and len(vocoded) < vocoder_runs_alone
    assert float((torch.cat(together[0]) - torch.cat(together[2])).abs().max()) > 1000 * TOLERANCE


def test_the_ode_is_transformers_runge_kutta_number_for_number(model):
    """``integrate`` (no host syncs, so that a CUDA graph can hold it) gives exactly the numbers of
    transformers' ``RungeKutta4ODESolver``, which ``sample`` runs; one time point fewer does not."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver
    from triton_omni.speech.token2wav import integrate

    decoder = StreamingToken2Wav(model.token2wav, num_steps=STEPS)
    speaker = model.speaker_map["Chelsie"]
    codes = torch.randint(0, 60, (2, 24), generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, 24 * decoder.repeats, decoder.mel_bins, generator=torch.Generator().manual_seed(2))
    conditioning = speaker["cond"].float().expand(2, -1)
    reference = speaker["ref_mel"].float().expand(2, -1, -1)
    speaker_states = conditioning.unsqueeze(1).repeat(1, noise.shape[1], 1)

    def velocity(time_step, states):
        guided, null = decoder.dit(hidden_states=states, quantized_code=codes, speaker_embedding=speaker_states,
                                   condition_vector=reference, time_step=time_step, apply_cfg=True).chunk(2)
        return guided + (guided - null) * decoder.guidance_scale

    times = decoder._times(torch.device("cpu"))
    with torch.inference_mode():
        expected = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1]
        assert torch.equal(integrate(velocity, noise, times), expected)
        assert torch.equal(decoder.mel(codes, noise, conditioning, reference), expected.permute(0, 2, 1))
        assert not torch.equal(integrate(velocity, noise, times[:-1]), expected)


def test_the_ode_on_its_captured_shapes_buffers_gives_the_eager_samples(model):
    """The ODE on ``OdeGraphs``' buffers (as a GPU captures them; run as they are on a CPU): three
    streams in two voices decoded together, their windows on the batch of four that holds them, and
    each alone, give the samples the eager ODE gives; the buffers ran the usual windows (the last ones,
    of other lengths, run eagerly)."""
    from triton_omni.speech.token2wav import OdeGraphs, _Ode

    voices = ["Chelsie", "Ethan", "Chelsie"]
    codes = [torch.randint(0, 60, (CODES,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2, 3)]

    def decoded(decoder, together: bool) -> list[torch.Tensor]:
        streams = [decoder.stream(model.speaker_map[v]["cond"].float(), model.speaker_map[v]["ref_mel"].float(),
                                  torch.Generator().manual_seed(10 + i)) for i, v in enumerate(voices)]
        parts, start = [[] for _ in voices], 0
        for count in ARRIVALS:
            final = start + count == CODES
            chunks = [(stream, ids[start:start + count], final) for stream, ids in zip(streams, codes, strict=True)]
            results = decoder.decode_round(chunks) if together else [decoder.decode_round([c])[0] for c in chunks]
            for mine, samples in zip(parts, results, strict=True):
                mine.append(samples)
            start += count
        return [torch.cat(mine) for mine in parts]

    eager = StreamingToken2Wav(model.token2wav, num_steps=STEPS)
    captured = StreamingToken2Wav(model.token2wav, num_steps=STEPS)
    captured.graphs = OdeGraphs(captured, [(model.speaker_map[v]["cond"].float(), model.speaker_map[v]["ref_mel"]
                                            .float()) for v in ("Chelsie", "Ethan")], max_rows=4, capture=False)
    ran, run = [], _Ode.run

    def counted(ode):
        ran.append(ode.codes.shape)
        run(ode)

    _Ode.run = counted
    try:
        for together in (True, False):
            ran.clear()
            for mine, expected in zip(decoded(captured, together), decoded(eager, together), strict=True):
                assert mine.shape == expected.shape and float((mine - expected).abs().max()) < TOLERANCE
            first, second, _ = captured.window_codes
            rows, runs = (4, 1) if together else (1, len(voices))  # three windows on the batch of four, or alone
            assert ran == [(rows, length) for length in (first, second) for _ in range(runs)], ran
    finally:
        _Ode.run = run


def test_an_ode_runs_the_speaker_encoder_once_and_leaves_its_module_as_it_found_it(model):
    """The DiT's speaker encoder runs once an ODE, not once a pass (its output held for the passes);
    after it, the encoder's own forward is back, an instance's wrapper (another library's hook)
    included, and the model's own decode, which runs the encoder every pass, is unchanged."""
    decoder = StreamingToken2Wav(copy.deepcopy(model.token2wav), num_steps=STEPS)
    encoder = decoder.dit.input_embed.spk_encoder
    runs = []
    plain = encoder.forward

    def wrapper(condition):  # as a hook library installs one: an instance attribute
        runs.append(condition.shape[0])
        return plain(condition)

    encoder.forward = wrapper
    speaker = model.speaker_map["Chelsie"]
    codes = torch.randint(0, 60, (1, decoder.window_codes[0]), generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, codes.shape[1] * decoder.repeats, decoder.mel_bins, generator=torch.Generator())
    decoder.mel(codes, noise, speaker["cond"].float(), speaker["ref_mel"].float())
    assert runs == [2]  # once, for the guided and the unguided halves: not once for each of the passes
    assert encoder.forward is wrapper
    runs.clear()
    with torch.no_grad():
        decoder.dit.sample(speaker["cond"].float(), speaker["ref_mel"].float(), codes, num_steps=STEPS)
    assert len(runs) == 4 * (STEPS - 1)  # the model's own ODE: every pass encodes again
