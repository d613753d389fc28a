"""The UNet's CUDA graphs (triton_omni/diffusion/cuda_graphs.py) change no
pixel. GPU only: `pytest tests/gpu` on the GPU machine (docs/gpu.md);
`make test` (CPU) does not collect this folder."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.demo_models import build_all
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig


@pytest.fixture(scope="module")
def runner() -> DiffusionRunner:
    build_all()
    return DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", device="cuda", batch_size=4, exact_batching=False))


def _images(runner: DiffusionRunner, graphs: bool, n: int, guidance: float = 5.0) -> list[torch.Tensor]:
    runner.graphs.enabled = graphs
    requests = [runner.parse({"prompt": f"a red fox, take {i}", "seed": i, "num_inference_steps": 4,
                              "guidance_scale": guidance, "height": 64, "width": 64}) for i in range(n)]
    return runner.run(requests)


def test_graphs_are_on_by_default_on_cuda(runner):
    assert runner.graphs is not None


@pytest.mark.parametrize("n, guidance", [(3, 5.0), (2, 5.0), (3, 5.0), (1, 1.0)])
def test_replayed_images_equal_eager_ones(runner, n, guidance):
    graphed = _images(runner, True, n, guidance)
    eager = _images(runner, False, n, guidance)
    for g, e in zip(graphed, eager, strict=True):
        assert isinstance(g, torch.Tensor)
        assert torch.equal(g, e), f"max pixel difference {(g.int() - e.int()).abs().max()}"


def test_one_graph_per_shape(runner):
    # batches of 3 and 2 with guidance (6 and 4 UNet rows) and 1 without: three shapes, one capture each
    assert runner.graphs.captured == 3


def test_cancelling_a_request_still_drops_it(runner):
    runner.graphs.enabled = True
    requests = [runner.parse({"prompt": "a lighthouse", "seed": i, "num_inference_steps": 4, "height": 64,
                              "width": 64}) for i in range(2)]
    results = runner.run(requests, is_cancelled=lambda i: i == 1)
    assert isinstance(results[0], torch.Tensor)
    assert type(results[1]).__name__ == "RequestCancelledError"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_runner_on_the_second_gpu_captures_from_a_thread_on_the_first():
    """The stub's threads start with GPU 0 current; a runner on cuda:1 must still capture and replay there."""
    torch.cuda.set_device(0)
    second = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", device="cuda:1", batch_size=4,
                                                   exact_batching=False))
    graphed = _images(second, True, 2)
    assert second.graphs.captured == 1
    eager = _images(second, False, 2)
    for g, e in zip(graphed, eager, strict=True):
        assert torch.equal(g, e), f"max pixel difference {(g.int() - e.int()).abs().max()}"
