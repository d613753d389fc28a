"""The code predictor's static frame (what a GPU captures as a CUDA graph, ``predictor_graphs.py``)
run eagerly on the CPU against the talker's eager predictor, on the tiny Qwen3-Omni: the same codes
for greedy rows, and for sampled rows given the same noise (drawn in the same order from the same
seeds); other noise draws other codes, so the comparison can fail. The frame compiled (the model
parameter ``compile: predictor``) draws the same codes, at two batch sizes (a recompile between)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_omni.ar.sampling import SamplingOptions
from triton_omni.speech.predictor_graphs import PredictorFrame, choose_codes, compiled_forward
from triton_omni.speech.runner import SpeechConfig, SpeechRunner
from triton_omni.speech.talker import _PREDICTOR_SAMPLED

SAMPLED = [_PREDICTOR_SAMPLED.temperature, _PREDICTOR_SAMPLED.top_k, _PREDICTOR_SAMPLED.top_p,
           _PREDICTOR_SAMPLED.min_p]
SEEDS = (None, 1, 2, None, 3)  # None: a greedy row


@pytest.fixture(scope="module")
def runner():
    runner = SpeechRunner(SpeechConfig(model="demo:tiny-qwen3-omni"))
    yield runner
    runner.close()


def rows() -> list[SimpleNamespace]:
    return [SimpleNamespace(options=SamplingOptions(temperature=0.0 if seed is None else 0.9),
                            generator=None if seed is None else torch.Generator().manual_seed(seed))
            for seed in SEEDS]


def frame_codes(runner, hidden, first, seed_offset: int = 0, frame: PredictorFrame | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The static frame's codes (``frame``, or a new one), one padding row past the batch; each
    sampled row's noise drawn draw by draw from its seed (``seed_offset``: other seeds), as the
    eager predictor draws it."""
    predictor = runner.batcher.model.code_predictor
    frame = frame or PredictorFrame(predictor, runner.talker.groups, len(SEEDS) + 1, SAMPLED)
    frame.greedy.fill_(True)
    frame.hidden[:len(SEEDS)] = hidden
    frame.first[:len(SEEDS)] = first
    frame.greedy[:len(SEEDS)] = torch.tensor([seed is None for seed in SEEDS])
    for row, seed in enumerate(SEEDS):
        if seed is not None:
            generator = torch.Generator().manual_seed(seed + seed_offset)
            for draw in range(frame.draws):
                frame.noise[row, draw].exponential_(1, generator=generator)
    codes, total = frame.run()
    return codes[:len(SEEDS)], total[:len(SEEDS)]


def test_the_static_frame_draws_the_eager_predictors_codes(runner):
    width = runner.batcher.model.code_predictor.config.hidden_size
    torch.manual_seed(0)
    hidden, first = torch.randn(len(SEEDS), 1, width), torch.randn(len(SEEDS), 1, width)
    with torch.inference_mode():
        eager_codes, eager_total = runner.batcher._predict_residuals(hidden, first, rows())
    frame = PredictorFrame(runner.batcher.model.code_predictor, runner.talker.groups, len(SEEDS) + 1, SAMPLED)
    codes, total = frame_codes(runner, hidden, first, frame=frame)
    assert codes.tolist() == eager_codes.tolist()
    torch.testing.assert_close(total, eager_total)
    # the same frame run again: its static cache starts over
    assert frame_codes(runner, hidden, first, frame=frame)[0].tolist() == eager_codes.tolist()
    # other noise: the sampled rows' codes move, the greedy rows' do not
    other = frame_codes(runner, hidden, first, seed_offset=100)[0]
    sampled = [row for row, seed in enumerate(SEEDS) if seed is not None]
    greedy = [row for row, seed in enumerate(SEEDS) if seed is None]
    assert other[greedy].tolist() == eager_codes[greedy].tolist()
    assert (other[sampled] != eager_codes[sampled]).float().mean() > 0.5


def test_the_compiled_frame_draws_the_eager_frames_codes(runner):
    predictor = runner.batcher.model.code_predictor
    width = predictor.config.hidden_size
    torch.manual_seed(1)
    hidden, first = torch.randn(len(SEEDS), 1, width), torch.randn(len(SEEDS), 1, width)
    eager = frame_codes(runner, hidden, first)
    forward, choose = compiled_forward(predictor.model), torch.compile(choose_codes)
    for rows in (len(SEEDS) + 1, len(SEEDS) + 3):  # as the GPU's ladder of frames, one compiled forward for all
        frame = PredictorFrame(predictor, runner.talker.groups, rows, SAMPLED, forward, choose)
        codes, total = frame_codes(runner, hidden, first, frame=frame)
        assert codes.tolist() == eager[0].tolist()
        torch.testing.assert_close(total, eager[1])


def test_each_compiled_pass_keeps_its_own_variants_and_one_past_the_limit_fails(monkeypatch):
    """``own_code``: two compiled copies of one function keep their variants apart (another
    runner's would otherwise fill them); inside ``compiling`` a variant past ``RECOMPILE_LIMIT``
    fails instead of running its shape eagerly."""
    from triton_omni.speech import predictor_graphs

    def double(x):
        return x * 2

    first, second = predictor_graphs.own_code(double), predictor_graphs.own_code(double)
    assert first.__code__ is not second.__code__ is not double.__code__ and first(3) == 6
    monkeypatch.setattr(predictor_graphs, "RECOMPILE_LIMIT", 2)
    compiled = torch.compile(first, backend="eager", dynamic=False)
    with predictor_graphs.compiling():
        compiled(torch.ones(1))
        compiled(torch.ones(2))
        with pytest.raises(Exception, match=r"recompile_limit|cache_size_limit|recompil"):
            compiled(torch.ones(3))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_frame_that_ranks_only_its_top_k_draws_the_codes_of_the_whole_sort(runner, compiled):
    """The frame ranks only its top-k's codes (``ranked``, a ``topk`` in place of the codebook's
    sort): the codes the whole sort draws, from the same noise, eagerly and compiled; a top-k
    below the tiny codebook's (the real one's 50 of 2048; the tiny one has 32 codes)."""
    predictor = runner.batcher.model.code_predictor
    width = predictor.config.hidden_size
    torch.manual_seed(2)
    hidden, first = torch.randn(len(SEEDS), 1, width), torch.randn(len(SEEDS), 1, width)
    top_k = predictor.config.vocab_size // 4
    sampled = [1.0, top_k, 0.95, 0.0]
    passes = (compiled_forward(predictor.model), torch.compile(choose_codes)) if compiled else (None, None)
    ranking = PredictorFrame(predictor, runner.talker.groups, len(SEEDS) + 1, sampled, *passes)
    sorting = PredictorFrame(predictor, runner.talker.groups, len(SEEDS) + 1, sampled)
    sorting.ranked = None
    assert ranking.ranked == top_k
    codes = frame_codes(runner, hidden, first, frame=ranking)[0]
    assert codes.tolist() == frame_codes(runner, hidden, first, frame=sorting)[0].tolist()
    sampled_rows = [row for row, seed in enumerate(SEEDS) if seed is not None]
    # other noise draws other codes: the comparison can fail
    other = frame_codes(runner, hidden, first, seed_offset=100, frame=ranking)[0]
    assert (other[sampled_rows] != codes[sampled_rows]).float().mean() > 0.5


def test_a_frame_without_a_top_k_ranks_the_whole_codebook(runner):
    """A top-k of 0 (``SamplingOptions``' "none") is the whole codebook, as on the eager path,
    not a top-k that keeps nothing."""
    predictor = runner.batcher.model.code_predictor
    frame = PredictorFrame(predictor, runner.talker.groups, len(SEEDS) + 1, [1.0, 0, 1.0, 0.0])
    assert frame.ranked is None and frame.params[:, 1].eq(predictor.config.vocab_size).all()
    torch.manual_seed(3)
    hidden, first = (torch.randn(len(SEEDS), 1, predictor.config.hidden_size) for _ in range(2))
    codes = frame_codes(runner, hidden, first, frame=frame)[0]
    assert codes.ge(0).all() and codes.lt(predictor.config.vocab_size).all()
