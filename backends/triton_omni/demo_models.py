"""Tiny, seeded, random-weight demo models, built locally (no hub access).

Everything runs offline: the tokenizer is a byte-level BPE trained on a small
built-in corpus, the weights come from ``torch.manual_seed``. The AR model is a
Qwen2 whose shape vLLM's CPU attention backend accepts (head_dim 64).

Model configs refer to these models as ``demo:<name>``; ``resolve_model``
turns that into a folder under the cache (``$TRITON_OMNI_CACHE``, default
``~/.cache/triton-omni``; the tools set it to a source checkout's ``.cache``).
Anything else is passed through as a local path or hub id.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_PREFIX = "demo:"
AR_DEMO = "tiny-qwen2"
DIFFUSION_DEMO = "tiny-sd"
# LLM-conditioned DiTs, shaped like diffusers' own pipeline tests: Qwen-Image (a Qwen2.5-VL text
# encoder, an MMDiT, true CFG) and Z-Image (a Qwen3 text encoder, a single-stream DiT).
QWEN_IMAGE_DEMO = "tiny-qwen-image"
Z_IMAGE_DEMO = "tiny-z-image"
# Real sizes, random weights: for benchmarks on a GPU (omni-triton bench --preset realistic).
AR_REALISTIC = "realistic-qwen2"
DIFFUSION_REALISTIC = "realistic-sd"
# Z-Image's text encoder at Qwen3-4B's shape, random weights, as a pipeline folder holding only it
# and its tokenizer: `ar_encoder`'s model beside the in-memory realistic DiT (benchmarks/families.py
# --end-to-end), and the encoder the benchmark's own pipeline loads.
Z_IMAGE_ENCODER_REALISTIC = "realistic-z-image-encoder"
# Bump when a builder changes, so stale caches are rebuilt.
BUILD_VERSION = 5

AR_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}

# Qwen2.5-0.5B's shape (the tokenizer stays the small offline one: ids < 512).
AR_REALISTIC_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
# Qwen3-4B's shape (Z-Image's text encoder), as its config.json gives it.
QWEN3_4B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# A tiny UNet/VAE, and Stable Diffusion 1.5's (860M-parameter UNet, 8x VAE).
UNET_TINY = {"sample_size": 16, "layers_per_block": 1, "block_out_channels": (32, 64),
             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}
UNET_SD15 = {"sample_size": 64, "layers_per_block": 2, "block_out_channels": (320, 640, 1280, 1280),
             "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
             "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3}
VAE_TINY = {"block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 32}
VAE_SD15 = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "sample_size": 512}

_CORPUS = """
A red fox jumps over the lazy dog. The quick brown cat sleeps in the sun.
Paint a watercolor landscape with mountains, a lake and a small wooden cabin.
Triton serves models over HTTP and gRPC with dynamic batching and metrics.
An astronaut rides a horse on the moon; a robot reads a book in a library.
Diffusion models turn noise into images, step by step, guided by a prompt.
Once upon a time there was a lighthouse by the sea, and a keeper who sang.
0123456789 ,.;:!?'"()[]{}<>-+*/=_@#$%&
""".strip()


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "triton-omni"
    return Path(os.environ.get("TRITON_OMNI_CACHE", default)).resolve()


def resolve_model(model: str) -> str:
    """``demo:<name>`` -> its built folder (building it if missing); else unchanged."""
    if not model.startswith(DEMO_PREFIX):
        return model
    name = model.removeprefix(DEMO_PREFIX)
    builders = {
        AR_DEMO: build_ar_model,
        DIFFUSION_DEMO: build_diffusion_pipeline,
        AR_REALISTIC: lambda out: build_ar_model(out, AR_REALISTIC_SHAPE),
        DIFFUSION_REALISTIC: lambda out: build_diffusion_pipeline(out, AR_REALISTIC_SHAPE, UNET_SD15, VAE_SD15),
        QWEN_IMAGE_DEMO: build_qwen_image_pipeline,
        Z_IMAGE_DEMO: build_z_image_pipeline,
        Z_IMAGE_ENCODER_REALISTIC: build_z_image_encoder,
    }
    if name not in builders:
        raise ValueError(f"unknown demo model {model!r}; known: {sorted(DEMO_PREFIX + n for n in builders)}")
    return str(ensure_built(name, builders[name]))


def ensure_built(name: str, builder) -> Path:
    """Build once into the cache; a stamp file marks a complete build.

    The build goes to a temporary folder that is renamed into place, so two
    processes building at once (several model instances) never see half a model.
    """
    target = cache_dir() / "models" / name
    stamp = target / ".built"
    if stamp.exists() and stamp.read_text() == str(BUILD_VERSION):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        builder(staging)
        (staging / ".built").write_text(str(BUILD_VERSION))
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:  # another process won the race with an identical build
            if not stamp.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Built demo model %s in %s", name, target)
    return target


# The chat markers of the Qwen family, and a chat template shaped like Qwen3's (Z-Image renders its
# prompts with it; Qwen-Image writes the same markers into its own template string).
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int, max_length: int = AR_SHAPE["max_position_embeddings"],
                    chat: bool = False, template: str = ""):
    """A byte-level BPE trained on the built-in corpus. ``template``: a prompt template the model's
    pipeline wraps every prompt in, trained on until each of its words is one token, as in the real
    tokenizer, so that the template's tokens a pipeline drops by count are the template's own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>", *(CHAT_TOKENS if chat else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4 + template.splitlines() * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>",
        model_max_length=max_length, **({"chat_template": CHAT_TEMPLATE} if chat else {}),
    )
    fast.save_pretrained(out)
    return fast


def _amplify(module, factor: float, where=lambda name: True) -> None:
    """Scale the weights of ``module``'s linear layers (those whose name ``where`` accepts) by
    ``factor``. At random init a tiny denoiser is nearly blind to its conditioning: another prompt,
    negative prompt or guidance scale moved the tiny Qwen-Image's image by 1 level of 255, so a
    parity test could not tell a wrong encoding from the right one. Scaled, each such change moves
    the image by tens of levels (tests/unit/test_demo_sensitivity.py holds it)."""
    import torch

    with torch.no_grad():
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear) and where(name):
                layer.weight.mul_(factor)


def build_ar_model(out: Path, shape: dict = AR_SHAPE) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"])
    # A chat template for /v1/chat/completions; its markers are plain text to this vocabulary.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    (out / "README.md").write_text(
        "Tiny random-weight Qwen2 built by triton_omni.demo_models (seed 0). Output is gibberish by design.\n"
    )


def build_diffusion_pipeline(out: Path, ar_shape: dict = AR_SHAPE, unet_shape: dict = UNET_TINY,
                             vae_shape: dict = VAE_TINY) -> None:
    """A StableDiffusionPipeline (tiny by default) whose cross-attention width
    equals the AR model's hidden size, so ``ar_encoder`` embeddings condition
    it directly; its own small CLIP text encoder takes text prompts."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    hidden = ar_shape["hidden_size"]
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], max_length=77)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(in_channels=4, out_channels=4, cross_attention_dim=hidden, attention_head_dim=8,
                                norm_num_groups=32, **unet_shape)
    if unet_shape is UNET_TINY:
        _amplify(unet, 2.0, lambda name: ".attn2." in name)  # the cross-attention: the text's way in
    blocks = len(vae_shape["block_out_channels"])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks, norm_num_groups=32, **vae_shape,
    )
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=AR_SHAPE["vocab_size"], hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False)
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(out)


def build_qwen_image_pipeline(out: Path) -> None:
    """A ``QwenImagePipeline`` at the shape of diffusers' pipeline test: a
    Qwen2.5-VL text encoder (hidden 16), an MMDiT, Qwen-Image's VAE and
    flow-matching scheduler. Its text encoder's hidden size is 64 wide here
    (head_dim 32), so that the same checkpoint also loads as ``ar_encoder``."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from triton_omni.ar.recipes import QWEN_IMAGE_DROPPED, QWEN_IMAGE_TEMPLATE

    hidden = 64
    # QwenImagePipeline drops its template's first 34 tokens, Qwen2.5-VL's count for its system prompt
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True,
                                template=QWEN_IMAGE_TEMPLATE.format(""))
    prefix = QWEN_IMAGE_TEMPLATE[: QWEN_IMAGE_TEMPLATE.index("{}")]
    assert len(tokenizer(prefix).input_ids) == QWEN_IMAGE_DROPPED, "the template's prefix must be what is dropped"
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=hidden, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    # the blocks after the first: the step cache compares the first block's output between steps,
    # and keeps the decisions it made on the model as built
    _amplify(transformer, 6.0, lambda name: name.startswith("transformer_blocks.") and
             not name.startswith("transformer_blocks.0."))
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": AR_SHAPE["vocab_size"],
                     "rope_scaling": {"mrope_section": [4, 6, 6], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        vocab_size=AR_SHAPE["vocab_size"], vision_start_token_id=AR_SHAPE["vocab_size"] - 3,
        vision_end_token_id=AR_SHAPE["vocab_size"] - 2, vision_token_id=AR_SHAPE["vocab_size"] - 1,
    )).eval()
    pipeline = QwenImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                 text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(out)


def build_z_image_pipeline(out: Path) -> None:
    """A ``ZImagePipeline`` at the shape of diffusers' pipeline test: a Qwen3
    text encoder (its second-to-last hidden state conditions), a single-stream
    DiT, a 16-channel VAE and a flow-matching scheduler."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    hidden = 64
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True)
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=hidden, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159)
    torch.manual_seed(0)
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=AR_SHAPE["vocab_size"], max_position_embeddings=1024,
    )).eval()
    pipeline = ZImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                              text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(out)


def build_z_image_encoder(out: Path, shape: dict = QWEN3_4B_SHAPE) -> None:
    """Z-Image's text encoder alone (a ``Qwen3Model``, random weights, bf16) with its tokenizer, as a
    pipeline folder: ``model_index.json``, ``text_encoder/``, ``tokenizer/``. Built on a GPU where
    there is one (seconds for 4 B parameters), saved as safetensors (about 8 GB)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True)
    with _built_as("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16):
        encoder = Qwen3Model(Qwen3Config(**shape, torch_dtype="bfloat16")).eval()
    encoder.save_pretrained(out / "text_encoder")
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "ZImagePipeline", "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}, indent=2))


# Real shapes, random weights, built on the GPU in memory (the DiTs do not fit a GPU host's disk
# as files, and need not): diffusers' class defaults are Qwen-Image's 20.4 B MMDiT and Z-Image's
# 6 B DiT. No text encoder: these serve `prompt_embeds` (ar_encoder's, or a benchmark's).
IN_MEMORY = {"demo:realistic-qwen-image", "demo:realistic-z-image"}


def build_in_memory(model: str, device, dtype):
    """The pipeline ``model`` names (one of ``IN_MEMORY``), built on ``device`` in ``dtype``."""
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    with _built_as(device, dtype):  # in dtype directly: an fp32 build of the 20 B DiT fills an 80 GB GPU
        if model == "demo:realistic-qwen-image":
            scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler_config.json
                base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
            return QwenImagePipeline(transformer=QwenImageTransformer2DModel(), vae=AutoencoderKLQwenImage(),
                                     scheduler=scheduler, text_encoder=None, tokenizer=None)
        vae = AutoencoderKL(  # FLUX.1's autoencoder, which Z-Image uses
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False)
        return ZImagePipeline(transformer=ZImageTransformer2DModel(), vae=vae,
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
                              text_encoder=None, tokenizer=None)


@contextlib.contextmanager
def _built_as(device, dtype):
    """Modules built meanwhile are made on ``device`` in ``dtype`` directly, from seed 0."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            yield
    finally:
        torch.set_default_dtype(default)


def build_all() -> dict[str, str]:
    return {name: resolve_model(DEMO_PREFIX + name) for name in (AR_DEMO, DIFFUSION_DEMO)}


if __name__ == "__main__":
    print(json.dumps(build_all(), indent=2))
