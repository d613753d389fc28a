"""Each DiT family's FLOP formula (``Family.forward_flops``, what the benchmarks' MFU divides by
the GPU's peak) against PyTorch's FLOP counter on a real forward pass of its tiny pipeline: equal,
block by block summed (attention through SDPA's math kernel, whose matmuls the counter sees)."""

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.kernels import fuse_projections
from triton_omni.families import family_of

SIZE, TEXT_TOKENS = 64, 32  # Z-Image pads both streams to multiples of 32: these need none


def counted_block_flops(pipeline, family, **kwargs) -> int:
    """The FLOPs PyTorch's counter sees inside the DiT's repeated blocks over one pipeline call."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        pipeline(num_inference_steps=1, height=SIZE, width=SIZE, output_type="latent", **kwargs)
    network = family.network
    counts = counter.get_flop_counts()
    return sum(sum(counts.get(f"{type(network).__name__}.{name}", {}).values())
               for name, module in network.named_modules() if type(module).__name__ in network._repeated_blocks)


@pytest.mark.parametrize(("demo", "fused"), [(demo, False) for demo in ("tiny-qwen-image", "tiny-z-image",
                                                                          "tiny-flux1-dev", "tiny-flux2-klein",
                                                                          "tiny-wan")]
                         + [("tiny-flux1-dev", True), ("tiny-wan", True)])  # fuse_projections: the same FLOPs
def test_the_flop_formula_equals_the_flop_counter(demo, fused):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(resolve_model(f"demo:{demo}"))
    family = family_of(pipeline)
    if fused:
        assert fuse_projections(family.network) > 0
    embeds = torch.randn(1, TEXT_TOKENS, family.hidden_size())
    kwargs = {"prompt_embeds": embeds, "guidance_scale": 1.0}  # one unguided pass: one row
    if family.name == "qwen_image":
        kwargs["prompt_embeds_mask"] = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    elif family.name == "flux1":
        kwargs["pooled_prompt_embeds"] = torch.randn(1, family.pooled_size())
    elif family.name == "z_image":
        kwargs = {"prompt_embeds": [embeds[0]], "guidance_scale": 0.0}
    frames = 9 if family.output.video else 1  # 3 latent frames: 48 video tokens, not the text's 32
    if family.output.video:
        kwargs["num_frames"] = frames
    counted = counted_block_flops(pipeline, family, **kwargs)
    assert counted > 0
    tokens = family.image_tokens(SIZE, SIZE, frames)
    assert family.forward_flops(tokens, TEXT_TOKENS) == counted
    assert family.forward_flops(tokens, TEXT_TOKENS, rows=3) == 3 * counted


def test_qwen_image_at_its_real_shape_is_about_seventy_teraflop_a_forward():
    """Qwen-Image's 20 B DiT (built on the meta device: shapes only) at 1024², with a prompt of a
    few hundred tokens: one forward is about 70 TFLOP, as a count by hand of its layers says."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel()
    family = family_of(QwenImagePipeline(transformer=transformer, vae=None, scheduler=None, text_encoder=None,
                                         tokenizer=None))
    flops = family.forward_flops(image_tokens=64 * 64, text_tokens=200)
    assert 68e12 < flops < 74e12
    # about 12.6 TFLOP of it attention over the 4,296 joint tokens: 60 blocks x 4 x 4296² x 3072
    linear, attention = family.forward_flop_parts(image_tokens=64 * 64, text_tokens=200)
    assert linear + attention == flops and attention == 60 * 4 * (64 * 64 + 200) ** 2 * 3072


def test_a_forwards_least_time_takes_fp8_only_for_its_linear_layers(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    from gpu_peaks import limit_seconds

    bf16 = limit_seconds(989e12, 989e12, "NVIDIA H200", fp8=False)
    fp8 = limit_seconds(989e12, 989e12, "NVIDIA H200", fp8=True)
    assert bf16 == pytest.approx(2.0) and fp8 == pytest.approx(1.5)
    assert limit_seconds(1.0, 1.0, "NVIDIA A100-SXM4-80GB", fp8=True) is None  # no FP8 there
    assert limit_seconds(1.0, 1.0, "CPU (x86_64)", fp8=False) is None


def test_wan_2_1_1_3b_at_its_real_shape_is_about_280_teraflop_a_forward():
    """Wan 2.1 T2V-1.3B (meta device) over 81 frames of 832x480 (32,760 tokens) and 512 text tokens:
    about 283 TFLOP a forward, two thirds of it attention over the video's tokens."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from triton_omni.families.wan import SHAPES

    with torch.device("meta"):
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096,
                                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", **SHAPES["1.3b"])
    pipeline = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=transformer)
    family = family_of(pipeline)  # without a VAE the pipeline takes Wan's factors: 4 frames, 8 pixels
    tokens = family.image_tokens(480, 832, 81)
    assert tokens == 21 * 30 * 52
    flops = family.forward_flops(tokens, 512)
    attention = 4 * tokens * tokens * 12 * 128 * 30
    assert 275e12 < flops < 290e12 and 0.6 < attention / flops < 0.7
