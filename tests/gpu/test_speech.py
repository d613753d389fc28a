"""The speech stage on a GPU, the tiny Qwen3-Omni in float32: the talker speaks what it speaks on
the CPU (its steps and its code predictor's frames replayed as CUDA graphs), and both only queue
work."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache
from triton_omni.demo_models import resolve_model
from triton_omni.speech.predictor_graphs import PredictorFrame
from triton_omni.speech.runner import SpeechConfig, SpeechRunner
from triton_omni.speech.talker import _PREDICTOR_SAMPLED
from triton_omni.speech.talker_graphs import TalkerSteps

from tests.support.host_syncs import no_host_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DEMO = "demo:tiny-qwen3-omni"


def spoken(runner: SpeechRunner, sampled: bool, chunk_frames: int = 4, prompts: tuple[str, ...] = ("a red fox",),
           ) -> list:
    """The chunks of an utterance of each prompt, spoken together (one prompt: a list of chunks)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEMO))
    options = {"temperature": 0.9, "seed": 3} if sampled else {"temperature": 0.0}
    requests = [runner.parse({"text_input": tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False),
        "reply_ids": [40, 41, 42, 43, 3], "max_tokens": 12, "min_tokens": 12, "chunk_frames": chunk_frames,
        "first_chunk_frames": chunk_frames, **options}) for prompt in prompts]
    chunks: list[list] = [[] for _ in prompts]

    async def speak():
        await asyncio.gather(*(runner.speak(r, c.append) for r, c in zip(requests, chunks, strict=True)))

    runner.loop.run(speak())
    return chunks[0] if len(prompts) == 1 else chunks


@pytest.fixture(scope="module")
def runners():
    # cuDNN's convolutions run in TF32 unless told not to (PyTorch's default): code2wav's samples would
    # then differ from the CPU's by about 1e-4 of full scale, the precision mode's, not the decoder's
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    made = {device: SpeechRunner(SpeechConfig(model=DEMO, device=device, dtype="float32"))
            for device in ("cpu", "cuda:0")}
    yield made
    for runner in made.values():
        runner.close()
    torch.backends.cudnn.allow_tf32 = tf32


def test_the_talker_speaks_on_the_gpu_the_codes_it_speaks_on_the_cpu(runners):
    """Greedy, float32: the same codec frames on both devices, and waveforms within 1e-4."""
    cpu, gpu = (spoken(runners[d], sampled=False) for d in ("cpu", "cuda:0"))
    assert [c.codes.tolist() for c in gpu] == [c.codes.tolist() for c in cpu]
    for ours, theirs in zip(gpu, cpu, strict=True):
        assert abs(ours.samples - theirs.samples).max() < 1e-4


@pytest.mark.parametrize("sampled", [False, True])
def test_the_code_predictor_never_waits_for_the_gpu(runners, sampled):
    """One frame's 15 predictor passes and their draws (sampled: top-k, top-p, a generator per
    utterance) queue their work without a host sync; the frame is read once it is whole."""
    gpu = runners["cuda:0"]
    spoken(gpu, sampled)  # warm: the first run's allocations and lazy inits may synchronise
    # the sync debug mode is the process's: one chunk, decoded (and read back) once the talker is done,
    # so that the codec thread's read of its samples is not taken for the predictor's
    with no_host_syncs(gpu.batcher, "_predict_residuals") as failures:
        chunks = spoken(gpu, sampled, chunk_frames=64)
    assert not failures, failures[0]
    assert sum(c.codes.shape[1] for c in chunks) == 11  # max_tokens 12: the last code drawn makes no frame


@pytest.fixture(scope="module", params=[("off", "off"), ("predictor", "off"), ("predictor,talker", "predictor"),
                                        ("predictor,talker", "true")],
                ids=["graphs", "compiled", "compiled talker", "fused projections"])
def bf16(request):
    """The GPU runner in bfloat16, the dtype whose talker steps are captured; with its captured
    passes under torch.compile too (the model parameter ``compile``: the predictor's frame, and the
    talker steps' regions), and with its projections fused (``fuse_projections``: the code
    predictor's, the default, or the talker's too)."""
    compile, fused = request.param
    runner = SpeechRunner(SpeechConfig(model=DEMO, device="cuda:0", dtype="bfloat16", compile=compile,
                                       fuse_projections=fused))
    yield runner
    runner.close()


def test_the_talkers_step_never_waits_for_the_gpu(bf16):
    """The talker's step (a CUDA graph's replay over the slot cache) and the frame before it (the
    code predictor's, its codes read after the step's draw) queue their work: the host reads only
    the codes drawn from its logits, with the frame's, once a step."""
    assert bf16.batcher.talker_steps is not None and bf16.batcher.talker_steps.graphs
    spoken(bf16, sampled=False)
    with no_host_syncs(bf16.batcher, "_talker_forward", "_frame_inputs") as failures:  # one chunk, decoded at the end
        chunks = spoken(bf16, sampled=False, chunk_frames=64)
    assert not failures, failures[0]
    assert sum(c.codes.shape[1] for c in chunks) == 11


def test_a_talker_prompt_and_a_replys_next_tokens_never_wait_for_the_gpu(bf16):
    """Built on the prompts' thread while the talker steps: copying their token ids must not wait
    for the steps and decodes queued on the GPU (at 64 utterances each wait was tens of ms)."""
    talker = bf16.talker
    prompt_ids = bf16.prompt_ids(AutoTokenizer.from_pretrained(resolve_model(DEMO)).apply_chat_template(
        [{"role": "user", "content": "a red fox"}], add_generation_prompt=True, tokenize=False))
    talker.prompt(prompt_ids, [40, 41], bf16.default_voice, whole=False)  # warm: lazy set-ups may synchronise
    with no_host_syncs(talker, "prompt", "reply_states") as failures:
        talker.prompt(prompt_ids, [40, 41], bf16.default_voice, whole=False)
        talker.reply_states([[42, 43], [44]])
    assert not failures, failures[0]


def same_steps_uncaptured(captured: TalkerSteps, model) -> TalkerSteps:
    """``captured``'s steps run as they are, not replayed: with its compiled regions where it has them
    (the next test holds those to transformers' layers)."""
    return TalkerSteps(model, captured.cache.writes.shape[0], captured.cache.capacity, capture=False,
                       compile=captured.regions is not None)


def test_the_talkers_lone_prefill_replays_as_run_eagerly_and_never_waits_for_the_gpu(bf16):
    """Two prompts prefilled one after the other into slots 0 and 1 (widths 64 and 256 replayed):
    each one's states and its slot's keys are those of the same prefill run eagerly, and a step
    over both reads them alike; a prompt in the wrong slot is told apart (the comparison can fail).
    The prefill queues its work without a host sync."""
    model = bf16.batcher.model
    captured = bf16.batcher.talker_steps
    assert set(captured.prefill_graphs) == set(captured.prefills) and len(captured.prefills) > 1
    eager = same_steps_uncaptured(captured, model)
    torch.manual_seed(0)
    width = model.model.config.hidden_size
    prompts = [torch.randn(n, width, device="cuda", dtype=torch.bfloat16) for n in (40, 200)]
    with torch.inference_mode():
        for steps in (captured, eager):
            steps.cache.clear()
        with no_host_syncs(captured, "prefill") as failures:
            found = [captured.prefill(prompt) for prompt in prompts]
        assert not failures, failures[0]
        for prompt, (hidden, normed) in zip(prompts, found, strict=True):
            hidden_eager, normed_eager = eager.prefill(prompt)
            torch.testing.assert_close(hidden, hidden_eager)
            torch.testing.assert_close(normed, normed_eager)
        assert captured.cache.lengths == eager.cache.lengths == [40, 200]
        for ours, theirs in zip(captured.cache.keys, eager.cache.keys, strict=True):
            torch.testing.assert_close(ours[:2, :, :200], theirs[:2, :, :200])
        with pytest.raises(AssertionError):
            torch.testing.assert_close(captured.cache.keys[0][0, :, :40], eager.cache.keys[0][1, :, :40])
        inputs = torch.randn(2, 1, width, device="cuda", dtype=torch.bfloat16)
        (_, logits), (_, logits_eager) = captured(inputs), eager(inputs)
        captured.cache.clear()
        eager.cache.clear()
    torch.testing.assert_close(logits, logits_eager)


def test_a_prompt_at_image_positions_replays_as_run_eagerly(bf16):
    """A lone prompt prefilled at positions that are not its columns (an image's 4 x 4 tokens at their
    rows and columns, the text after them shifted) and stepped with its slot's shift: the captured
    prefill and step (static buffers: the prefill's positions, the cache's shifts) give the eager
    ones' states and logits; at its columns, unshifted, the logits differ (the comparison can fail)."""
    model = bf16.batcher.model
    captured = bf16.batcher.talker_steps
    eager = same_steps_uncaptured(captured, model)
    torch.manual_seed(0)
    width = model.model.config.hidden_size
    prompt = torch.randn(40, width, device="cuda", dtype=torch.bfloat16)
    tokens = torch.arange(16, device="cuda")
    positions = torch.arange(40, device="cuda").expand(3, -1).clone()
    positions[:, 10:26] = 10 + torch.stack([tokens * 0, tokens // 4, tokens % 4])
    positions[:, 26:] -= 12  # the text after the image from 14 on: one past its largest position
    inputs = torch.randn(1, 1, width, device="cuda", dtype=torch.bfloat16)
    found = []
    with torch.inference_mode():
        for steps, at, shift in ((captured, positions, -12), (eager, positions, -12), (eager, None, 0)):
            steps.cache.clear()
            hidden, normed = steps.prefill(prompt, at)
            steps.cache.shift(0, [shift])
            found.append((hidden, normed, steps(inputs)[1]))
            steps.cache.clear()
    (hidden, normed, logits), (hidden_eager, normed_eager, logits_eager), (_, _, at_columns) = found
    torch.testing.assert_close(hidden, hidden_eager)
    torch.testing.assert_close(normed, normed_eager)
    torch.testing.assert_close(logits, logits_eager)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits_eager, at_columns)


def test_the_talkers_cuda_graphs_replay_its_steps(bf16):
    """Three rows (the graph of four replayed, a padding row) with prompts of three lengths, stepped
    across two widths: each replay's states and logits are the same step's run eagerly; a row
    whose keys at its prompt's first positions are wrong gets other logits (the comparison can fail).
    With the talker's regions compiled (fused kernels round otherwise in bfloat16), every step's
    logits and states within a tenth of how far a row given another row's state moves its logits."""
    model = bf16.batcher.model
    captured = bf16.batcher.talker_steps
    compiled = captured.regions is not None
    apart = {"logits": 0.0, "hidden": 0.0}
    eager = TalkerSteps(model, captured.cache.writes.shape[0], captured.cache.capacity, capture=False)
    torch.manual_seed(0)
    width = model.model.config.hidden_size
    lengths = [200, 120, 40]  # the longest crosses from width 256 to 512 within the steps
    prompts = torch.randn(3, max(lengths), width, device="cuda", dtype=torch.bfloat16)
    mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths], device="cuda")
    with torch.inference_mode():
        cache = DynamicCache()
        model.model(inputs_embeds=prompts, attention_mask=mask, past_key_values=cache, use_cache=True)
        for steps in (captured, eager):
            steps.cache.clear()
            steps.cache.add_rows(cache, mask)
        for _ in range(60):
            inputs = torch.randn(3, 1, width, device="cuda", dtype=torch.bfloat16)
            (hidden, logits), (hidden_eager, logits_eager) = captured(inputs), eager(inputs)
            if compiled:
                apart["logits"] = max(apart["logits"], (logits - logits_eager).abs().max().item())
                relative = (hidden - hidden_eager).abs().max() / hidden_eager.abs().max()
                apart["hidden"] = max(apart["hidden"], relative.item())
            else:
                torch.testing.assert_close(logits, logits_eager)
                torch.testing.assert_close(hidden, hidden_eager)
        assert max(captured.cache.lengths) > 256
        if not compiled:
            for keys in eager.cache.keys:  # row 0's keys of its prompt's first 100 positions, wrong
                keys[0, :, :100] = 0
        inputs = torch.randn(3, 1, width, device="cuda", dtype=torch.bfloat16)
        # compiled: row 0 given row 1's state (the tiny talker's logits hardly read its keys: the keys
        # above move them by about 0.006, under a bfloat16 step at their size)
        (_, logits), (_, moved) = captured(inputs), eager(inputs[[1, 1, 2]] if compiled else inputs)
        captured.cache.clear()
        eager.cache.clear()
    if compiled:
        wrong = (logits[0] - moved[0]).abs().max().item()
        print(f"compiled regions / transformers' layers, apart at most: {apart}; the wrong row's logits: {wrong}")
        assert apart["logits"] < wrong / 10 and apart["hidden"] < 0.05
        return
    torch.testing.assert_close(logits[1:], moved[1:])
    with pytest.raises(AssertionError):  # the tolerance above does not hide a wrong state
        torch.testing.assert_close(logits[0], moved[0])


@pytest.mark.parametrize("runner", ["float32", "bfloat16"])
def test_the_predictors_cuda_graph_replays_its_frame(runners, bf16, runner):
    """The captured frame (3 rows replay the graph of 4) draws what the same frame run eagerly
    draws, given the same noise: one call of each sampled row's generator; compiled too."""
    gpu = runners["cuda:0"] if runner == "float32" else bf16
    predictor = gpu.batcher.model.code_predictor
    assert gpu.batcher.graphs is not None
    greedy = [True, False, False]
    torch.manual_seed(0)
    hidden, first = (torch.randn(3, 1, predictor.config.hidden_size, device="cuda", dtype=predictor.dtype)
                     for _ in range(2))

    def generators():
        return [torch.Generator("cuda").manual_seed(seed) for seed in range(3)]

    codes, total = gpu.batcher.graphs(hidden, first, greedy, generators())
    sampled = _PREDICTOR_SAMPLED
    replayed, _ = gpu.batcher.graphs.frames[4]  # compiled, its forward and draw are (the CPU holds them to eager)
    frame = PredictorFrame(predictor, gpu.talker.groups, 4,
                           [sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p],
                           replayed.forward, replayed.choose)
    frame.hidden[:3], frame.first[:3] = hidden, first
    frame.greedy[:] = torch.tensor([*greedy, True])
    for row, generator in enumerate(generators()):
        if not greedy[row]:
            frame.noise[row].exponential_(1, generator=generator)
    eager_codes, eager_total = frame.run()
    assert codes.tolist() == eager_codes[:3].tolist()
    torch.testing.assert_close(total, eager_total[:3])


def test_a_captured_frame_ranking_its_top_k_draws_the_sorted_frames_codes(runners):
    """The captured frame with a top-k below the tiny codebook's (the real one ranks 50 of 2048
    codes; the tiny one has 32): each draw ranks only its top-k (``topk``), and from the same noise
    it draws the codes the whole sort draws (float32: no tied logits); other noise, other codes."""
    from triton_omni.speech.predictor_graphs import captured

    gpu = runners["cuda:0"]
    predictor = gpu.batcher.model.code_predictor
    replayed, _ = gpu.batcher.graphs.frames[4]
    sampled = [1.0, predictor.config.vocab_size // 4, 0.95, 0.0]
    ranking, sorting = (PredictorFrame(predictor, gpu.talker.groups, 4, sampled, replayed.forward, replayed.choose)
                        for _ in range(2))
    sorting.ranked = None
    assert ranking.ranked == sampled[1]
    torch.manual_seed(0)
    hidden, first = (torch.randn(4, 1, predictor.config.hidden_size, device="cuda", dtype=predictor.dtype)
                     for _ in range(2))

    def draws(frame, seed: int) -> list[list[int]]:
        frame.hidden[:], frame.first[:] = hidden, first
        frame.greedy[:] = torch.tensor([True, False, False, False])
        frame.noise.exponential_(1, generator=torch.Generator("cuda").manual_seed(seed))
        if frame is ranking:
            graph.replay()
            return frame.codes.tolist()
        return frame.run()[0].tolist()

    graph = captured(ranking.run, torch.cuda.graph_pool_handle())
    codes = draws(ranking, 1)
    assert codes == draws(sorting, 1)
    other = draws(ranking, 2)
    assert codes[0] == other[0] and codes[1:] != other[1:]


def test_streams_decoded_together_on_the_gpu_equal_each_decoded_alone(runners):
    """``Code2WavBatcher``'s way on the GPU (float32, TF32 off): streams at their first chunk, behind
    earlier frames and past the sliding window, their transformer and convolutions run together,
    give the samples each stream's own decode gives, within 1e-4 of full scale."""
    decoder = runners["cuda:0"].decoder
    generator = torch.Generator().manual_seed(5)
    plan = [(0, 2), (0, 2), (12, 8), (3, 8), (0, 8), (80, 8)]  # (frames before, frames now)
    codes = [torch.randint(0, 32, (runners["cuda:0"].talker.groups, 100), generator=generator) for _ in plan]
    alone, together = [], []
    for (before, _), stream_codes in zip(plan, codes, strict=True):
        for streams in (alone, together):
            streams.append(decoder.stream())
            if before:
                streams[-1].add(stream_codes[:, :before])
    now = [c[:, b:b + f] for c, (b, f) in zip(codes, plan, strict=True)]
    expected = [stream.add(part) for stream, part in zip(alone, now, strict=True)]
    windows = decoder.windows(together, now)
    got = [s.settle(c) for s, c in zip(together, decoder.convolve_windows(windows), strict=True)]
    for chunk, wanted, step in zip(got, expected, plan, strict=True):
        assert chunk.shape == wanted.shape and float((chunk - wanted).abs().max()) < 1e-4, step


def test_the_codec_thread_decodes_on_a_stream_of_its_own(runners):
    """The talker's reads of its codes must not wait for the decodes: the codec thread's work goes
    on its own CUDA stream, and the speech is the same."""
    gpu = runners["cuda:0"]
    streams, windows = [], gpu.decoder.windows

    def recorded(*args):
        streams.append(torch.cuda.current_stream())
        return windows(*args)

    gpu.decoder.windows = recorded
    try:
        chunks = spoken(gpu, sampled=False)
    finally:
        del gpu.decoder.windows
    assert streams and all(s != torch.cuda.default_stream() for s in streams)
    cpu = spoken(runners["cpu"], sampled=False)
    assert [c.codes.tolist() for c in chunks] == [c.codes.tolist() for c in cpu]
