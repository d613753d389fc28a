"""The tiny Qwen3-Omni: a MoE thinker, a MoE talker with its code predictor, and the causal
``code2wav`` decoder, at a tiny configuration with random weights, built offline and saved as
``Qwen3OmniMoeForConditionalGeneration.save_pretrained`` saves the real one (with its tokenizer
and chat template). Its own ``generate`` is the reference for the speech routes.

Two voices (``ethan``, ``chelsie``: the talker's speaker codes, as the real config's
``speaker_id``), four codebooks of 32 codes, 24 kHz at 1920 samples a codec frame (the real
decoder's rate; its layers are tiny)."""

from __future__ import annotations

from pathlib import Path

THINKER_WIDTH, TALKER_WIDTH = 32, 16
CODEBOOK, CODE_GROUPS = 32, 4  # the code predictor's vocabulary is one codebook; code2wav's quantizers are the groups
VOICES = ("ethan", "chelsie")
SAMPLE_RATE = 24000
# Qwen3-Omni's markers the thinker and talker read (audio, vision, and the talker's text-side markers)
MARKERS = ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|vision_start|>", "<|vision_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
# trained on until the role names are one token each, as in Qwen's tokenizer (the talker finds the
# user turns by the token after <|im_start|>)
ROLES = "system\nuser\nassistant\n"


def build_tiny_qwen3_omni(out: Path) -> None:
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from triton_omni.demo_models import AR_SHAPE, CHAT_TEMPLATE, amplify, build_tokenizer

    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"], chat=True, template=ROLES, markers=MARKERS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (*MARKERS, "<|im_start|>", "<|im_end|>")}
    for role in ("system", "user", "assistant"):
        [ids[role]] = tokenizer.encode(role, add_special_tokens=False)  # one token each, or the talker misreads
    assert tokenizer.chat_template == CHAT_TEMPLATE
    config = Qwen3OmniMoeConfig(**_config(len(tokenizer), ids))
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    _initialise_talker_experts(model)
    # At random init the talker is blind to its conditioning (greedy codes the same for any prompt or
    # voice) and the decoder nearly silent (about 3e-7): the talker's layers scaled by 3 and the
    # decoder's convolutions by 6, another prompt, voice or seed moves the waveform by more than half
    # of full scale at its peak (tests/unit/test_speech_demo.py holds it above 0.1)
    amplify(model.talker, 3.0)
    with torch.no_grad():
        for layer in model.code2wav.modules():
            if isinstance(layer, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
                layer.weight.mul_(6.0)
    model.thinker.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)


def _config(vocab_size: int, ids: dict[str, int]) -> dict:
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True}
    markers = {"audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
               "video_token_id": ids["<|video_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
               "vision_start_token_id": ids["<|vision_start|>"]}
    # the talker's vocabulary: a codebook, then 1024 ids its generate keeps for markers (it suppresses them
    # all but its EOS), among them the codec's own markers and the voices
    pad, bos, eos, nothink, think_bos, think_eos, *voices = range(CODEBOOK + 8, CODEBOOK + 14 + len(VOICES))
    return dict(
        thinker_config=dict(
            text_config=dict(vocab_size=vocab_size, hidden_size=THINKER_WIDTH, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_parameters=mrope,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             max_position_embeddings=1024, eos_token_id=ids["<|im_end|>"]),
            audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                              d_model=16, output_dim=THINKER_WIDTH, downsample_hidden_size=8),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=THINKER_WIDTH, patch_size=16, deepstack_visual_indexes=[0]),
            user_token_id=ids["user"], **markers),
        talker_config=dict(
            text_config=dict(vocab_size=CODEBOOK + 1024, hidden_size=TALKER_WIDTH, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             rope_parameters=mrope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, max_position_embeddings=1024),
            code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=TALKER_WIDTH, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=8, num_code_groups=CODE_GROUPS, max_position_embeddings=64),
            num_code_groups=CODE_GROUPS, thinker_hidden_size=THINKER_WIDTH, accept_hidden_layer=1,
            codec_pad_id=pad, codec_bos_id=bos, codec_eos_token_id=eos, codec_nothink_id=nothink,
            codec_think_bos_id=think_bos, codec_think_eos_id=think_eos,
            speaker_id=dict(zip(VOICES, voices, strict=True)), spatial_merge_size=2, **markers),
        code2wav_config=dict(codebook_size=CODEBOOK, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, intermediate_size=32, sliding_window=72,
                             num_quantizers=CODE_GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                             decoder_dim=32, max_position_embeddings=1024),
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"])


def _initialise_talker_experts(model) -> None:
    """transformers (5.19) initialises the thinker's MoE experts but leaves the talker's as
    ``torch.empty``: memory's leftovers, another model in every process. Drawn here, from the seed."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts

    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                module.gate_up_proj.normal_(0.0, 0.02)
                module.down_proj.normal_(0.0, 0.02)


# ``demo:<name>`` -> its builder (``demo_models.resolve_model``)
SPEECH_DEMOS = {"tiny-qwen3-omni": build_tiny_qwen3_omni}
