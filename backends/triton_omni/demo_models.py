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
# Real sizes, random weights: for benchmarks on a GPU (omni-triton bench --preset realistic).
AR_REALISTIC = "realistic-qwen2"
DIFFUSION_REALISTIC = "realistic-sd"
# Bump when a builder changes, so stale caches are rebuilt.
BUILD_VERSION = 1

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


def build_tokenizer(out: Path, vocab_size: int, max_length: int = AR_SHAPE["max_position_embeddings"]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>",
        model_max_length=max_length,
    )
    fast.save_pretrained(out)
    return fast


def build_ar_model(out: Path, shape: dict = AR_SHAPE) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"])
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


def build_all() -> dict[str, str]:
    return {name: resolve_model(DEMO_PREFIX + name) for name in (AR_DEMO, DIFFUSION_DEMO)}


if __name__ == "__main__":
    print(json.dumps(build_all(), indent=2))
