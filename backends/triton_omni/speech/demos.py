"""The tiny Qwen-Omni demos, built offline with random weights at tiny configurations and saved
as ``save_pretrained`` saves the real models (with a tokenizer and chat template); each model's
own ``generate`` is the reference for the speech routes.

- Qwen3-Omni: a MoE thinker, a MoE talker with its code predictor, and the causal ``code2wav``
  decoder. Two voices (``ethan``, ``chelsie``: the talker's speaker codes, as the real config's
  ``speaker_id``), four codebooks of 32 codes, 24 kHz at 1920 samples a codec frame (the real
  decoder's rate; its layers are tiny).
- Qwen2.5-Omni: a thinker, a talker of one codebook, and ``token2wav`` (a flow-matching DiT to a
  mel spectrogram, then BigVGAN at 240 samples a mel frame, 24 kHz). Two voices (``Chelsie``,
  ``Ethan``), each a marker token, an x-vector and a reference mel in ``spk_dict.pt``, as the
  real model ships them."""

from __future__ import annotations

from pathlib import Path

THINKER_WIDTH, TALKER_WIDTH = 32, 16
# The thinker's context: long enough that a client can leave mid-reply even on starved cores, where
# the thinker (vLLM's own busy process) writes a thousand tokens before the first reaches the client
THINKER_CONTEXT = 8192
THINKER_CONTEXT_25 = 1024  # the tiny Qwen2.5-Omni's thinker and talker positions
CODEBOOK, CODE_GROUPS = 32, 4  # the code predictor's vocabulary is one codebook; code2wav's quantizers are the groups
VOICES = ("ethan", "chelsie")
SAMPLE_RATE = 24000
# Qwen3-Omni's markers the thinker and talker read (audio, vision, and the talker's text-side markers)
MARKERS = ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|vision_start|>", "<|vision_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
# Qwen3-Omni's template as far as the demo reads it: a message's content a text, or parts (text, and
# audio and images as their markers, which the processor widens to their tokens); the rest the demo
# chat template's
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# trained on until the role names are one token each, as in Qwen's tokenizer (the talker finds the
# user turns by the token after <|im_start|>)
ROLES = "system\nuser\nassistant\n"


def build_tiny_qwen3_omni(out: Path) -> None:
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from triton_omni.demo_models import amplify

    tokenizer, ids = _qwen3_tokenizer(out)
    config = Qwen3OmniMoeConfig(**_config(len(tokenizer), ids))
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    initialise_talker_experts(model.talker)
    # At random init the talker is blind to its conditioning (greedy codes the same for any prompt or
    # voice) and the decoder nearly silent (about 3e-7): the talker's layers scaled by 3 and the
    # decoder's convolutions by 6, another prompt, voice or seed moves the waveform by more than half
    # of full scale at its peak (tests/unit/test_speech_demo.py holds it above 0.1). Its text projection
    # scaled again by 4 (its two layers: 16): the reply's tokens, read one a step, moved 1 code of 44
    # without it, 29 to 33 with it (another reply), 15 for one token changed
    amplify(model.talker, 3.0)
    amplify(model.talker.text_projection, 4.0)
    with torch.no_grad():
        for layer in model.code2wav.modules():
            if isinstance(layer, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
                layer.weight.mul_(6.0)
    # The audio tower at random init hears every clip alike: two tones (440 and 220 Hz) of one length
    # gave the same features to 1e-3 and the same reply. Its convolutions scaled by 16 and its linear
    # layers by 8, the features differ by most of their norm and so do the replies
    # (tests/unit/test_audio_input.py holds it)
    amplify(model.thinker.audio_tower, 8.0)
    with torch.no_grad():
        for layer in model.thinker.audio_tower.modules():
            if isinstance(layer, torch.nn.Conv2d):
                layer.weight.mul_(16.0)
    model.thinker.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    save_feature_extractor(out, config.thinker_config.audio_config.num_mel_bins)


def save_feature_extractor(out: Path, mel_bins: int) -> None:
    """The thinker's audio features as Qwen3-Omni's processor makes them: Whisper's log-mel at 16 kHz,
    in windows of 300 s (a clip is not cut)."""
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=16000, chunk_length=300).save_pretrained(out)


def _config(vocab_size: int, ids: dict[str, int]) -> dict:
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True}
    # the thinker's heads 64 wide: vLLM's CPU attention has no kernel for narrower ones (the ar stage serves it)
    thinker_rope = mrope | {"mrope_section": [16, 8, 8]}
    markers = {"audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
               "video_token_id": ids["<|video_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
               "vision_start_token_id": ids["<|vision_start|>"]}
    # the talker's vocabulary: a codebook, then 1024 ids its generate keeps for markers (it suppresses them
    # all but its EOS), among them the codec's own markers and the voices
    pad, bos, eos, nothink, think_bos, think_eos, *voices = range(CODEBOOK + 8, CODEBOOK + 14 + len(VOICES))
    return dict(
        thinker_config=dict(
            text_config=dict(vocab_size=vocab_size, hidden_size=THINKER_WIDTH, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                             rope_parameters=thinker_rope, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, max_position_embeddings=THINKER_CONTEXT,
                             eos_token_id=ids["<|im_end|>"]),
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


def _qwen3_tokenizer(out: Path):
    """The offline tokenizer with Qwen3-Omni's markers, saved in ``out``, and the ids the config names."""
    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"], chat=True, template=ROLES, markers=MARKERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (*MARKERS, "<|im_start|>", "<|im_end|>")}
    for role in ("system", "user", "assistant"):
        [ids[role]] = tokenizer.encode(role, add_special_tokens=False)  # one token each, or the talker misreads
    return tokenizer, ids


def initialise_talker_experts(talker) -> None:
    """transformers (5.19) initialises the thinker's MoE experts but leaves the talker's as
    ``torch.empty``: memory's leftovers, another model in every process. Drawn here, from the seed."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts

    with torch.no_grad():
        for module in talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                module.gate_up_proj.normal_(0.0, 0.02)
                module.down_proj.normal_(0.0, 0.02)


_REAL_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}
# Qwen3-Omni-30B-A3B-Instruct's shapes and codec ids, as its config.json gives them (the thinker's token
# ids stay the offline tokenizer's: _config's)
QWEN3_OMNI_30B_A3B = dict(
    thinker_config=dict(
        text_config=dict(vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, max_position_embeddings=65536,
                         rope_parameters=_REAL_ROPE),
        audio_config=dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                          d_model=1280, output_dim=2048, downsample_hidden_size=480, n_window=50,
                          n_window_infer=800, conv_chunksize=500, max_source_positions=1500),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]),
        position_id_per_seconds=13),
    talker_config=dict(
        text_config=dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
                         num_attention_heads=16, num_key_value_heads=2, head_dim=128, num_experts=128,
                         num_experts_per_tok=6, moe_intermediate_size=384, shared_expert_intermediate_size=768,
                         norm_topk_prob=True, max_position_embeddings=65536, rope_parameters=_REAL_ROPE),
        code_predictor_config=dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
                                   max_position_embeddings=32768,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        position_id_per_seconds=13,
        num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24, codec_pad_id=2148, codec_bos_id=2149,
        codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}),
    code2wav_config=dict(codebook_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=16, num_quantizers=16, sliding_window=72,
                         decoder_dim=1536, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                         max_position_embeddings=8000))


def build_realistic_qwen3_omni(out: Path, shape: dict = QWEN3_OMNI_30B_A3B) -> None:
    """Qwen3-Omni-30B-A3B at its real shapes (``shape``: another's), random weights, for GPU
    benchmarks. Saved: the config, the offline tokenizer, and what the speech stage loads (the
    talker, ``code2wav`` and the thinker's embedding table: 3.7 B parameters, 7.4 GB in bf16). The
    thinker's other 30 B are not saved (a GPU host's disk may not hold them): ``ar`` serves them with
    vLLM's ``load_format: dummy``, which draws them itself, and a direct comparison builds the whole
    model in memory (``build_qwen3_omni_in_memory``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    from triton_omni.demo_models import built_as

    tokenizer, ids = _qwen3_tokenizer(out)
    config = Qwen3OmniMoeConfig(**_merged(_config(len(tokenizer), ids), shape))
    # what is_omni and vLLM read; a config built from its class saves none
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.save_pretrained(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with built_as(device, torch.bfloat16):  # a 30 B model built in float32 first would need twice its memory
        talker = Qwen3OmniMoeTalkerForConditionalGeneration(config.talker_config)
        initialise_talker_experts(talker)
        code2wav = Qwen3OmniMoeCode2Wav(config.code2wav_config)
        text = config.thinker_config.text_config
        embedding = torch.nn.Embedding(text.vocab_size, text.hidden_size)
    for prefix, module in (("talker.", talker), ("code2wav.", code2wav), ("thinker.model.embed_tokens.", embedding)):
        tensors = {prefix + name: tensor.contiguous().cpu() for name, tensor in module.state_dict().items()}
        save_file(tensors, str(out / f"{prefix.split('.')[0]}.safetensors"), metadata={"format": "pt"})
    del talker, code2wav, embedding, tensors
    if device == "cuda":
        torch.cuda.empty_cache()  # the process that built it goes on to measure (benchmarks/speech.py)


def build_qwen3_omni_in_memory(folder: Path, device: str):
    """The whole model of a ``build_realistic_qwen3_omni`` folder on ``device`` in bf16, its weights
    drawn at random (its own generate, the direct side of a benchmark)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from triton_omni.demo_models import built_as

    config = AutoConfig.from_pretrained(folder)
    with built_as(device, torch.bfloat16):
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        initialise_talker_experts(model.talker)
    model.code2wav.float()  # as load_qwen3_speech and the model's generate run it
    model.thinker.generation_config.pad_token_id = AutoTokenizer.from_pretrained(folder).pad_token_id
    return model


def _merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` written over it, nested dicts merged key by key (but the voices,
    ``speaker_id``: another model's replace the tiny demo's)."""
    merged = dict(base)
    for key, value in changes.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict) and key != "speaker_id"
        merged[key] = _merged(base[key], value) if both else value
    return merged


# Qwen2.5-Omni's markers (its processor's names) and a voice's marker each
MARKERS_25 = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>",
              "<|vision_eos|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>")
VOICES_25 = ("Chelsie", "Ethan")
# Qwen2.5-Omni's template as far as the demo reads it (its markers' names; no default system turn)
CHAT_TEMPLATE_25 = (
    CHAT_TEMPLATE.replace("<|audio_start|><|audio_pad|><|audio_end|>", "<|audio_bos|><|AUDIO|><|audio_eos|>")
    .replace("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_bos|><|IMAGE|><|vision_eos|>"))
TALKER_VOCAB_25 = 64
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 60, 61, 62, 63
SPEAKER_WIDTH, MEL_BINS = 16, 80


def build_tiny_qwen2_5_omni(out: Path) -> None:
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

    from triton_omni.demo_models import amplify

    tokenizer, ids, voices = _qwen25_tokenizer(out)
    config = Qwen2_5OmniConfig(**_config_25(len(tokenizer), ids), enable_audio_output=True)
    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    # as the Qwen3 demo's: a talker that reads its conditioning (scaled by 3, another prompt still gave
    # the same codes; by 6, another prompt or voice another length and other samples), a decoder that is
    # heard (about 0.2 of full scale)
    amplify(model.talker, 6.0)
    with torch.no_grad():
        for layer in model.token2wav.code2wav_bigvgan_model.modules():
            if isinstance(layer, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
                layer.weight.mul_(4.0)
    # as the Qwen3 demo's audio tower, one that tells clips apart (tests/unit/test_audio_input.py holds it)
    amplify(model.thinker.audio_tower, 8.0)
    with torch.no_grad():
        for layer in model.thinker.audio_tower.modules():
            if isinstance(layer, torch.nn.Conv1d):
                layer.weight.mul_(16.0)
    model.thinker.generation_config.eos_token_id = ids["<|im_end|>"]
    model.thinker.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    speakers = {voice: {"bos_token": ids[marker], "cond": torch.randn(1, SPEAKER_WIDTH),
                        "ref_mel": torch.randn(1, 40, MEL_BINS)}
                for voice, marker in zip(VOICES_25, voices, strict=True)}
    torch.save(speakers, out / "spk_dict.pt")
    # Qwen2.5-Omni's processor's: Whisper's log-mel at 16 kHz, each clip padded to (and cut at) 300 s
    WhisperFeatureExtractor(feature_size=config.thinker_config.audio_config.num_mel_bins, sampling_rate=16000,
                            chunk_length=300).save_pretrained(out)


def _config_25(vocab_size: int, ids: dict[str, int]) -> dict:
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]}
    markers = {"audio_token_index": ids["<|AUDIO|>"], "image_token_index": ids["<|IMAGE|>"],
               "video_token_index": ids["<|VIDEO|>"], "audio_start_token_id": ids["<|audio_bos|>"],
               "audio_end_token_id": ids["<|audio_eos|>"], "vision_start_token_id": ids["<|vision_bos|>"]}
    return dict(
        thinker_config=dict(
            text_config=dict(vocab_size=vocab_size, hidden_size=THINKER_WIDTH, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=THINKER_CONTEXT_25, rope_parameters=mrope,
                             tie_word_embeddings=False,
                             eos_token_id=ids["<|im_end|>"]),
            audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                              d_model=16, output_dim=THINKER_WIDTH, n_window=100, max_source_positions=1500),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=THINKER_WIDTH, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0]),
            user_token_id=ids["user"], **markers),
        talker_config=dict(
            vocab_size=TALKER_VOCAB_25, embedding_size=THINKER_WIDTH, hidden_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=THINKER_CONTEXT_25, rope_parameters=mrope, tts_codec_pad_token_id=CODEC_PAD,
            tts_codec_start_token_id=CODEC_BOS, tts_codec_end_token_id=CODEC_EOS, tts_codec_mask_token_id=CODEC_MASK,
            tts_text_pad_token_id=ids["<|tts_pad|>"], tts_text_start_token_id=ids["<|tts_bos|>"],
            tts_text_end_token_id=ids["<|tts_eos|>"], vision_end_token_id=ids["<|vision_eos|>"], **markers),
        token2wav_config=dict(
            dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2,
                            emb_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            block_size=24, look_ahead_layers=[1], look_backward_layers=[0], repeats=2,
                            num_embeds=TALKER_VOCAB_25, mel_dim=MEL_BINS, dropout=0.0, enc_emb_dim=SPEAKER_WIDTH,
                            enc_dim=16, enc_channels=[16, 16, 16], enc_kernel_sizes=[5, 3, 1],
                            enc_dilations=[1, 2, 1], enc_attention_channels=8, enc_res2net_scale=2,
                            enc_se_channels=8),
            bigvgan_config=dict(mel_dim=MEL_BINS, upsample_initial_channel=128, resblock_kernel_sizes=[3],
                                resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                                upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])))


def _qwen25_tokenizer(out: Path):
    """The offline tokenizer with Qwen2.5-Omni's markers and its voices', saved in ``out``, and the
    ids the config names."""
    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    voices = tuple(f"<|spk_{voice.lower()}|>" for voice in VOICES_25)
    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"], chat=True, template=ROLES, markers=MARKERS_25 + voices)
    tokenizer.chat_template = CHAT_TEMPLATE_25
    tokenizer.save_pretrained(out)
    ids = {token: tokenizer.convert_tokens_to_ids(token)
           for token in (*MARKERS_25, *voices, "<|im_start|>", "<|im_end|>")}
    [ids["user"]] = tokenizer.encode("user", add_special_tokens=False)
    return tokenizer, ids, voices


# Qwen2.5-Omni-7B's shapes where transformers' config defaults are not its config.json's: the talker
# defaults to the thinker's shape (3584 wide, 28 layers: 6.6 B parameters, five times the real
# talker's 1.35 B), the vision tower to 3584 wide (3.1 B, against the real 1280-wide 0.68 B). The
# other defaults are the 7B's (the thinker's language model and audio tower, token2wav's DiT and vocoder).
QWEN25_OMNI_7B = dict(
    thinker_config=dict(vision_config=dict(hidden_size=1280)),
    talker_config=dict(hidden_size=896, intermediate_size=18944, num_hidden_layers=24, num_attention_heads=12,
                       num_key_value_heads=4, head_dim=128, embedding_size=3584))


def realistic_qwen2_5_omni_config(vocab_size: int, ids: dict[str, int], config_of=None):
    """The config of ``build_realistic_qwen2_5_omni``: the 7B's shapes (``config_of``: other arguments
    from the tokenizer's size and marker ids), the offline tokenizer's ids."""
    from transformers import Qwen2_5OmniConfig

    arguments = config_of(vocab_size, ids) if config_of else QWEN25_OMNI_7B
    config = Qwen2_5OmniConfig(**arguments, enable_audio_output=True)
    config.thinker_config.text_config.eos_token_id = ids["<|im_end|>"]
    # The 7B's config.json names it; some transformers versions' thinker config has no default,
    # and the thinker's get_rope_index reads it on every prompt.
    config.thinker_config.vision_start_token_id = ids["<|vision_bos|>"]
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]  # what is_omni reads
    return config


def build_realistic_qwen2_5_omni(out: Path, config_of=None) -> None:
    """Qwen2.5-Omni-7B at its real shapes (``realistic_qwen2_5_omni_config``), random weights, for GPU
    benchmarks. Saved: the config, the offline tokenizer, the voices, and what ``ar`` (the
    thinker's language model, 7.6 B parameters: the transformers engine loads it, the talker reads
    its states) and the speech stage (the talker, ``token2wav`` and the thinker's embedding table)
    load; not the audio and vision towers, which a text prompt never reaches (a direct comparison
    builds the whole model in memory: ``build_qwen2_5_omni_in_memory``). ``config_of``: the config's
    arguments from the tokenizer's size and marker ids, in place of the 7B's (the tests' tiny shapes)."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    from triton_omni.demo_models import built_as

    tokenizer, ids, voices = _qwen25_tokenizer(out)
    config = realistic_qwen2_5_omni_config(len(tokenizer), ids, config_of)
    config.save_pretrained(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with built_as(device, torch.bfloat16):
        thinker = Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config)
    for prefix, module in (("thinker.model.", thinker.model), ("thinker.lm_head.", thinker.lm_head)):
        tensors = {prefix + name: tensor.contiguous().cpu() for name, tensor in module.state_dict().items()
                   if not name.startswith(("audio_tower.", "visual."))}
        save_file(tensors, str(out / f"{prefix.rstrip('.').replace('.', '-')}.safetensors"), metadata={"format": "pt"})
    del thinker, tensors
    with built_as(device, torch.bfloat16):
        talker = Qwen2_5OmniTalkerForConditionalGeneration(config.talker_config)
        token2wav = Qwen2_5OmniToken2WavModel(config.token2wav_config)
    for prefix, module in (("talker.", talker), ("token2wav.", token2wav)):
        tensors = {prefix + name: tensor.contiguous().cpu() for name, tensor in module.state_dict().items()}
        save_file(tensors, str(out / f"{prefix.split('.')[0]}.safetensors"), metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(0)
    dit = config.token2wav_config.dit_config
    torch.save({voice: {"bos_token": ids[marker], "cond": torch.randn(1, dit.enc_emb_dim, generator=generator),
                        "ref_mel": torch.randn(1, 300, dit.mel_dim, generator=generator)}
                for voice, marker in zip(VOICES_25, voices, strict=True)}, out / "spk_dict.pt")
    del talker, token2wav, tensors
    if device == "cuda":
        torch.cuda.empty_cache()


def build_qwen2_5_omni_in_memory(folder: Path, device: str):
    """The whole model of a ``build_realistic_qwen2_5_omni`` folder on ``device`` in bf16 (``token2wav``
    in float32, as its generate runs it), its weights drawn at random, its voices the folder's."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from triton_omni.demo_models import built_as

    config = AutoConfig.from_pretrained(folder)
    with built_as(device, torch.bfloat16):
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    model.token2wav.float()
    model.load_speakers(str(folder / "spk_dict.pt"))
    model.thinker.generation_config.pad_token_id = AutoTokenizer.from_pretrained(folder).pad_token_id
    return model


# ``demo:<name>`` -> its builder (``demo_models.resolve_model``)
SPEECH_DEMOS = {"tiny-qwen3-omni": build_tiny_qwen3_omni, "tiny-qwen2.5-omni": build_tiny_qwen2_5_omni,
                "realistic-qwen3-omni": build_realistic_qwen3_omni,
                "realistic-qwen2.5-omni": build_realistic_qwen2_5_omni}
