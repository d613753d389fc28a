"""A VAE's decode with PyTorch's group norms against the ones a served ``diffusion`` runs on a GPU
(``kernels.group_norm``, spread over the whole GPU: docs/models.md, "The VAE's group norms"), side
by side in one process, at the real shapes (random weights): FLUX.1's ``AutoencoderKL`` (also
Z-Image's) and FLUX.2's ``AutoencoderKLFlux2``.

``--vae wan`` times Wan's video VAE instead (``AutoencoderKLWan``, float32 as its model card and
the served pipeline load it; 81 frames at 832x480): it has no group norms, so its second column is
the same decode with cuDNN's benchmark mode (each convolution's fastest algorithm, timed at its
first call of a shape), and the error column is the distance from PyTorch's default decode.
``--compile`` adds Wan's decoder under torch.compile as ``compile: vae`` compiles it (its forward,
``COMPILE_OPTIONS``; ``static``: ``dynamic=False`` too): the first decode's seconds (the compile),
the graphs compiled in it and in the timed rounds after it (a graph compiled there is a decode
that the warm-up did not prepare), the milliseconds per decode and the ratio to the eager one.
``--ways`` adds eager variants (``tf32``: float32 matmuls on TF32 tensor cores; ``channels-last``:
cuDNN's NDHWC convolutions; ``served``: those, each causal convolution padding height and width
itself, as a served ``diffusion`` decodes) with their distance from the default decode;
``--profile N`` the N costliest kernels of one default decode.

For each batch size it prints the milliseconds of one decode each way and their ratio, the time
per image, and how far each bf16 image is from the float32 decode of the same latents (mean
difference in levels of 255): the spread group norm only reorders sums, so it must be no further.
Decoding each image alone (what step batching does with spread group norms) costs the batch-1 row
per image.

    python benchmarks/vae_decode.py                               # GPU: 1024², batches 1, 2, 4
    python benchmarks/vae_decode.py --vae wan --batch 1 --rounds 2   # GPU: a Wan 2.1 video's decode
    python benchmarks/vae_decode.py --vae wan --batch 1 --rounds 2 --compile default,static
    python benchmarks/vae_decode.py --vae wan --batch 1 --rounds 2 --ways channels-last,served --profile 15
    .venv/bin/python benchmarks/vae_decode.py --size 64 --rounds 1   # CPU: a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from triton_omni.demo_models import built_as
from triton_omni.diffusion.kernels import channels_last_convolutions, convolutions_pad_space, spread_group_norms
from triton_omni.diffusion.runner import COMPILE_OPTIONS, CompileWatch
from triton_omni.families.flux1 import realistic_vae as flux1_vae


def flux2_vae():
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2()


def wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan()


VAES = {"flux1": flux1_vae, "flux2": flux2_vae, "wan": wan_vae}


def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """The decoded image (or frames) in levels of 255."""
    with torch.inference_mode():
        return (vae.decode(latents.to(vae.dtype)).sample.float().clamp(-1, 1) + 1) * 127.5


def timed_decode(vae, latents: torch.Tensor, rounds: int) -> tuple[float, torch.Tensor]:
    """(seconds per decode, the image in levels of 255) after a warm-up decode."""
    decode(vae, latents)
    synchronize(latents.device)
    started = time.perf_counter()
    for _ in range(rounds):
        image = decode(vae, latents)
    synchronize(latents.device)
    return (time.perf_counter() - started) / rounds, image


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pytorchs_group_norms(vae) -> None:
    for module in vae.modules():
        module.__dict__.pop("forward", None)  # spread_group_norms's instance attribute


def run(name: str, size: int, batches: list[int], rounds: int, device: torch.device, dtype: torch.dtype,
        frames: int, compiles: list[str], ways: list[str], profile: int) -> None:
    with built_as(device, torch.float32):
        vae = VAES[name]().eval()
    if name == "wan":
        return run_video(vae, size, frames, batches, rounds, device, compiles, ways, profile)
    side = size // 8  # both VAEs upsample 8x
    for batch in batches:
        generator = torch.Generator(device).manual_seed(batch)
        latents = torch.randn(batch, vae.config.latent_channels, side, side, device=device, generator=generator)
        vae.to(torch.float32)
        pytorchs_group_norms(vae)
        _, exact = timed_decode(vae, latents, 1)
        vae.to(dtype)
        native_s, native = timed_decode(vae, latents, rounds)
        spread_group_norms(vae)
        spread_s, spread = timed_decode(vae, latents, rounds)
        errors = [float((image - exact).abs().mean()) for image in (native, spread)]
        print(f"{name:6s} {size:5d} {batch:5d} {native_s * 1e3:10.2f} {spread_s * 1e3:10.2f} "
              f"{spread_s / native_s:7.3f} {native_s * 1e3 / batch:10.2f} {spread_s * 1e3 / batch:10.2f} "
              f"{errors[0]:9.3f} {errors[1]:9.3f}", flush=True)


def run_video(vae, size: int, frames: int, batches: list[int], rounds: int, device: torch.device,
              compiles: list[str], ways: list[str], profile: int) -> None:
    """Wan's decode in float32, PyTorch's defaults against cuDNN's benchmark mode, then against
    each of ``ways`` and ``compiles``; ``profile``: the top kernels of one default decode."""
    width, height = (832, 480) if size == 1024 else (size, size)
    shape = (vae.config.z_dim, (frames - 1) // 4 + 1, height // 8, width // 8)
    print("wan: its columns 'spread' are cuDNN's benchmark mode, 'err sp' its distance from the default decode")
    for batch in batches:
        generator = torch.Generator(device).manual_seed(batch)
        latents = torch.randn(batch, *shape, device=device, generator=generator)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False):
            native_s, native = timed_decode(vae, latents, rounds)
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):
            tuned_s, tuned = timed_decode(vae, latents, rounds)
        print(f"{'wan':6s} {f'{width}x{height}x{frames}':>13s} {batch:5d} {native_s * 1e3:10.2f} "
              f"{tuned_s * 1e3:10.2f} {tuned_s / native_s:7.3f} {native_s * 1e3 / batch:10.2f} "
              f"{tuned_s * 1e3 / batch:10.2f} {0.0:9.3f} {float((tuned - native).abs().mean()):9.3f}", flush=True)
        for way in ways:
            with VIDEO_WAYS[way](vae, latents) as (vae_way, latents_way):
                way_s, image = timed_decode(vae_way, latents_way, rounds)
            print(f"  {way}: {way_s * 1e3:.2f} ms a decode ({way_s / native_s:.3f} of the default), "
                  f"{float((image - native).abs().mean()):.3f} levels from it (max "
                  f"{float((image - native).abs().max()):.1f})", flush=True)
        for way in compiles:
            compiled_decode(vae, latents, rounds, way, native_s, native)
        if profile:
            profile_decode(vae, latents, profile)


@contextlib.contextmanager
def tf32_matmuls(vae, latents):
    """Float32 matmuls (the decoder's attention and linear layers) on TF32 tensor cores, as its
    convolutions already are (cuDNN's default)."""
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield vae, latents
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


@contextlib.contextmanager
def channels_last(vae, latents):
    """The 3-D convolutions' weights in ``channels_last_3d`` (cuDNN's NDHWC convolutions), as a
    served ``diffusion`` keeps a video VAE's on a GPU (``kernels.channels_last_convolutions``)."""
    channels_last_convolutions(vae)
    try:
        yield vae, latents
    finally:
        for convolution in (m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)):
            convolution.weight.data = convolution.weight.data.contiguous()


@contextlib.contextmanager
def served(vae, latents):
    """As a served ``diffusion`` decodes on a GPU: the convolutions in ``channels_last_3d``, the
    causal ones padding height and width themselves (``kernels.convolutions_pad_space``)."""
    padded = [m for m in vae.modules() if hasattr(m, "_padding")]
    convolutions_pad_space(vae)
    try:
        with channels_last(vae, latents) as ways:
            yield ways
    finally:
        for convolution in padded:
            del convolution.forward


VIDEO_WAYS = {"tf32": tf32_matmuls, "channels-last": channels_last, "served": served}


def profile_decode(vae, latents: torch.Tensor, top: int) -> None:
    """One eager decode under the profiler: its ``top`` costliest kernels (operators on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = latents.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        decode(vae, latents)
        synchronize(latents.device)
    spent = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = sorted(((e.key, getattr(e, spent), e.count) for e in prof.key_averages()), key=lambda k: -k[1])
    total = sum(us for _, us, _ in kernels) or 1.0
    print(f"  profile of one decode: {total / 1e3:.2f} ms of kernels")
    for name, us, count in kernels[:top]:
        print(f"  {us / 1e3:>9.3f} ms {us / total:>6.1%} {count:>5}x  {name[:110]}")


COMPILE_WAYS = {"default": COMPILE_OPTIONS, "static": {**COMPILE_OPTIONS, "dynamic": False}}


def compiled_decode(vae, latents: torch.Tensor, rounds: int, way: str, eager_s: float, eager: torch.Tensor) -> None:
    """The decode with the decoder's forward compiled ``way``, as ``compile: vae`` compiles it."""
    torch._dynamo.reset()  # the last way's graphs (and its callbacks: the watch comes after)
    graphs: list[float] = []
    watch = CompileWatch(graphs.append)
    decoder = vae.decoder
    decoder.forward = torch.compile(decoder.__class__.forward.__get__(decoder), **COMPILE_WAYS[way])
    try:
        started = time.perf_counter()
        decode(vae, latents)  # it compiles
        synchronize(latents.device)
        first_s, first_graphs = time.perf_counter() - started, len(graphs)
        compiled_s, image = timed_decode(vae, latents, rounds)  # a warm-up decode, then the rounds
        later = len(graphs) - first_graphs
    finally:
        watch.close()
        del decoder.forward
    compiling, error = sum(graphs[:first_graphs]), float((image - eager).abs().mean())
    print(f"  compiled ({way}): first decode {first_s:.1f} s, {first_graphs} graphs ({compiling:.1f} s compiling); "
          f"then {compiled_s * 1e3:.2f} ms a decode ({compiled_s / eager_s:.3f} of eager), {later} graphs compiled "
          f"after the first decode; {error:.3f} levels from eager", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default="flux1,flux2", help="comma-separated: flux1, flux2, wan")
    parser.add_argument("--size", type=int, default=1024,
                        help="the image's side in pixels (wan: 1024 for its 832x480, else a square)")
    parser.add_argument("--frames", type=int, default=81, help="wan: the video's frames")
    parser.add_argument("--batch", default="1,2,4", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--compile", default="", help="wan: comma-separated compiled decoders to time beside the "
                        "eager one: " + ", ".join(COMPILE_WAYS))
    parser.add_argument("--ways", default="", help="wan: comma-separated eager variants to time beside the "
                        "default decode: " + ", ".join(VIDEO_WAYS))
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="wan: the N costliest kernels of one default decode")
    args = parser.parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # its note on casting a VAE with to(), once per cast
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"{device}, {dtype}; ms per decode, then per image; mean difference from the float32 decode, of 255")
    print(f"{'vae':6s} {'size':>5s} {'batch':>5s} {'pytorch':>10s} {'spread':>10s} {'s/p':>7s} "
          f"{'pytorch/im':>10s} {'spread/im':>10s} {'err pt':>9s} {'err sp':>9s}")
    for name in args.vae.split(","):
        run(name, args.size, [int(b) for b in args.batch.split(",")], args.rounds, device, dtype, args.frames,
            [way for way in args.compile.split(",") if way], [way for way in args.ways.split(",") if way], args.profile)


if __name__ == "__main__":
    main()
