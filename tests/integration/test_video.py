"""A video family served end to end (`omni-triton serve --demo wan`): every route gives the frames
of `WanPipeline` called the way its users call it (the same prompt, negative prompt left out or
given, guidance, steps, size, frame count and seed), every frame within 1/255 per pixel. The tiny
pipeline is sensitive enough for that to mean something: another prompt, negative prompt,
guidance, step count or frame count moves its frames by tens of levels
(tests/unit/test_demo_sensitivity.py).

The routes: `diffusion` with the prompt as text, `diffusion` with `ar_encoder`'s embeddings (the
pipeline's own UMT5 encoding), the `text_to_image` ensemble, which ends in the video for a video
family, and the `omni` scheduler (modalities `["video"]`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from triton_omni_client import OmniClient, OmniError, Video
from triton_omni_client.video import decode_mp4
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

from tests.support.pipelines import ABSENT, levels_apart, reference

OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 5, "seed": 7, "guidance_scale": 4.0}
PROMPT = "a red fox"


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory):
    models = ["ar_encoder", "diffusion", "text_to_image", "omni"]
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", load_models=models, demo="wan",
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with TritonServer(options) as server:
        yield server


def served(route: str, client: OmniClient, negative):
    given = {} if negative is ABSENT else {"negative_prompt": negative}
    if route == "diffusion":
        return client.generate_video(PROMPT, **given, **OPTIONS)
    if route == "diffusion_embeds":
        conditioning = client.encode_conditioning(PROMPT, given.get("negative_prompt"))
        conditioning.pop("pooled_prompt_embeds", None)
        if not given:
            del conditioning["negative_prompt_embeds"]
        return client.generate_video(**conditioning, **OPTIONS)
    if route == "text_to_image":
        return client.generate_video(PROMPT, model="text_to_image", **given, **OPTIONS)
    assert route == "omni"
    [event] = [event for event in client.generate(PROMPT, modalities=["video"], **given, **OPTIONS)
               if event.video is not None]
    assert event.image is None and event.image_index == [0] and event.video.shape[0] == 1
    return Video(event.video[0], event.fps)


@pytest.mark.parametrize("negative", [ABSENT, "blurry"], ids=["absent", "text"])
@pytest.mark.parametrize("route", ["diffusion", "diffusion_embeds", "text_to_image", "omni"])
def test_every_route_gives_the_pipelines_frames(wan_server, route, negative):
    video = served(route, OmniClient(wan_server.grpc_url), negative)
    expected = reference("wan", PROMPT, negative, **OPTIONS)
    assert video.frames.shape == expected.shape == (5, 32, 32, 3)
    assert levels_apart(video.frames, expected) <= 1
    assert video.fps == 16.0


def test_a_frame_count_the_vae_cannot_take_is_refused_by_name_and_the_next_request_served(wan_server):
    client = OmniClient(wan_server.grpc_url)
    for frames, message in ((6, "1 \\+ a multiple of 4.*5 or 9"), (0, "must be in")):
        with pytest.raises(OmniError, match=f"num_frames.*{message}") as caught:
            client.generate_video(PROMPT, **(OPTIONS | {"num_frames": frames}))
        assert caught.value.status == "INVALID_ARG"
    with pytest.raises(OmniError, match="generate_video"):  # an image asked of a video model: named, not a crash
        client.generate_image(PROMPT, **OPTIONS)
    assert client.generate_video(PROMPT, **(OPTIONS | {"num_frames": 1})).frames.shape == (1, 32, 32, 3)


def test_the_frames_differ_with_the_seed(wan_server):
    """The parity above can fail: another seed's frames are far from the pipeline's."""
    video = OmniClient(wan_server.grpc_url).generate_video(PROMPT, **(OPTIONS | {"seed": 8}))
    assert levels_apart(video.frames, reference("wan", PROMPT, **OPTIONS)) >= 10
    assert not np.array_equal(video.frames[0], video.frames[-1])  # frames, not one image repeated


def test_the_cli_writes_the_frames_and_an_mp4_of_them(wan_server, tmp_path):
    """`omni-triton generate-video`: OUT.npy holds the served frames as they are (the pipeline's,
    within 1 level), OUT.mp4 the same frames through H.264 (lossy: its PSNR is printed)."""
    cli = [str(Path(sys.executable).parent / "omni-triton"), "generate-video", PROMPT, "--url", wan_server.grpc_url,
           "--steps", "2", "--seed", "7", "--guidance", "4", "--height", "32", "--width", "32", "--frames", "5"]
    expected = reference("wan", PROMPT, **OPTIONS)
    for suffix in (".npy", ".mp4"):
        subprocess.run([*cli, "--out", str(tmp_path / f"video{suffix}")], check=True)
    assert levels_apart(np.load(tmp_path / "video.npy"), expected) <= 1
    frames, fps = decode_mp4((tmp_path / "video.mp4").read_bytes())
    assert frames.shape == expected.shape and fps == 16.0
    error = np.mean((frames.astype(float) - expected) ** 2)
    print(f"MP4 (H.264, crf 18) against the served frames: PSNR {10 * np.log10(255 ** 2 / error):.1f} dB")
