"""What a DiT runs on (kernels.py): ``quantization: fp8`` and ``attention_backend``, as a CPU host
can check them. FP8's images and the kernels' timings are the GPU's (tests/gpu/test_kernels.py,
benchmarks/families.py); here: which layers an FP8 plan takes, every setting this host cannot run
refused at load naming its parameter, and ``auto`` keeping PyTorch's SDPA on the CPU."""

from __future__ import annotations

import pytest
import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.kernels import Fp8Plan, resolve_attention
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
    ({"quantization": "fp8", "lora_adapters": {"a": "/nowhere"}}, "not with lora_adapters"),
    ({"attention_backend": "_flash_3"}, "attention_backend '_flash_3': this host cannot run it"),
    ({"attention_backend": "warp-speed"}, "attention_backend 'warp-speed': this host cannot run it"),
    ({"attention_backend": "native", "sp_devices": ("cpu",), "batching": "step"},
     "sequence parallel does not combine with attention_backend"),
])
def test_what_this_host_cannot_run_is_refused_at_load_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        DiffusionRunner(DiffusionRunnerConfig(QWEN, **settings))


def test_a_unet_takes_neither():
    with pytest.raises(ValueError, match="the stable_diffusion family has no diffusion transformer"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", quantization="fp8"))


def test_auto_keeps_pytorchs_sdpa_on_the_cpu_and_a_named_kernel_is_checked_there():
    assert resolve_attention("auto", torch.device("cpu"), torch.float32, 2, 16) == "native"
    assert resolve_attention("_native_math", torch.device("cpu"), torch.float32, 2, 16) == "_native_math"


def test_a_kernel_that_takes_no_mask_serves_only_a_family_whose_passes_never_pad():
    cpu = torch.device("cpu")
    assert resolve_attention("_native_flash", cpu, torch.float32, 2, 16, masked=False) == "_native_flash"
    with pytest.raises(ValueError, match=r"attention_backend '_native_flash'.*attn_mask"):
        resolve_attention("_native_flash", cpu, torch.float32, 2, 16, masked=True)


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
