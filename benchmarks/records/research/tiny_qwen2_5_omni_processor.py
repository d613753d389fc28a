"""Offline Qwen2_5OmniProcessor on the tiny tokenizer + multimodal (audio + image) generate.

Needs /tmp/omni-research/tiny25 written by `tiny_qwen2_5_omni.py --save /tmp/omni-research/tiny25`.
"""

import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np
import torch

torch.set_num_threads(1)
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

D = "/tmp/omni-research/tiny25"
tok = AutoTokenizer.from_pretrained(D)
print("tokenizer class:", type(tok).__name__, "audio_token:", tok.audio_token, "vision_bos:", tok.vision_bos_token)

try:
    from transformers import Qwen2VLVideoProcessor

    video = Qwen2VLVideoProcessor()
except Exception as e:  # no torchvision in the CPU venv
    print("Qwen2VLVideoProcessor unavailable:", type(e).__name__)
    from transformers.video_processing_utils import BaseVideoProcessor

    class StubVideoProcessor(BaseVideoProcessor):  # only .merge_size / .temporal_patch_size are read without videos
        merge_size = 2
        temporal_patch_size = 2

    video = StubVideoProcessor()
    # Without torchvision, VIDEO_PROCESSOR_MAPPING is a dummy and ProcessorMixin's class check raises
    # AttributeError("... has no attribute '_extra_content'"); skip the check.
    Qwen2_5OmniProcessor.check_argument_for_proper_class = lambda self, name, arg: type(arg)

proc = Qwen2_5OmniProcessor(
    image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4),
    video_processor=video,
    feature_extractor=WhisperFeatureExtractor(feature_size=128),  # 128 mel bins, 16 kHz, 30 s max (padding=max_length)
    tokenizer=tok,
    chat_template=tok.chat_template,
)
messages = [
    {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
    {"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                 {"type": "text", "text": "Hello say something"}]},
]
text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
audio = np.random.RandomState(0).randn(16000).astype(np.float32) * 0.1  # 1 s @ 16 kHz
image = Image.fromarray((np.random.RandomState(1).rand(56, 56, 3) * 255).astype(np.uint8))
inputs = proc(text=text, audio=[audio], images=[image], return_tensors="pt")
for k, v in inputs.items():
    print(f"  {k}: {tuple(v.shape) if hasattr(v, 'shape') else v}")
ids = inputs["input_ids"][0].tolist()
print("  #<|AUDIO|> =", ids.count(tok.convert_tokens_to_ids('<|AUDIO|>')),
      " #<|IMAGE|> =", ids.count(tok.convert_tokens_to_ids('<|IMAGE|>')))

model = Qwen2_5OmniForConditionalGeneration.from_pretrained(D, local_files_only=True).eval()
model.thinker.generation_config.eos_token_id = tok.eos_token_id
# audio-only input first (no image): works as-is
a_inputs = proc(text=proc.apply_chat_template([messages[0], {"role": "user", "content": [{"type": "audio"}]}],
                                              add_generation_prompt=True, tokenize=False),
                audio=[audio], return_tensors="pt")
torch.manual_seed(0)
_, a_wav = model.generate(**a_inputs, speaker="Chelsie", thinker_max_new_tokens=4, talker_max_new_tokens=8,
                          talker_min_new_tokens=2, talker_eos_token_id=[60, 62], token2wav_num_steps=2)
print("audio-in -> audio-out ok:", tuple(a_wav.shape))

# PITFALL: generate() copies every un-prefixed kwarg (pixel_values, ...) into the talker's kwargs and the
# talker's generate() rejects `pixel_values` as unused. Route vision tensors to the thinker explicitly.
inputs = dict(inputs)
inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
t = time.time()
torch.manual_seed(0)
text_ids, wav = model.generate(
    **inputs, speaker="Chelsie", thinker_max_new_tokens=6, thinker_do_sample=False,
    talker_max_new_tokens=16, talker_min_new_tokens=4, talker_eos_token_id=[60, 62], token2wav_num_steps=4,
)
print(f"multimodal generate {time.time() - t:.2f}s; text {tuple(text_ids.shape)}; wav {tuple(wav.shape)}")
print("post_process text:", proc.post_process_multimodal_output(text_ids[:, inputs['input_ids'].shape[1]:]))
print("post_process audio:",
      [a.shape for a in proc.post_process_multimodal_output((text_ids, wav), generation_mode='audio')])
proc.save_pretrained("/tmp/omni-research/tiny25_proc")
print("processor files:", sorted(os.listdir("/tmp/omni-research/tiny25_proc")))
