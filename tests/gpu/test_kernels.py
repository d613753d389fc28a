"""What a DiT runs on (kernels.py), at a real shape (Z-Image's 6 B DiT, random weights, bf16) on a
GPU with FP8 tensor cores: ``quantization: fp8`` against bf16 with the same request, the attention
kernel ``auto`` chooses and FlashAttention-4 and -3 against PyTorch's SDPA, and a compiled runner's memory (its DiT's
blocks and its VAE's decoder) given back when it closes (twice over: a reload finds its GPU as the first load
did); the VAE's spread group norms against PyTorch's, both measured from a float32 decode; the
feed-forwards' GELU in their matmuls' epilogue (``gelu_epilogue``) against the unfused image. GPU
only (docs/gpu.md)."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.demo_models import built_as
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.kernels import spread_group_norms
from triton_omni.families.flux1 import realistic_vae

MODEL = "demo:realistic-z-image"
SIZE, STEPS = 512, 8
# The memory a closed runner gives back does not depend on the DiT's size (what leaked was cuBLAS's
# workspace per stream, and the graphs' pool): the tiny Z-Image, compiled and graphed the same way,
# instead of compiling the 6 B DiT twice (503 s of this file's 523 s on an H200)
TINY, TINY_SIZE, TINY_STEPS = "demo:tiny-z-image", 64, 4
UNMASKED = "demo:realistic-flux2-klein"  # FLUX.2 [klein] 4 B: its encoder pads to a fixed length, no mask


def request(runner: DiffusionRunner, seed: int, size: int = SIZE, steps: int = STEPS) -> dict:
    generator = torch.Generator().manual_seed(seed)
    embeds = (torch.randn(64, runner.limits.hidden_size, generator=generator) * 0.5).to(torch.bfloat16)
    return {"prompt_embeds": embeds, "guidance_scale": 0.0, "seed": seed, "num_inference_steps": steps,
            "height": size, "width": size}


def images(seeds: list[int], model: str = MODEL, size: int = SIZE, steps: int = STEPS,
           **settings) -> list[torch.Tensor]:
    runner = DiffusionRunner(DiffusionRunnerConfig(model, device="cuda", dtype="bfloat16", batching="step",
                                                   exact_batching=False, **settings))
    try:
        return [f.result() for f in [runner.submit(runner.parse(request(runner, seed, size, steps)))
                                     for seed in seeds]]
    finally:
        runner.close()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0**2 / mse)).item()


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")
@pytest.mark.parametrize("scales", ["row", "tensor"])
def test_fp8_gives_bf16s_image_within_a_stated_distance(scales):
    """Random weights: a proxy for what real weights lose. The same request in FP8 (a scale per
    row, or one per tensor) must be far nearer bf16's image than another seed's image is (which
    the tolerance could not hide)."""
    bf16, other = images([1, 2])
    [fp8] = images([1], quantization="fp8", fp8_scales=scales)
    against_bf16, against_other = psnr(fp8, bf16), psnr(other, bf16)
    print(f"FP8 ({scales}) against bf16: PSNR {against_bf16:.1f} dB, mean difference "
          f"{float((fp8.float() - bf16.float()).abs().mean()):.2f} of 255; another seed: PSNR {against_other:.1f} dB")
    assert against_bf16 > against_other + 10


def test_the_attention_kernel_auto_chooses_gives_sdpas_image():
    [native] = images([3], attention_backend="native")
    [chosen] = images([3], attention_backend="auto")
    difference = (chosen.int() - native.int()).abs()
    print(f"auto against SDPA: max {int(difference.max())}, mean {float(difference.float().mean()):.3f}")
    assert float(difference.float().mean()) <= 1.0


# backend -> (the compute capabilities it runs on, the module that tells it is installed)
INSTALLED = {"flash_4_hub": ((9, 10), "flash_attn.cute"), "_flash_3_hub": ((9,), "vllm")}


@pytest.mark.parametrize("backend", list(INSTALLED))
def test_an_installed_flash_attention_gives_sdpas_image_compiled_too(backend):
    """``flash_4_hub`` runs the installed flash-attn-4 package, ``_flash_3_hub`` vLLM's
    FlashAttention-3 build (the GPU pack carries both), eager and under ``compile: blocks`` (its
    custom op inside each block's graph); another seed's image is far past the tolerance. FLUX.2
    [klein]: its passes never pad (FlashAttention takes no mask; Z-Image's may, and it is refused
    there by name)."""
    capabilities, module = INSTALLED[backend]
    if torch.cuda.get_device_capability()[0] not in capabilities:
        pytest.skip(f"{backend} runs on compute capabilities {capabilities}")
    pytest.importorskip(module)
    native, other = images([3, 5], UNMASKED, attention_backend="native")
    [flash] = images([3], UNMASKED, attention_backend=backend)
    [compiled] = images([3], UNMASKED, attention_backend=backend, compile="blocks")
    for name, image in (("eager", flash), ("compile: blocks", compiled)):
        difference = (image.int() - native.int()).abs()
        print(f"{backend} {name} against SDPA: max {int(difference.max())}, "
              f"mean {float(difference.float().mean()):.3f}, PSNR {psnr(image, native):.1f} dB")
        assert float(difference.float().mean()) <= 1.0
    assert psnr(flash, native) > psnr(other, native) + 10


def test_closing_a_compiled_runner_gives_its_gpu_memory_back():
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    lefts = []
    for _ in range(2):  # a reload after a close starts from the same memory
        # its forward replayed as CUDA graphs too (cuda_graphs: true), and its VAE's decoder compiled
        images([4], TINY, TINY_SIZE, TINY_STEPS, compile="blocks,vae")
        gc.collect()
        lefts.append(torch.cuda.memory_allocated() - baseline)
        print(f"after close: {lefts[-1] / 2**20:.0f} MiB above the baseline")
        assert lefts[-1] < 256 * 2**20
    # cuBLAS's workspace per stream outlived the graphs' streams and pool: 66 MiB more at every load
    assert lefts[1] - lefts[0] < 16 * 2**20


def test_spread_group_norms_decode_as_near_float32_as_pytorchs():
    """FLUX.1's VAE at 1024² (random weights): in bf16 with its group norms spread, as near the
    float32 decode as with PyTorch's own (only the order of the sums differs); another latent is
    far from both."""
    with built_as("cuda", torch.float32):
        vae = realistic_vae().eval()
    generator = torch.Generator("cuda").manual_seed(0)
    latents = torch.randn(1, 16, 128, 128, device="cuda", generator=generator)

    def levels(z: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return (vae.decode(z.to(vae.dtype)).sample.float().clamp(-1, 1) + 1) * 127.5

    exact = levels(latents)
    vae.to(torch.bfloat16)
    pytorchs = levels(latents)
    assert spread_group_norms(vae) > 0
    spread, other = levels(latents), levels(torch.randn_like(latents))
    errors = {name: float((image - exact).abs().mean()) for name, image in (("PyTorch's", pytorchs),
                                                                             ("spread", spread))}
    print(f"bf16 decode against float32, mean of 255: {errors}; another latent: "
          f"{float((other - exact).abs().mean()):.1f}")
    assert errors["spread"] <= 1.1 * errors["PyTorch's"] and float((spread - pytorchs).abs().max()) > 0
    assert float((other - exact).abs().mean()) > 20 * errors["spread"]


def test_under_exact_batching_pipeline_the_vae_keeps_pytorchs_group_norms():
    for exact, spread in (("false", True), ("pipeline", False)):
        runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", device="cuda", dtype="bfloat16",
                                                       batching="step", exact_batching=exact))
        try:
            norms = [m for m in runner.pipeline.vae.modules() if isinstance(m, torch.nn.GroupNorm)]
            assert norms and all(("forward" in m.__dict__) == spread for m in norms)
            assert runner.steps.decode_alone == spread
        finally:
            runner.close()


def compiled_image(model: str, prompt: str, options: dict, **settings) -> torch.Tensor:
    """One 64² request of 4 steps (seed 3) through a step-batching runner in bf16 under ``compile:
    blocks``, with ``settings`` on top; the runner closed after it."""
    runner = DiffusionRunner(DiffusionRunnerConfig(model, device="cuda", dtype="bfloat16", batching="step",
                                                   exact_batching=False, compile="blocks", **settings))
    try:
        return runner.submit(runner.parse({"prompt": prompt, "num_inference_steps": 4, "height": 64,
                                           "width": 64, "seed": 3} | options)).result()
    finally:
        runner.close()


def assert_within_a_level(what: str, changed: torch.Tensor, unchanged: torch.Tensor, other: torch.Tensor) -> None:
    """``changed`` is ``unchanged``'s image within a level or so; ``other`` (another prompt) far past it."""
    difference = (changed.int() - unchanged.int()).abs()
    print(f"{what}: max {int(difference.max())}, mean {float(difference.float().mean()):.3f}; "
          f"another prompt PSNR {psnr(other, unchanged):.1f} dB")
    assert float(difference.float().mean()) <= 1.0
    assert psnr(changed, unchanged) > psnr(other, unchanged) + 10


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")
def test_fused_projections_under_fp8_compiled_and_graphed_give_the_unfused_image():
    """``fuse_projections`` (FLUX.1's q, k and v one layer) with FP8, ``compile: blocks`` and its CUDA
    graphs: the fused layer's rows keep their scales, so the image is the unfused one's within a
    level or so; another prompt is far past that."""
    def flux(fused: bool, prompt: str = "a red fox") -> torch.Tensor:
        return compiled_image("demo:tiny-flux1-dev", prompt, {}, quantization="fp8", fuse_projections=fused)

    assert_within_a_level("fused against unfused (FP8, compiled)", flux(True), flux(False),
                          flux(True, "a blue whale"))


@pytest.mark.parametrize(("model", "options"), [("demo:tiny-flux1-dev", {"guidance_scale": 3.5}),
                                                ("demo:tiny-wan", {"guidance_scale": 5.0, "num_frames": 5})])
def test_gelu_epilogues_compiled_give_the_unfused_image(model, options):
    """``gelu_epilogue`` (each feed-forward's tanh GELU in its projection's matmul) under ``compile:
    blocks`` in bf16: the GELU reads the float32 sum before it is rounded, so the image (every frame)
    is the unfused one's within a level or so; another prompt is far past that."""
    def served(epilogue: bool, prompt: str = "a red fox") -> torch.Tensor:
        return compiled_image(model, prompt, options, gelu_epilogue=epilogue)

    assert_within_a_level(f"{model}: GELU epilogues against unfused (compiled)", served(True), served(False),
                          served(True, "a blue whale"))
