"""The tiny Qwen-Omni demos (``demo:tiny-qwen3-omni``, ``demo:tiny-qwen2.5-omni``, built locally):
each model's own ``generate`` makes text and a 24 kHz waveform, the same twice for the same
inputs, and another prompt, voice or seed each moves the waveform far past what a parity check
of the served speech will allow. Measured on the built demos: Qwen3-Omni's changes are 0.69 to
0.84 of full scale at their peak; Qwen2.5-Omni's change the waveform's length (its talker stops
elsewhere), and where they overlap, its samples by 0.12 to 0.15. This holds each above 0.1, or
another length."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.speech.demos import CODEC_EOS, CODEC_PAD, VOICES, VOICES_25

PROMPT = "a red fox"
# per demo: its class, its voices, and what its generate needs beyond the prompt and the voice
DEMOS = {
    "qwen3-omni": (Qwen3OmniMoeForConditionalGeneration, VOICES,
                   lambda tokenizer: {"thinker_eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                      "talker_max_new_tokens": 12, "talker_min_new_tokens": 3}),
    # the tiny talker's codec markers (the real ones' ids are past its vocabulary); 4 ODE steps of 10
    "qwen2.5-omni": (Qwen2_5OmniForConditionalGeneration, VOICES_25,
                     lambda tokenizer: {"talker_eos_token_id": [CODEC_PAD, CODEC_EOS], "talker_max_new_tokens": 24,
                                        "talker_min_new_tokens": 4, "token2wav_num_steps": 4}),
}


@pytest.fixture(scope="module", params=list(DEMOS))
def demo(request):
    folder = resolve_model(f"demo:tiny-{request.param}")
    cls, voices, options = DEMOS[request.param]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, cls.from_pretrained(folder).eval(), voices, options(tokenizer)


def speak(demo, prompt: str = PROMPT, voice: int = 0, seed: int | None = None) -> tuple[str, torch.Tensor]:
    """The reply's text and waveform from the model's own generate: greedy, or sampled from ``seed``."""
    tokenizer, model, voices, options = demo
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = tokenizer(text, return_tensors="pt")
    torch.manual_seed(seed or 0)
    ids, wav = model.generate(**inputs, speaker=voices[voice], thinker_max_new_tokens=8, thinker_do_sample=False,
                              talker_do_sample=seed is not None, **options)
    return tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:]), wav.flatten()


def apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two waveforms; infinite for two lengths."""
    return float((a - b).abs().max()) if len(a) == len(b) else float("inf")


def test_the_demo_speaks_the_same_twice_and_each_input_moves_its_waveform(demo):
    text, wav = speak(demo)
    assert text and wav.dtype == torch.float32 and 0.05 < float(wav.abs().max()) <= 1.0
    again = speak(demo)
    assert again[0] == text and torch.equal(again[1], wav)
    moved = {"prompt": apart(wav, speak(demo, "a small boat on a calm lake")[1]),
             "voice": apart(wav, speak(demo, voice=1)[1]),
             "seed": apart(speak(demo, seed=1)[1], speak(demo, seed=2)[1])}
    assert all(peak > 0.1 for peak in moved.values()), moved


def test_the_realistic_builder_writes_what_the_speech_stage_and_the_thinker_load(tmp_path):
    """``demo:realistic-qwen3-omni``'s builder, run at the tiny shapes (the real ones are 35 B
    parameters, for a GPU): its folder holds the speech stage's parts and nothing more of the
    thinker than its embedding table; the speech stage loads them strictly, the thinker's causal
    LM folder is taken from it, and the whole model built in memory has the saved parts' shapes."""
    from transformers import AutoConfig
    from triton_omni.ar.language_model import language_model
    from triton_omni.speech.demos import build_qwen3_omni_in_memory, build_realistic_qwen3_omni
    from triton_omni.speech.runner import load_qwen3_speech

    build_realistic_qwen3_omni(tmp_path, shape={})
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == \
        ["code2wav.safetensors", "talker.safetensors", "thinker.safetensors"]
    talker, code2wav, embedding = load_qwen3_speech(tmp_path, AutoConfig.from_pretrained(tmp_path),
                                                    torch.device("cpu"), torch.float32)
    assert (language_model(tmp_path, tmp_path) / "config.json").exists()
    model = build_qwen3_omni_in_memory(tmp_path, "cpu")
    assert {k: v.shape for k, v in model.talker.state_dict().items()} == \
        {k: v.shape for k, v in talker.state_dict().items()}
    assert {k: v.shape for k, v in model.code2wav.state_dict().items()} == \
        {k: v.shape for k, v in code2wav.state_dict().items()}
    assert model.thinker.model.embed_tokens.weight.shape == embedding.weight.shape
    assert all(torch.isfinite(p).all() for p in model.talker.parameters())  # its experts drawn, not torch.empty


def test_the_realistic_qwen25_builder_writes_what_the_speech_stage_and_the_thinker_load(tmp_path):
    """``demo:realistic-qwen2.5-omni``'s builder, run at the tiny shapes (the real ones are 10 B
    parameters, for a GPU): the speech stage loads its parts strictly, the thinker's causal LM folder
    is taken from it and loads on the transformers engine, and the whole model built in memory has
    the saved parts' shapes and voices."""
    from transformers import AutoConfig
    from triton_omni.ar.engine_transformers import TransformersEngine
    from triton_omni.ar.language_model import language_model
    from triton_omni.speech.demos import _config_25, build_qwen2_5_omni_in_memory, build_realistic_qwen2_5_omni
    from triton_omni.speech.runner import load_qwen25_speech

    build_realistic_qwen2_5_omni(tmp_path, config_of=_config_25)
    talker, token2wav, embedding, speakers = load_qwen25_speech(tmp_path, AutoConfig.from_pretrained(tmp_path),
                                                                torch.device("cpu"), torch.float32)
    assert sorted(speakers) == list(VOICES_25)
    engine = TransformersEngine(str(language_model(tmp_path, tmp_path)), "cpu", torch.float32, max_num_seqs=1)
    try:
        assert torch.equal(engine.model.get_input_embeddings().weight, embedding.weight)
    finally:
        import asyncio

        asyncio.run(engine.shutdown())
    model = build_qwen2_5_omni_in_memory(tmp_path, "cpu")
    for built, loaded in ((model.talker, talker), (model.token2wav, token2wav)):
        assert {k: v.shape for k, v in built.state_dict().items()} == \
            {k: v.shape for k, v in loaded.state_dict().items()}
    assert sorted(model.speaker_map) == list(VOICES_25)


def test_the_realistic_qwen25_config_has_the_7bs_parts_sizes():
    """``demo:realistic-qwen2.5-omni``'s config, its parts built on the meta device (no memory): the
    thinker's language model 7.6 B parameters, the talker 1.35 B (896 wide, 24 layers: not the
    thinker-shaped 6.6 B that transformers' talker defaults give), the vision tower 0.68 B (1280
    wide, not the default's 3.1 B), the audio tower 0.64 B, ``token2wav`` 0.45 B, as the 7B's
    checkpoint holds them."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAudioEncoder,
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerTextModel,
        Qwen2_5OmniToken2WavModel,
        Qwen2_5OmniVisionEncoder,
    )
    from triton_omni.speech.demos import realistic_qwen2_5_omni_config

    ids = {"<|im_end|>": 151645, "<|vision_bos|>": 151652}
    config = realistic_qwen2_5_omni_config(151665, ids)
    with torch.device("meta"):
        sizes = {name: sum(p.numel() for p in part(config_of).parameters()) / 1e9 for name, part, config_of in (
            ("thinker", Qwen2_5OmniThinkerTextModel, config.thinker_config.text_config),
            ("talker", Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config),
            ("vision", Qwen2_5OmniVisionEncoder, config.thinker_config.vision_config),
            ("audio", Qwen2_5OmniAudioEncoder, config.thinker_config.audio_config),
            ("token2wav", Qwen2_5OmniToken2WavModel, config.token2wav_config))}
    assert 6.9 < sizes["thinker"] < 7.2, sizes  # 7.6 B with its output layer
    assert 1.3 < sizes["talker"] < 1.4, sizes
    assert 0.6 < sizes["vision"] < 0.7 and 0.6 < sizes["audio"] < 0.7, sizes
    assert 0.4 < sizes["token2wav"] < 0.5, sizes
