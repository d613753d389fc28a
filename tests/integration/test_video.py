"""A video family served end to end (`omni-triton serve --demo wan`): every route gives the frames
of `WanPipeline` called the way its users call it (the same prompt, negative prompt left out or
given, guidance, steps, size, frame count and seed), every frame within 1/255 per pixel. The tiny
pipeline is sensitive enough for that to mean something: another prompt, negative prompt,
guidance, step count or frame count moves its frames by tens of levels
(tests/unit/test_demo_sensitivity.py).

The routes: `diffusion` with the prompt as text, `diffusion` with `ar_encoder`'s embeddings (the
pipeline's own UMT5 encoding), the `text_to_image` ensemble, which ends in the video for a video
family, the `omni` scheduler (modalities `["video"]`), and the OpenAI gateway's `/v1/videos` jobs
through the `openai` SDK's `videos` (its MP4 lossy: the raw frames come through the gateway's
`frames` variant). Then Wan 2.2 TI2V (`serve --demo wan2.2`) given a first image, through every
route and as `/v1/videos`' `input_reference`, against `WanImageToVideoPipeline`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from triton_omni_client import OmniClient, OmniError, Video
from triton_omni_client.video import decode_mp4, encode_mp4
from triton_omni_tools.gateway import Gateway
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, PROJECT_ROOT, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_model

from tests.support.images import png
from tests.support.pipelines import ABSENT, levels_apart, reference
from tests.support.server import metric_value

# the openai SDK warns that OpenAI's own video service is closing; the API's shape is what is served here
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 5, "seed": 7, "guidance_scale": 4.0}
PROMPT = "a red fox"


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory):
    models = ["ar_encoder", "diffusion", "text_to_image", "omni", "diffusion_stream"]
    variants = tmp_path_factory.mktemp("variants")  # diffusion decoupled: a response per denoising step
    copy_model(PROJECT_ROOT / "model_repository", "diffusion", variants, "diffusion_stream", decoupled=True,
               parameters={"model": "demo:tiny-wan"})
    options = ServerOptions(model_repositories=[*DEFAULT_REPOSITORIES, variants], http_port=free_port(),
                            grpc_port=free_port(), metrics_port=free_port(),
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


def test_a_decoupled_model_streams_each_step_then_the_frames(wan_server):
    """``diffusion_stream`` (diffusion with ``decoupled: true``): progress per denoising step, in
    order, then the frames, the batched model's."""
    steps = []
    client = OmniClient(wan_server.grpc_url)
    video = client.stream_video(PROMPT, on_progress=lambda step, total: steps.append((step, total)),
                                **(OPTIONS | {"num_inference_steps": 4}))
    assert steps == sorted(steps) and steps[-1] == (4, 4) and all(total == 4 for _, total in steps)
    assert video.fps == 16.0
    assert np.array_equal(video.frames, client.generate_video(PROMPT, **(OPTIONS | {"num_inference_steps": 4})).frames)
    with pytest.raises(OmniError, match="returned no image: it makes videos"):
        client.stream_image(PROMPT, **OPTIONS)


def test_frames_through_shared_memory_are_the_served_frames(wan_server):
    """A client on the server's host receives the frames (97 MB at Wan's 480p and 81 frames) through
    system shared memory, not in the gRPC message: the same frames, and the same errors."""
    expected = OmniClient(wan_server.grpc_url).generate_video(PROMPT, **OPTIONS)
    with OmniClient(wan_server.grpc_url, shared_memory=True, admin_key=wan_server.admin_key) as client:
        video = client.generate_video(PROMPT, **OPTIONS)
        assert np.array_equal(video.frames, expected.frames) and video.fps == expected.fps
        unsized = client.generate_video(PROMPT, **{k: v for k, v in OPTIONS.items() if k != "num_frames"},
                                        seconds=0.25)  # its size unknown before the call: in the message
        assert np.array_equal(unsized.frames, expected.frames)
        with pytest.raises(OmniError, match="generate_video"):
            client.generate_image(PROMPT, **OPTIONS)


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
    served = np.load(tmp_path / "video.npy")
    assert levels_apart(served, expected) <= 1
    frames, fps = decode_mp4((tmp_path / "video.mp4").read_bytes())
    assert frames.shape == expected.shape and fps == 16.0 and same_encoding(frames, served)
    print(f"MP4 (H.264, crf 18) against the served frames: PSNR {psnr(frames, served):.1f} dB")


def same_encoding(decoded: np.ndarray, frames: np.ndarray) -> bool:
    """Whether ``decoded`` is these frames through our encoder, told apart from another video's
    MP4. Not byte for byte: x264's macroblock tree reads memory it has not written on some inputs
    (these noise-like frames among them: a heap filled with other bytes first changes its output),
    so two encodes of one video differ a little. Measured on these frames: two encodes 43 to 46 dB
    apart, the encode of another seed's or prompt's frames 34 to 35 dB (and the raw frames of
    another seed 32 dB from these: a floor on the PSNR against the frames alone would not tell)."""
    return decoded.shape == frames.shape and psnr(decoded, decode_mp4(encode_mp4(frames, 16.0))[0]) >= 40.0


def psnr(decoded: np.ndarray, frames: np.ndarray) -> float:
    return float(10 * np.log10(255 ** 2 / np.mean((decoded.astype(float) - frames) ** 2)))


MAX_JOBS = 4
EXTENSIONS = {key: OPTIONS[key] for key in ("num_inference_steps", "num_frames", "seed", "guidance_scale")}


@pytest.fixture(scope="module")
def videos_api(wan_server):
    """The OpenAI gateway over the Wan server, as the ``openai`` SDK reaches it (no retries: a 429
    is the answer under test, not something to wait out)."""
    gateway = Gateway(free_port(), "127.0.0.1", wan_server.grpc_url, {}, max_video_jobs=MAX_JOBS).start()
    try:
        yield openai.OpenAI(base_url=f"http://{gateway.url}/v1", api_key="unused", max_retries=0)
    finally:
        gateway.stop()


def finished(api, **fields):
    return api.videos.create_and_poll(prompt=PROMPT, poll_interval_ms=100, **fields)


def test_openai_videos_give_the_pipelines_frames_and_their_mp4(videos_api):
    video = finished(videos_api, model="text_to_image", size="32x32", extra_body=EXTENSIONS)
    assert (video.status, video.size, video.seconds, video.progress) == ("completed", "32x32", "0.25", 100)
    frames = np.load(io.BytesIO(videos_api.videos.download_content(video.id, variant="frames").content))
    assert levels_apart(frames, reference("wan", PROMPT, **OPTIONS)) <= 1
    served = videos_api.videos.download_content(video.id).content
    assert videos_api.videos.download_content(video.id).content == served  # encoded once, kept
    mp4, fps = decode_mp4(served)
    assert fps == 16.0 and same_encoding(mp4, frames)
    print(f"/v1/videos MP4 against the raw frames: PSNR {psnr(mp4, frames):.1f} dB")
    thumbnail = videos_api.videos.download_content(video.id, variant="thumbnail").content
    assert thumbnail.startswith(b"\x89PNG")
    assert video.id in [listed.id for listed in videos_api.videos.list()]
    assert videos_api.videos.retrieve(video.id).status == "completed"
    assert videos_api.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        videos_api.videos.retrieve(video.id)


def test_a_job_through_omni_reports_its_denoising_progress(videos_api):
    """Through ``omni`` the job's ``progress`` follows the denoising steps (through an ensemble it
    goes from 0 to 100 at once)."""
    video = videos_api.videos.create(prompt=PROMPT, model="omni", size="32x32",
                                     extra_body=EXTENSIONS | {"num_inference_steps": 40})
    seen = [video.progress]
    while (video := videos_api.videos.retrieve(video.id)).status in ("queued", "in_progress"):
        seen.append(video.progress)
        time.sleep(0.02)
    assert video.status == "completed" and video.progress == 100, video.error
    assert seen == sorted(seen) and any(0 < progress < 100 for progress in seen), seen
    videos_api.videos.delete(video.id)


@pytest.mark.parametrize(("fields", "param"), [
    ({"extra_body": EXTENSIONS | {"num_frames": 6}}, "num_frames"),
    ({"seconds": "4", "extra_body": EXTENSIONS}, "seconds"),  # 65 frames at 16 a second, and num_frames 5
    ({"input_reference": ("first.png", png(1, 32, 32), "image/png"),
      "extra_body": EXTENSIONS}, "input_reference"),  # Wan 2.1 T2V takes no image
])
def test_what_the_model_refuses_fails_the_job_naming_the_field(videos_api, fields, param):
    video = finished(videos_api, model="diffusion", size="32x32", **fields)
    assert video.status == "failed" and video.error.param == param, video.error
    assert finished(videos_api, model="diffusion", size="32x32", extra_body=EXTENSIONS).status == "completed"
    for listed in videos_api.videos.list():
        videos_api.videos.delete(listed.id)


def test_a_form_that_is_not_multipart_is_a_400_naming_it(videos_api):
    import httpx

    response = httpx.post(f"{videos_api.base_url}videos", content=b"prompt=a red fox",
                          headers={"content-type": "multipart/form-data"})  # no boundary: no form
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_multipart", response.text


def test_what_the_gateway_refuses_is_a_400_404_or_429(videos_api):
    with pytest.raises(openai.BadRequestError) as refused:
        videos_api.videos.create(prompt=PROMPT, model="diffusion", size="wide")
    assert refused.value.body["param"] == "size"
    with pytest.raises(openai.BadRequestError) as refused:  # a text model: refused at once, no job
        videos_api.videos.create(prompt=PROMPT, model="ar_encoder", size="32x32")
    assert refused.value.body["code"] == "not_a_video_model" and "does not make videos" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        videos_api.videos.retrieve("video_0")
    with pytest.raises(openai.NotFoundError):
        videos_api.videos.download_content("video_0")
    created = []
    with pytest.raises(openai.RateLimitError):  # the job list is bounded
        for _ in range(MAX_JOBS + 1):
            created.append(videos_api.videos.create(prompt=PROMPT, model="diffusion", size="32x32",
                                                    extra_body=EXTENSIONS).id)
    assert len(created) == MAX_JOBS
    for video_id in created:
        videos_api.videos.delete(video_id)


def test_deleting_a_running_job_stops_its_denoising(videos_api, wan_server):
    def count(outcome: str) -> float:
        return metric_value(wan_server, "omni_diffusion_requests_total", model="diffusion", outcome=outcome)

    def in_flight() -> float:
        return metric_value(wan_server, "omni_diffusion_requests_in_flight", model="diffusion")

    def wait(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    wait(lambda: in_flight() == 0, "the earlier tests' requests never ended")
    cancelled, steps = count("cancelled"), metric_value(wan_server, "omni_diffusion_steps_total", model="diffusion")
    video = videos_api.videos.create(prompt=PROMPT, model="diffusion", size="32x32",
                                     extra_body=EXTENSIONS | {"num_inference_steps": 100})
    wait(lambda: in_flight() == 1, "the job never reached the model")
    assert videos_api.videos.delete(video.id).deleted
    wait(lambda: count("cancelled") == cancelled + 1 and in_flight() == 0,  # dropped at its next step
         "the deleted job's request was never cancelled")
    assert metric_value(wan_server, "omni_diffusion_steps_total", model="diffusion") - steps < 100


def test_the_benchmark_measures_videos_through_the_gateway_against_grpc(videos_api, wan_server, tmp_path):
    """``benchmarks/openai_gateway.py --videos`` against this server and gateway: both sides made
    videos and the report has its shape, never a ratio (docs/benchmarks.md quotes the GPU figure)."""
    out_file = tmp_path / "videos.json"
    command = [sys.executable, str(PROJECT_ROOT / "benchmarks" / "openai_gateway.py"), "--videos",
               "--grpc-url", wan_server.grpc_url, "--openai-url", str(videos_api.base_url).removesuffix("/v1/"),
               "--rounds", "1", "--video-concurrency", "2", "--video-requests", "2", "--video-size", "32x48",
               "--with-aa", "--json", str(out_file)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    videos, aa = json.loads(out_file.read_text())["results"]  # the comparison, then the host's A/A
    assert (videos["workload"], aa["workload"], videos["unit"]) == ("videos", "videos A/A", "videos/s")
    assert videos["gateway"] > 0 and videos["direct"] > 0 and aa["gateway"] > 0


# -- Wan 2.2 TI2V (`serve --demo wan2.2`): a prompt and a first image --------------------------------

FIRST_FRAME = png(1)


@pytest.fixture(scope="module")
def ti2v_server(tmp_path_factory):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", load_models=["ar_encoder", "diffusion", "text_to_image",
                                                                        "omni"], demo="wan2.2",
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with TritonServer(options) as server:
        yield server


@pytest.mark.parametrize("negative", [ABSENT, "", " "], ids=["absent", "empty", "blank"])
@pytest.mark.parametrize("route", ["diffusion", "text_to_image", "omni"])
def test_a_first_image_through_every_route_gives_the_image_to_video_pipelines_frames(ti2v_server, route,
                                                                                    negative):
    """Against ``WanImageToVideoPipeline`` over the demo's components, its negative prompt left out,
    empty or blank, as its users give it."""
    client = OmniClient(ti2v_server.grpc_url)
    given = ({} if negative is ABSENT else {"negative_prompt": negative}) | OPTIONS | {"images": [FIRST_FRAME]}
    if route == "omni":
        [event] = [event for event in client.generate(PROMPT, modalities=["video"], **given)
                   if event.video is not None]
        video = Video(event.video[0], event.fps)
    else:
        video = client.generate_video(PROMPT, model=route, **given)
    expected = reference("wan2.2", PROMPT, negative, image=Image.open(io.BytesIO(FIRST_FRAME)), **OPTIONS)
    assert video.fps == 24.0 and levels_apart(video.frames, expected) <= 1


def test_openai_videos_take_the_first_image_as_input_reference(ti2v_server):
    gateway = Gateway(free_port(), "127.0.0.1", ti2v_server.grpc_url, {}).start()
    try:
        api = openai.OpenAI(base_url=f"http://{gateway.url}/v1", api_key="unused", max_retries=0)
        video = finished(api, model="text_to_image", size="32x32", extra_body=EXTENSIONS,
                         input_reference=("first.png", FIRST_FRAME, "image/png"))
        assert video.status == "completed", video.error
        frames = np.load(io.BytesIO(api.videos.download_content(video.id, variant="frames").content))
    finally:
        gateway.stop()
    expected = reference("wan2.2", PROMPT, image=Image.open(io.BytesIO(FIRST_FRAME)), **OPTIONS)
    assert levels_apart(frames, expected) <= 1
    assert levels_apart(frames, reference("wan2.2", PROMPT, **OPTIONS)) >= 10  # the image was read


def test_the_cli_gives_its_first_image(ti2v_server, tmp_path):
    """`omni-triton generate-video --image IN.png`: the first image reaches the model."""
    first = tmp_path / "first.png"
    first.write_bytes(FIRST_FRAME)
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-video", PROMPT, "--url",
                    ti2v_server.grpc_url, "--steps", "2", "--seed", "7", "--guidance", "4", "--height", "32",
                    "--width", "32", "--frames", "5", "--image", str(first), "--out", str(tmp_path / "video.npy")],
                   check=True)
    expected = reference("wan2.2", PROMPT, image=Image.open(io.BytesIO(FIRST_FRAME)), **OPTIONS)
    assert levels_apart(np.load(tmp_path / "video.npy"), expected) <= 1
