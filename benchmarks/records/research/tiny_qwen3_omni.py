"""Smallest random-weight Qwen3-Omni (MoE thinker -> MoE talker + code predictor -> code2wav), fully offline.

Run:  nice -n 19 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python \
      benchmarks/records/research/tiny_qwen3_omni.py
"""

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration  # noqa: E402

T0 = time.time()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_pad|>", "<|audio_start|>", "<|audio_end|>",
            "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
            "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
WORDS = ["<unk>", "system", "user", "assistant", "You", "are", "a", "helpful", "assistant.", "Hello", "say",
         "something", "please", "the", "cat", "sat", "on", "mat", "."]
VOCAB = {t: i for i, t in enumerate(SPECIALS + WORDS)}
ID = VOCAB.__getitem__
backend = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
    padding_side="left", extra_special_tokens=SPECIALS,
    chat_template=("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
)

H = 32  # thinker hidden (== talker.thinker_hidden_size)
TH = 16  # talker hidden (== code predictor hidden, talker codec embedding dim)
CODEBOOK = 32  # code predictor vocab == code2wav codebook_size
GROUPS = 4  # talker num_code_groups == code predictor num_code_groups == code2wav num_quantizers
TALKER_VOCAB = CODEBOOK + 1024  # generate() suppresses ids [vocab-1024, vocab) except codec EOS
PAD, BOS, EOS, NOTHINK, THINK_BOS, THINK_EOS, SPK = range(CODEBOOK + 8, CODEBOOK + 15)
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True}

config = Qwen3OmniMoeConfig(
    thinker_config=dict(
        text_config=dict(vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters=MROPE,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         max_position_embeddings=1024, pad_token_id=0, eos_token_id=ID("<|im_end|>")),
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, output_dim=H, downsample_hidden_size=8),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H,
                           patch_size=16, deepstack_visual_indexes=[0]),
        audio_token_id=ID("<|audio_pad|>"), image_token_id=ID("<|image_pad|>"), video_token_id=ID("<|video_pad|>"),
        audio_start_token_id=ID("<|audio_start|>"), vision_start_token_id=ID("<|vision_start|>"),
        user_token_id=ID("user"),
    ),
    talker_config=dict(
        text_config=dict(vocab_size=TALKER_VOCAB, hidden_size=TH, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, rope_parameters=MROPE,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16,  # read by the MoE block, not a declared field
                         max_position_embeddings=1024),
        code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=TH, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   num_code_groups=GROUPS, max_position_embeddings=64),
        num_code_groups=GROUPS, thinker_hidden_size=H, accept_hidden_layer=1,
        codec_pad_id=PAD, codec_bos_id=BOS, codec_eos_token_id=EOS, codec_nothink_id=NOTHINK,
        codec_think_bos_id=THINK_BOS, codec_think_eos_id=THINK_EOS,
        speaker_id={"ethan": SPK},
        audio_token_id=ID("<|audio_pad|>"), image_token_id=ID("<|image_pad|>"), video_token_id=ID("<|video_pad|>"),
        vision_start_token_id=ID("<|vision_start|>"), audio_start_token_id=ID("<|audio_start|>"),
        spatial_merge_size=2,  # read by the talker's rope code, not a declared field
    ),
    code2wav_config=dict(codebook_size=CODEBOOK, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, sliding_window=72, num_quantizers=GROUPS,
                         upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32,
                         max_position_embeddings=1024),
    im_start_token_id=ID("<|im_start|>"), im_end_token_id=ID("<|im_end|>"),
    tts_pad_token_id=ID("<tts_pad>"), tts_bos_token_id=ID("<tts_text_bos>"), tts_eos_token_id=ID("<tts_text_eod>"),
    system_token_id=ID("system"), user_token_id=ID("user"), assistant_token_id=ID("assistant"),
)
torch.manual_seed(0)
model = Qwen3OmniMoeForConditionalGeneration(config).eval()
# PITFALL: _init_weights (modeling_qwen3_omni_moe.py:133-139 / 1586-1593) only initialises the *thinker* MoE experts;
# the talker's Qwen3OmniMoeTalkerTextExperts.gate_up_proj/down_proj stay torch.empty() -> garbage that differs
# between processes. Initialise them explicitly for reproducible random-weight builds.
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts  # noqa: E402

with torch.no_grad():
    for m in model.talker.modules():
        if isinstance(m, Qwen3OmniMoeTalkerTextExperts):
            m.gate_up_proj.normal_(0.0, 0.02)
            m.down_proj.normal_(0.0, 0.02)
model.thinker.generation_config.pad_token_id = 0
print(f"built {time.time() - T0:.2f}s params={sum(p.numel() for p in model.parameters()):,} "
      f"(thinker {sum(p.numel() for p in model.thinker.parameters()):,}, "
      f"talker {sum(p.numel() for p in model.talker.parameters()):,}, "
      f"code2wav {sum(p.numel() for p in model.code2wav.parameters()):,}); "
      f"total_upsample={model.code2wav.total_upsample}")

messages = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello say something please"}]
inputs = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   return_tensors="pt")
t = time.time()
torch.manual_seed(0)
text_ids, wav = model.generate(
    **inputs, speaker="Ethan", thinker_max_new_tokens=8, thinker_do_sample=False,
    thinker_eos_token_id=ID("<|im_end|>"),  # default 151645
    talker_max_new_tokens=12, talker_min_new_tokens=3,
)
print(f"generate {time.time() - t:.2f}s; text {tuple(text_ids.shape)}; wav {tuple(wav.shape)} {wav.dtype} "
      f"absmax={wav.abs().max():.3e} -> {wav.shape[-1] / 24000:.3f}s @24 kHz "
      f"({model.code2wav.total_upsample} samples/code frame)")

# code2wav on its own: codes [batch, num_quantizers, frames]; forward vs chunked_decode
codes = torch.randint(0, CODEBOOK, (1, GROUPS, 40))
full = model.code2wav(codes)
chunked = model.code2wav.chunked_decode(codes, chunk_size=16, left_context_size=4)
print("code2wav full", tuple(full.shape), "chunked", tuple(chunked.shape),
      "max|diff|", (full[..., :chunked.shape[-1]] - chunked).abs().max().item())
print(f"total {time.time() - T0:.2f}s")

if "--save" in __import__("sys").argv:
    d = "/tmp/omni-research/tiny3"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    m2 = Qwen3OmniMoeForConditionalGeneration.from_pretrained(d, local_files_only=True).eval()
    m2.thinker.generation_config.pad_token_id = 0
    torch.manual_seed(0)
    _, w2 = m2.generate(**inputs, speaker="Ethan", thinker_max_new_tokens=8, thinker_do_sample=False,
                        thinker_eos_token_id=ID("<|im_end|>"), talker_max_new_tokens=12, talker_min_new_tokens=3)
    print("reloaded; files:", sorted(os.listdir(d)), "wav", tuple(w2.shape), "same as before:", torch.equal(w2, wav))
