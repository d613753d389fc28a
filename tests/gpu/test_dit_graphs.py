"""CUDA graphs around a compiled DiT's forward (cuda_graphs.py) change no pixel: each DiT family's
tiny pipeline, step-batched with ``compile: blocks``, gives the same images with its graphs
replayed as with them off, bit for bit, at two batch sizes; a pass the step cache decides per
request runs as it is, beside replayed ones. GPU only (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.demo_models import build_all
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

FAMILIES = ["demo:tiny-qwen-image", "demo:tiny-z-image", "demo:tiny-flux1-dev", "demo:tiny-flux2-klein"]


@pytest.fixture(scope="module", params=FAMILIES)
def runner(request):
    build_all()
    r = DiffusionRunner(DiffusionRunnerConfig(request.param, device="cuda", batching="step", batch_size=4,
                                              exact_batching=False, compile="blocks"))
    yield r
    r.close()


def images(runner: DiffusionRunner, graphs: bool, n: int, step_cache: str | None = None) -> list[torch.Tensor]:
    """``n`` requests at once (the last with ``step_cache``), each with a negative prompt and a
    scale above every family's threshold: both passes where the family guides with two."""
    runner.graphs.enabled = graphs
    values = [{"prompt": f"a red fox, take {i}", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": i,
               "num_inference_steps": 4, "height": 64, "width": 64} for i in range(n)]
    if step_cache is not None:
        values[-1]["step_cache"] = step_cache
    return [f.result() for f in [runner.submit(runner.parse(v)) for v in values]]


@pytest.mark.parametrize("n", [1, 3])
def test_replayed_graphs_give_the_compiled_blocks_images(runner, n):
    assert runner.graphs is not None
    graphed = images(runner, True, n)
    again = images(runner, True, n)  # every step replayed: the shapes met above are captured now
    plain = images(runner, False, n)
    for g, a, p in zip(graphed, again, plain, strict=True):
        assert torch.equal(a, p), f"max pixel difference {(a.int() - p.int()).abs().max()}"
        assert torch.equal(g, p)
    assert runner.graphs.captured >= 1


def test_a_step_cached_pass_runs_as_it_is_beside_replayed_ones(runner):
    graphed = images(runner, True, 2, step_cache="first_block:0.5")
    plain = images(runner, False, 2, step_cache="first_block:0.5")
    for g, p in zip(graphed, plain, strict=True):
        assert torch.equal(g, p), f"max pixel difference {(g.int() - p.int()).abs().max()}"
