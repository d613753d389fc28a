"""What a DiT runs on (kernels.py): ``quantization: fp8`` and ``attention_backend``, as a CPU host
can check them. FP8's images and the kernels' timings are the GPU's (tests/gpu/test_kernels.py,
benchmarks/families.py); here: which layers an FP8 plan takes, every setting this host cannot run
refused at load naming its parameter, and ``auto`` keeping PyTorch's SDPA on the CPU; the VAE's spread
group norm (``group_norm``) against PyTorch's on every layout a VAE gives it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.kernels import (
    VLLM_FLASH_ATTENTION_3,
    Fp8Plan,
    channels_last_convolutions,
    convolutions_pad_space,
    fuse_gelu_epilogues,
    group_norm,
    resolve_attention,
    spread_group_norms,
)
from triton_omni.families import family_of

QWEN = "demo:tiny-qwen-image"


@pytest.fixture(scope="module")
def qwen_runner():
    runner = DiffusionRunner(DiffusionRunnerConfig(QWEN))
    yield runner
    runner.close()


def test_an_fp8_plan_takes_the_blocks_linear_layers_but_the_kept_ones(qwen_runner):
    network = qwen_runner.family.network
    family = family_of(qwen_runner.pipeline)
    everything = Fp8Plan(tuple(network._repeated_blocks), family.fp8_kept).layers(network)
    assert "transformer_blocks.0.attn.to_q" in everything and "transformer_blocks.1.img_mlp.net.2" in everything
    assert not any(name.startswith(("img_in", "txt_in", "proj_out", "time_text_embed")) for name in everything)
    layers = Fp8Plan(tuple(network._repeated_blocks), ("*.img_mlp.*",)).layers(network)  # fp8_kept: "*.img_mlp.*"
    assert set(layers) < set(everything) and not any(".img_mlp." in name for name in layers)
    assert "transformer_blocks.1.txt_mlp.net.2" in layers


def test_fp8_skips_layers_whose_sizes_its_matmul_cannot_take():
    """Z-Image's tiny feed-forward is 85 wide: not a multiple of 16, so left in its dtype."""
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-z-image"))
    try:
        network = runner.family.network
        layers = Fp8Plan(tuple(network._repeated_blocks)).layers(network)
        assert layers and not any(".feed_forward." in name for name in layers)
    finally:
        runner.close()


@pytest.mark.parametrize(("settings", "message"), [
    ({"quantization": "fp8"}, "quantization 'fp8' needs a GPU with FP8 tensor cores"),
    ({"quantization": "int4"}, "quantization must be one of none, fp8"),
    ({"quantization": "fp8", "fp8_scales": "block"}, "fp8_scales must be one of row, tensor"),
    ({"quantization": "fp8", "lora_adapters": {"a": "/nowhere"}}, "not with lora_adapters"),
    ({"attention_backend": "_flash_3"}, "attention_backend '_flash_3': this host cannot run it"),
    ({"attention_backend": "warp-speed"}, "attention_backend 'warp-speed': this host cannot run it"),
    ({"attention_backend": "native", "sp_devices": ("cpu",), "batching": "step"},
     "sequence parallel does not combine with attention_backend"),
    ({"fuse_projections": True, "sp_devices": ("cpu",), "batching": "step"},
     "sequence parallel does not combine with fuse_projections"),
    ({"gelu_epilogue": True}, "gelu_epilogue: needs a GPU and bfloat16 or float16 .*, not cpu in float32"),
    ({"gelu_epilogue": True, "lora_adapters": {"a": "/nowhere"}}, "gelu_epilogue: not with lora_adapters"),
    ({"gelu_epilogue": True, "quantization": "fp8"}, "gelu_epilogue: not with quantization 'fp8'"),
    ({"gelu_epilogue": True, "exact_batching": "pipeline"}, "gelu_epilogue: not with exact_batching pipeline"),
    ({"gelu_epilogue": True, "sp_devices": ("cpu",), "batching": "step"},
     "sequence parallel does not combine with gelu_epilogue"),
])
def test_what_this_host_cannot_run_is_refused_at_load_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        DiffusionRunner(DiffusionRunnerConfig(QWEN, **settings))


def test_a_gelu_epilogue_is_refused_by_name_for_a_dit_without_a_gelu_feed_forward():
    with pytest.raises(ValueError, match="gelu_epilogue: the z_image family's DiT has no feed-forward with a tanh"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-z-image", gelu_epilogue=True))


def test_a_unet_takes_neither():
    with pytest.raises(ValueError, match="the stable_diffusion family has no diffusion transformer"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", quantization="fp8"))


def test_auto_keeps_pytorchs_sdpa_on_the_cpu_and_a_named_kernel_is_checked_there():
    assert resolve_attention("auto", torch.device("cpu"), torch.float32, 2, 16) == "native"
    assert resolve_attention("_native_math", torch.device("cpu"), torch.float32, 2, 16) == "_native_math"


def test_a_network_keeps_its_own_kernel_after_another_in_the_process_set_a_different_one():
    """diffusers' ``set_attention_backend`` also sets a process-wide active backend, which a
    processor left unset follows: a second runner choosing PyTorch's SDPA must set it on its own
    network, not run the first runner's kernel (on a GPU: FlashAttention-4 on a head size it refuses)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    before, _ = _AttentionBackendRegistry.get_active_backend()
    first = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-wan", attention_backend="_native_math"))
    second = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-wan"))
    try:
        for runner, expected in ((first, "_native_math"), (second, "native")):
            kernels = {m.processor._attention_backend for m in runner.family.network.modules()
                       if hasattr(getattr(m, "processor", None), "_attention_backend")}
            assert kernels == {AttentionBackendName(expected)}
    finally:
        first.close()
        second.close()
        # the later tests' own pipelines (diffusers' reference calls) follow the process-wide backend
        _AttentionBackendRegistry.set_active_backend(before)


def test_a_kernel_that_takes_no_mask_serves_only_a_family_whose_passes_never_pad():
    cpu = torch.device("cpu")
    assert resolve_attention("_native_flash", cpu, torch.float32, 2, 16, masked=False) == "_native_flash"
    with pytest.raises(ValueError, match=r"attention_backend '_native_flash'.*attn_mask"):
        resolve_attention("_native_flash", cpu, torch.float32, 2, 16, masked=True)


@pytest.mark.parametrize(("model", "frames"), [("demo:tiny-qwen-image", 0), ("demo:tiny-wan", 21)])
def test_auto_times_the_kernels_over_a_typical_requests_tokens(model, frames):
    """A 1024² image's patches and 256 prompt tokens; a video's 81 frames (21 latent) at 832x480 (the
    kernels rank otherwise there: on an H200 FlashAttention-4 won at Wan 2.1's 32,760 tokens and
    lost at an image's)."""
    runner = DiffusionRunner(DiffusionRunnerConfig(model))
    try:
        side = runner.family.size_multiple()
        expected = frames * (480 // side) * (832 // side) if frames else (1024 // side) ** 2 + 256
        assert runner.family.attention_tokens() == expected
    finally:
        runner.close()


def test_flash_attention_4_is_refused_by_the_package_it_needs_where_that_is_missing():
    """Diffusers would fetch that kernel from the Hub; this project runs it only from the installed
    flash-attn-4 package (tests/gpu runs it), and says so where the package is absent."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn-4 is installed here")
    with pytest.raises(ValueError, match=r"attention_backend 'flash_4_hub'.*flash-attn-4 package, which is not "
                                         r"installed here \(pip install flash-attn-4\)"):
        resolve_attention("flash_4_hub", torch.device("cpu"), torch.float32, 2, 16)


def test_flash_attention_3_is_refused_naming_the_vllm_build_it_runs_where_that_is_missing():
    """``_flash_3_hub`` runs vLLM's FlashAttention-3 library (a CUDA wheel's); here vLLM is the CPU
    build, which has none, and the refusal says which file it looked for."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and any(Path(f, *VLLM_FLASH_ATTENTION_3).is_file()
                                for f in spec.submodule_search_locations or []):
        pytest.skip("vLLM's FlashAttention-3 is installed here")
    with pytest.raises(ValueError, match=r"attention_backend '_flash_3_hub'.*vLLM's FlashAttention-3 build, which "
                                         r"is not installed here.*(vllm_flash_attn/_vllm_fa3_C.abi3.so|not installed)"):
        resolve_attention("_flash_3_hub", torch.device("cpu"), torch.float32, 2, 16)


@pytest.mark.parametrize(("settings", "message"), [
    ({"engine": "transformers", "quantization": "fp8"}, "quantization 'fp8' is vLLM's own FP8: this model runs on "
                                                         "transformers"),
    ({"engine": "vllm", "quantization": "fp8"}, "quantization 'fp8' needs a GPU"),
    ({"engine": "transformers", "quantization": "int8"}, "quantization must be 'none' or 'fp8'"),
])
def test_the_text_stages_fp8_is_vllms_on_a_gpu_and_refused_elsewhere_by_name(settings, message):
    from triton_omni.ar.runner import ArRunner, ArRunnerConfig

    with pytest.raises(ValueError, match=message):
        ArRunner(ArRunnerConfig("demo:tiny-qwen2", **settings))


@pytest.mark.parametrize("shape", [(2, 64, 16, 16), (1, 32, 3, 8, 8)], ids=["image", "video"])
@pytest.mark.parametrize("affine", [True, False])
def test_the_spread_group_norm_is_pytorchs(shape, affine):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3 + 1.5  # an offset: the variance is not the mean square
    weight, bias = (torch.randn(shape[1], generator=generator) for _ in range(2)) if affine else (None, None)
    expected = torch.nn.functional.group_norm(x, 8, weight, bias, 1e-6)
    assert torch.allclose(group_norm(x, 8, weight, bias, 1e-6), expected, atol=1e-5)
    # bf16 in and out: the statistics in float32, one rounding; a rare value a unit apart
    low = group_norm(x.bfloat16(), 8, weight, bias, 1e-6)
    assert low.dtype == torch.bfloat16
    assert float((low.float() - expected).abs().max()) <= 0.07
    # a channels-last input (cuDNN's choice after some convolutions) comes out contiguous, as PyTorch's does
    if len(shape) == 4:
        out = group_norm(x.to(memory_format=torch.channels_last), 8, weight, bias, 1e-6)
        assert out.is_contiguous() and torch.allclose(out, expected, atol=1e-5)
    # with autograd on (a VAE outside no_grad): PyTorch's own, gradients and all
    trained = torch.nn.GroupNorm(8, shape[1], affine=affine)
    with torch.enable_grad():
        spread = group_norm(x, 8, trained.weight, trained.bias, trained.eps)
    assert torch.allclose(spread, trained(x), atol=1e-6) and (spread.requires_grad == affine)
    # and it is not the identity: other groups give another result
    assert not torch.allclose(group_norm(x, 4, weight, bias, 1e-6), expected, atol=1e-2)


def test_a_vae_whose_group_norms_are_spread_decodes_as_before():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=16).eval()
    latents = torch.randn(2, 4, 16, 16)
    with torch.inference_mode():
        expected = vae.decode(latents).sample
        assert spread_group_norms(vae) == sum(isinstance(m, torch.nn.GroupNorm) for m in vae.modules()) > 0
        spread = vae.decode(latents).sample
        other = vae.decode(latents.flip(-1)).sample
    assert torch.allclose(spread, expected, atol=1e-5)
    assert float((other - expected).abs().mean()) > 100 * float((spread - expected).abs().max())


def test_a_video_vae_with_channels_last_convolutions_decodes_the_same_frames():
    """Wan's VAE with its 3-D convolutions' weights in ``channels_last_3d`` (what a served
    ``diffusion`` keeps on a GPU): the same sums in another order, so within float32 rounding of
    the default layout's frames, and other latents land far past that."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    latents = torch.randn(1, 4, 2, 4, 4)
    with torch.inference_mode():
        expected = vae.decode(latents).sample
        count = channels_last_convolutions(vae)
        assert count == sum(isinstance(m, torch.nn.Conv3d) for m in vae.modules()) > 0
        assert all(m.weight.is_contiguous(memory_format=torch.channels_last_3d)
                   for m in vae.modules() if isinstance(m, torch.nn.Conv3d))
        frames = vae.decode(latents).sample
        other = vae.decode(latents.flip(-1)).sample
    assert torch.allclose(frames, expected, atol=1e-5)
    assert float((other - expected).abs().mean()) > 100 * float((frames - expected).abs().max())


def test_a_video_vae_whose_convolutions_pad_space_decodes_the_same_frames():
    """Wan's VAE with its causal convolutions padding height and width themselves (what a served
    ``diffusion`` runs on a GPU), decoding several latent frames (the cache of earlier frames, and
    the first frame's zeros in time): within float32 rounding of diffusers' own padding, and other
    latents land far past that. Its encoder too (an image-to-video request's first frame)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    latents, video = torch.randn(1, 4, 3, 4, 4), torch.randn(1, 3, 5, 32, 32)
    with torch.inference_mode():
        expected, encoded = vae.decode(latents).sample, vae.encode(video).latent_dist.mode()
        count = convolutions_pad_space(vae)
        frames, reencoded = vae.decode(latents).sample, vae.encode(video).latent_dist.mode()
        other = vae.decode(latents.flip(-1)).sample
    assert count == sum(hasattr(m, "_padding") for m in vae.modules()) > 0
    assert torch.allclose(frames, expected, atol=1e-5) and torch.allclose(reencoded, encoded, atol=1e-5)
    assert float((other - expected).abs().mean()) > 100 * float((frames - expected).abs().max())


def test_a_causal_convolution_padding_space_crops_a_longer_cache_as_diffusers_does():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(0)
    convolution = WanCausalConv3d(2, 2, 3, padding=1)
    x, cache = torch.randn(1, 2, 1, 4, 4), torch.randn(1, 2, 3, 4, 4)  # 3 cached frames, a padding of 2
    with torch.inference_mode():
        expected = convolution(x, cache)
        convolutions_pad_space(convolution)
        assert torch.allclose(convolution(x, cache), expected, atol=1e-6)


def test_the_vae_decode_benchmark_prints_both_group_norms(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import vae_decode

    vae_decode.main(["--vae", "flux1", "--size", "32", "--batch", "2", "--rounds", "1"])
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("flux1")]
    assert row[:3] == ["flux1", "32", "2"] and float(row[3]) > 0 and float(row[4]) > 0


def test_the_vae_decode_benchmark_times_wans_eager_variants_and_restores_the_defaults(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import vae_decode

    vae_decode.main(["--vae", "wan", "--size", "16", "--frames", "5", "--batch", "1", "--rounds", "1",
                     "--ways", "tf32,channels-last,served", "--profile", "3"])
    out = capsys.readouterr().out
    for way in ("tf32", "channels-last", "served"):
        [line] = [line for line in out.splitlines() if line.strip().startswith(f"{way}:")]
        assert "of the default" in line and "levels from it" in line
    assert "profile of one decode" in out and not torch.backends.cuda.matmul.allow_tf32


def test_the_attention_benchmark_reads_flashattention_4_tiles_and_refuses_a_malformed_one(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import attention_kernels

    assert attention_kernels.fa4_tile("128x176") == {"tile_mn": (128, 176)}
    assert attention_kernels.fa4_tile("192x128:nors:nool") == {"tile_mn": (192, 128), "mma_pv_is_rs": False,
                                                               "intra_wg_overlap": False}
    with pytest.raises(SystemExit, match="unknown flag 'rs'"):
        attention_kernels.fa4_tile("128x128:rs")


# family: (demo, {an attention layer: the fused layer it reads}, the request's own inputs)
FUSED = {"flux1": ("demo:tiny-flux1-dev", {"transformer_blocks.0.attn": "to_qkv"}, {"guidance_scale": 3.5}),
         # the self-attention's q, k and v one layer; the cross-attention's k and v (its q reads the video)
         "wan": ("demo:tiny-wan", {"blocks.0.attn1": "to_qkv", "blocks.0.attn2": "to_kv"},
                 {"guidance_scale": 5.0, "num_frames": 5})}


@pytest.mark.parametrize("family", FUSED)
def test_fused_projections_give_the_unfused_image(family):
    """q, k and v as one layer (``fuse_projections``): the same sums, so within float32 rounding of
    the unfused image (every frame of a video), with the unfused layers gone (the attention reads
    the fused one). Another prompt moves the image far past that tolerance."""
    demo, layers, options = FUSED[family]
    request = {"prompt": "a red fox", "num_inference_steps": 3, "height": 32, "width": 32, "seed": 7} | options
    images = {}
    for fused in (False, True):
        runner = DiffusionRunner(DiffusionRunnerConfig(demo, batching="step", fuse_projections=fused))
        try:
            for name, fused_layer in layers.items():
                attention = runner.family.network.get_submodule(name)
                assert hasattr(attention, fused_layer) == fused, name
                assert hasattr(attention, "to_k") == hasattr(attention, "to_v") == (not fused), name
            images[fused] = runner.submit(runner.parse(request)).result().int()
            if fused:
                other = runner.submit(runner.parse(request | {"prompt": "a blue whale"})).result().int()
        finally:
            runner.close()
    assert int((images[True] - images[False]).abs().max()) <= 1
    assert int((other - images[True]).abs().max()) > 10


def test_fused_projections_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="fuse_projections: the qwen_image family's attention does not take"):
        DiffusionRunner(DiffusionRunnerConfig(QWEN, fuse_projections=True))
    with pytest.raises(ValueError, match="fuse_projections: not with lora_adapters"):
        DiffusionRunnerConfig(QWEN, fuse_projections=True, lora_adapters={"a": "/nowhere"})


def test_a_gelu_epilogue_is_its_layer_and_activation_and_only_a_gpus_bf16_layers_take_it():
    """``fuse_gelu_epilogues``: a tanh GELU's projection and activation as one
    ``torch._addmm_activation``. On the CPU PyTorch's op applies the exact GELU (cuBLASLt's epilogue
    and its CUDA fallback the tanh one), so the module's plumbing (rows, weight, bias, shape) is held
    to the exact GELU here; tests/gpu/test_kernels.py holds the GPU's to the unfused forward. No
    layer on the CPU, nor in float32, is fused."""
    from diffusers.models.activations import GELU
    from triton_omni.diffusion.kernels import _gelu_epilogue_class

    torch.manual_seed(0)
    module = GELU(16, 24, approximate="tanh")
    x = torch.randn(2, 5, 16)
    exact = torch.nn.functional.gelu(module.proj(x))
    assert fuse_gelu_epilogues(torch.nn.Sequential(module)) == 0  # float32, on the CPU
    module.__class__ = _gelu_epilogue_class()
    with torch.no_grad():
        fused = module(x)
    assert fused.shape == (2, 5, 24)
    torch.testing.assert_close(fused, exact, rtol=1e-5, atol=1e-6)
    assert (fused - torch.nn.functional.gelu(module.proj(x), approximate="tanh")).abs().max() > 1e-5
