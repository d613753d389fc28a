"""Smallest random-weight Qwen2.5-Omni (thinker -> talker -> token2wav), fully offline.

Run:  nice -n 19 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 /work/main/.venv/bin/python \
          /tmp/omni-research/tiny_qwen2_5_omni.py [--save DIR]
"""

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch

torch.set_num_threads(1)

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    PreTrainedTokenizerFast,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
)

T0 = time.time()

# --------------------------------------------------------------------------- tokenizer
SPECIALS = [
    "<|endoftext|>",  # 0  pad
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2  eos
    "<|AUDIO|>",  # 3  audio_token_index
    "<|audio_bos|>",  # 4  audio_start_token_id
    "<|audio_eos|>",  # 5  audio_end_token_id
    "<|IMAGE|>",  # 6  image_token_index
    "<|VIDEO|>",  # 7  video_token_index
    "<|vision_bos|>",  # 8  vision_start_token_id
    "<|vision_eos|>",  # 9  vision_end_token_id
    "<|tts_pad|>",  # 10 talker tts_text_pad_token_id
    "<|tts_bos|>",  # 11 talker tts_text_start_token_id
    "<|tts_eos|>",  # 12 talker tts_text_end_token_id
    "<|spk_bos|>",  # 13 speaker "bos_token" (spk_dict.pt entry)
]
WORDS = ["<unk>", "system", "user", "assistant", "You", "are", "a", "helpful", "assistant.", "Hello", "hello",
         "world", "say", "something", "please", "the", "cat", "sat", "on", "mat", ".", ",", "?", "!"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + WORDS)}
ID = VOCAB.__getitem__

backend = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif c['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend,
    unk_token="<unk>",
    pad_token="<|endoftext|>",
    eos_token="<|im_end|>",
    padding_side="left",
    # named model-specific special tokens: Qwen2_5OmniProcessor reads tokenizer.audio_token etc.
    extra_special_tokens={
        "audio_token": "<|AUDIO|>",
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
    },
    chat_template=CHAT_TEMPLATE,
)
for t in SPECIALS:  # make sure they are never split / are marked special
    tokenizer.add_special_tokens({"additional_special_tokens": [t]}, replace_extra_special_tokens=False)

# --------------------------------------------------------------------------- config
H = 32  # thinker hidden == talker embedding_size
TEXT_VOCAB = 64
TALKER_VOCAB = 64
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 60, 61, 62, 63
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]}  # sum == head_dim/2 (=4)

thinker_config = dict(
    text_config=dict(
        vocab_size=TEXT_VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters=MROPE, pad_token_id=ID("<|endoftext|>"), eos_token_id=ID("<|im_end|>"),
        tie_word_embeddings=False,
    ),
    audio_config=dict(
        num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
        output_dim=H, n_window=100, max_source_positions=1500,
    ),
    vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0],
    ),
    audio_token_index=ID("<|AUDIO|>"), image_token_index=ID("<|IMAGE|>"), video_token_index=ID("<|VIDEO|>"),
    audio_start_token_id=ID("<|audio_bos|>"), audio_end_token_id=ID("<|audio_eos|>"),
    vision_start_token_id=ID("<|vision_bos|>"),  # not a declared field, but get_rope_index reads it
    user_token_id=ID("user"),
)
talker_config = dict(
    vocab_size=TALKER_VOCAB, embedding_size=H, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
    rope_parameters=MROPE,
    tts_codec_pad_token_id=CODEC_PAD, tts_codec_start_token_id=CODEC_BOS, tts_codec_end_token_id=CODEC_EOS,
    tts_codec_mask_token_id=CODEC_MASK,
    tts_text_pad_token_id=ID("<|tts_pad|>"), tts_text_start_token_id=ID("<|tts_bos|>"),
    tts_text_end_token_id=ID("<|tts_eos|>"),
    audio_token_index=ID("<|AUDIO|>"), image_token_index=ID("<|IMAGE|>"), video_token_index=ID("<|VIDEO|>"),
    audio_start_token_id=ID("<|audio_bos|>"), audio_end_token_id=ID("<|audio_eos|>"),
    vision_start_token_id=ID("<|vision_bos|>"), vision_end_token_id=ID("<|vision_eos|>"),
)
ENC_EMB = 16  # speaker x-vector size ("cond" in spk_dict)
MEL = 80
token2wav_config = dict(
    dit_config=dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        block_size=24, look_ahead_layers=[1], look_backward_layers=[0], repeats=2,
        num_embeds=TALKER_VOCAB,  # must cover every id the talker can emit (real: 8193 vs talker vocab 8448)
        mel_dim=MEL, dropout=0.0, enc_emb_dim=ENC_EMB, enc_dim=16,
        enc_channels=[16, 16, 16], enc_kernel_sizes=[5, 3, 1], enc_dilations=[1, 2, 1],
        enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8,
    ),
    bigvgan_config=dict(
        mel_dim=MEL, upsample_initial_channel=128, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
        upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],  # x240 like the real one
    ),
)
config = Qwen2_5OmniConfig(
    thinker_config=thinker_config, talker_config=talker_config, token2wav_config=token2wav_config,
    enable_audio_output=True,
)

torch.manual_seed(0)
model = Qwen2_5OmniForConditionalGeneration(config).eval()
# thinker.generation_config is derived from the composite config: set eos/pad explicitly.
model.thinker.generation_config.eos_token_id = ID("<|im_end|>")
model.thinker.generation_config.pad_token_id = ID("<|endoftext|>")
# speaker table normally loaded from spk_dict.pt by from_pretrained(); keys per speaker:
model.speaker_map["Chelsie"] = {
    "bos_token": ID("<|spk_bos|>"),  # thinker-vocab id inserted before the reply in the talker's text stream
    "cond": torch.randn(1, ENC_EMB),  # x-vector -> DiT speaker_embedding
    "ref_mel": torch.randn(1, 40, MEL),  # reference mel -> ECAPA encoder -> DiT condition
}
n_params = sum(p.numel() for p in model.parameters())
print(f"built in {time.time() - T0:.2f}s, params={n_params:,} "
      f"(thinker {sum(p.numel() for p in model.thinker.parameters()):,}, "
      f"talker {sum(p.numel() for p in model.talker.parameters()):,}, "
      f"token2wav {sum(p.numel() for p in model.token2wav.parameters()):,})")

# --------------------------------------------------------------------------- prompt
messages = [
    {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello say something please"}]},
]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
inputs = tokenizer(prompt, return_tensors="pt")
print("prompt:", repr(prompt))
print("input_ids:", inputs["input_ids"].tolist())

t = time.time()
torch.manual_seed(0)
text_ids, wav = model.generate(
    **inputs,
    speaker="Chelsie",
    thinker_max_new_tokens=8,
    thinker_do_sample=False,
    talker_max_new_tokens=24,
    talker_min_new_tokens=4,  # random weights may emit codec EOS at once -> empty code -> DiT crash
    talker_eos_token_id=[CODEC_PAD, CODEC_EOS],  # default [8292, 8294] is out of range for the tiny vocab
    token2wav_num_steps=4,  # default 10 (ODE time points; RK4 => 4 DiT calls per interval)
)
dt = time.time() - t
print(f"generate: {dt:.2f}s")
print("text ids:", text_ids.tolist())
print("decoded reply:", tokenizer.decode(text_ids[0, inputs['input_ids'].shape[1]:]))
print("wav:", tuple(wav.shape), wav.dtype, f"absmax={wav.abs().max():.3e} std={wav.std():.3e}",
      f"-> {wav.numel() / 24000:.3f}s at 24 kHz (240 samples per mel frame, 2 mel frames per codec token)")

# text-only path
out = model.generate(**inputs, speaker="Chelsie", generation_mode="text", thinker_max_new_tokens=4,
                     thinker_do_sample=False)
print("text-only generate returns:", type(out).__name__, tuple(out.shape) if torch.is_tensor(out) else "")

if "--save" in sys.argv:
    d = sys.argv[sys.argv.index("--save") + 1]
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    torch.save(model.speaker_map, os.path.join(d, "spk_dict.pt"))
    m2 = Qwen2_5OmniForConditionalGeneration.from_pretrained(d, local_files_only=True).eval()
    print("reloaded from", d, "speakers:", list(m2.speaker_map), "files:", sorted(os.listdir(d)))
print(f"total {time.time() - T0:.2f}s")
