"""``fuse_projections`` on the tiny Qwen3-Omni: the talker's and code predictor's q/k/v one linear
layer and their dense MLPs' gate/up another. The fused model speaks the unfused one's codes and
waveform, greedy and seeded; its layers' outputs are transformers' layers' (float32), through
transformers' layers and through the compiled regions of ``compile: talker``; the code predictor's
compiled static frame (what a GPU captures) draws the unfused eager frame's codes; and a fused
layer whose keys and values trade places speaks other codes (the comparisons can fail)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from triton_omni.speech import talker_graphs
from triton_omni.speech.fused_projections import FusedMLP, fuse_projections
from triton_omni.speech.predictor_graphs import PredictorFrame, choose_codes, compiled_forward
from triton_omni.speech.runner import SpeechConfig, SpeechRunner
from triton_omni.speech.talker import _PREDICTOR_SAMPLED

from tests.support.ar_runner import spoken

REQUEST = {"text_input": "<|im_start|>user\na red fox<|im_end|>\n<|im_start|>assistant\n",
           "reply_ids": [40, 41, 42, 43, 3], "temperature": 0.0, "max_tokens": 12, "min_tokens": 3}
SPOKEN = [{}, {"temperature": 0.9, "seed": 3, "max_tokens": 16}]


@pytest.fixture(scope="module")
def runners():
    unfused, fused = (SpeechRunner(SpeechConfig(fuse_projections=parts)) for parts in ("off", "true"))
    yield unfused, fused
    unfused.close()
    fused.close()


def test_every_attention_and_dense_mlp_is_fused(runners):
    model = runners[1].batcher.model
    attentions = [layer.self_attn for layer in [*model.model.layers, *model.code_predictor.model.layers]]
    assert all(hasattr(a, "qkv_proj") and not hasattr(a, "q_proj") for a in attentions)
    assert all(isinstance(layer.mlp, FusedMLP) for layer in model.code_predictor.model.layers)
    assert all(isinstance(layer.mlp.shared_expert, FusedMLP) for layer in model.model.layers)


@pytest.mark.parametrize("parts", [("predictor",), ("talker",)])
def test_each_part_fuses_its_own_layers_alone(runners, parts):
    """``fuse_projections: predictor`` (the default) fuses the code predictor's layers and leaves the
    talker's own as transformers has them; ``talker`` the other way round."""
    model = runners[0].batcher.model
    unfuse = fuse_projections(model, parts)
    try:
        for part, layers in (("talker", model.model.layers), ("predictor", model.code_predictor.model.layers)):
            fused = [hasattr(layer.self_attn, "qkv_proj") for layer in layers]
            mlps = [isinstance(layer.mlp if part == "predictor" else layer.mlp.shared_expert, FusedMLP)
                    for layer in layers]
            assert fused == mlps == [part in parts] * len(layers), part
    finally:
        unfuse()
    assert not any(isinstance(m, FusedMLP) for m in model.modules())


@pytest.mark.parametrize("options", SPOKEN, ids=["greedy", "seeded"])
def test_the_fused_talker_speaks_the_unfused_codes(runners, options):
    (audio, codes), (fused_audio, fused_codes) = (spoken(r, REQUEST | options) for r in runners)
    assert codes.shape[1] >= 3
    np.testing.assert_array_equal(fused_codes, codes)
    assert np.abs(fused_audio - audio).max() < 1e-5


def test_keys_and_values_trading_places_speak_other_codes(runners):
    fused = runners[1]
    right = spoken(fused, REQUEST)[1]
    attentions = [layer.self_attn for layer in fused.batcher.model.model.layers]
    weights = [a.qkv_proj.weight for a in attentions]
    kept = [w.clone() for w in weights]
    try:
        with torch.no_grad():
            for attention, weight in zip(attentions, weights, strict=True):
                queries, keys, _ = attention.qkv_widths
                weight[queries:] = torch.cat([weight[queries + keys:], weight[queries:queries + keys]])
        wrong = spoken(fused, REQUEST)[1]
    finally:
        with torch.no_grad():
            for weight, original in zip(weights, kept, strict=True):
                weight.copy_(original)
    assert wrong.shape != right.shape or not np.array_equal(wrong, right)


@pytest.mark.parametrize("compiled", [False, True], ids=["layers", "compiled regions"])
def test_fused_talker_steps_are_transformers_layers_steps(runners, monkeypatch, compiled):
    """A model fused then unfused (``fuse_projections``' undo, what the benchmark measures both
    with): its slot-cache steps fused, through transformers' layers or the compiled regions, give
    the unfused layers' states and logits."""
    monkeypatch.setattr(talker_graphs, "SMALLEST_WIDTH", 16)
    model = runners[0].batcher.model
    width, generator = model.model.config.hidden_size, torch.Generator().manual_seed(0)
    rows, lengths = 3, [9, 6, 3]
    mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
    prompts = torch.randn(rows, max(lengths), width, generator=generator)
    inputs = [torch.randn(rows, 1, width, generator=generator) for _ in range(4)]

    def stepped(steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = DynamicCache()
        model.model(inputs_embeds=prompts, attention_mask=mask, past_key_values=cache, use_cache=True)
        steps.cache.add_rows(cache, mask)
        return [steps(x) for x in inputs]

    with torch.inference_mode():
        unfused = stepped(talker_graphs.TalkerSteps(model, 4, 64, capture=False))
        unfuse = fuse_projections(model)
        try:
            fused = stepped(talker_graphs.TalkerSteps(model, 4, 64, capture=False, compile=compiled))
        finally:
            unfuse()
    assert hasattr(model.model.layers[0].self_attn, "q_proj")  # put back
    for (hidden, logits), (fused_hidden, fused_logits) in zip(unfused, fused, strict=True):
        torch.testing.assert_close(fused_logits, logits)
        torch.testing.assert_close(fused_hidden, hidden)


def test_the_fused_compiled_frame_draws_the_unfused_frames_codes(runners):
    """The code predictor's static frame (what a GPU captures), compiled over the fused predictor:
    the unfused eager frame's codes for greedy rows and, given the same noise, for sampled ones."""
    sampled = [_PREDICTOR_SAMPLED.temperature, _PREDICTOR_SAMPLED.top_k, _PREDICTOR_SAMPLED.top_p,
               _PREDICTOR_SAMPLED.min_p]
    (unfused, fused), groups = (r.batcher.model.code_predictor for r in runners), runners[0].talker.groups
    generator = torch.Generator().manual_seed(2)
    hidden, first = (torch.randn(4, 1, unfused.config.hidden_size, generator=generator) for _ in range(2))
    noise = torch.empty(4, groups - 1, unfused.config.vocab_size).exponential_(1, generator=generator)
    greedy = torch.tensor([True, False, False, True])

    def frame_codes(frame: PredictorFrame) -> tuple[torch.Tensor, torch.Tensor]:
        frame.hidden[:], frame.first[:], frame.noise[:], frame.greedy[:] = hidden, first, noise, greedy
        return frame.run()

    codes, total = frame_codes(PredictorFrame(unfused, groups, 4, sampled))
    compiled = PredictorFrame(fused, groups, 4, sampled, compiled_forward(fused.model), torch.compile(choose_codes))
    fused_codes, fused_total = frame_codes(compiled)
    assert fused_codes.tolist() == codes.tolist()
    torch.testing.assert_close(fused_total, total)


def test_a_qwen25_talker_ignores_it():
    runner = SpeechRunner(SpeechConfig(model="demo:tiny-qwen2.5-omni", fuse_projections="true"))
    try:
        assert not any(isinstance(m, FusedMLP) for m in runner.batcher.model.modules())
    finally:
        runner.close()


def test_the_model_parameter_reaches_the_runner():
    from tests.support import fake_pb_utils

    fake_pb_utils.install()
    from triton_omni.triton.speech_io import runner_config

    def parsed(parameters: dict) -> SpeechConfig:
        config = {"name": "speech", "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
        return runner_config(config, {"model_instance_kind": "KIND_CPU"})[0]

    assert parsed({}).fused_parts() == ("predictor",)  # the default: the code predictor's alone
    assert parsed({"fuse_projections": "true"}).fused_parts() == ("predictor", "talker")
    assert parsed({"fuse_projections": "talker"}).fused_parts() == ("talker",)
    assert parsed({"fuse_projections": "off"}).fused_parts() == ()
    assert parsed({"fuse_projections": "false"}).fused_parts() == ()
    with pytest.raises(ValueError, match=r"fuse_projections must name parts of predictor, talker.*'predicter'"):
        parsed({"fuse_projections": "predicter"})
