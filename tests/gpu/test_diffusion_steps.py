"""Step batching on the GPU: the UNet's CUDA graphs per batch-size bucket
replay what eager computes, and a request's image in company stays within
the stated tolerance of the same request alone (1/255 per pixel channel;
bit-identical with exact batching). GPU only (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.demo_models import build_all
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

from tests.support.host_syncs import no_host_syncs

TOLERANCE = 1


def runner(**config) -> DiffusionRunner:
    build_all()
    return DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", device="cuda", batching="step", **config))


@pytest.fixture(scope="module")
def steps():
    r = runner(batch_size=4)  # buckets of 1, 2, 4, 6 and 8 rows
    yield r
    r.close()


def requests(r: DiffusionRunner, n: int, guidance: float = 5.0) -> list:
    return [r.parse({"prompt": f"a red fox, take {i}", "seed": i, "num_inference_steps": 4 + i,
                     "guidance_scale": guidance, "height": 64, "width": 64}) for i in range(n)]


def test_bucket_graphs_replay_what_eager_computes(steps):
    def batch(n: int) -> list:  # 2 rows (bucket 2); then 2 + 2 + 1 rows (bucket 6, one padding row)
        return requests(steps, 1) if n == 1 else requests(steps, 2) + requests(steps, 1, guidance=1.0)

    for n in (1, 3):
        steps.graphs.enabled = True
        graphed = steps.run(batch(n))
        steps.graphs.enabled = False
        eager = steps.run(batch(n))
        for g, e in zip(graphed, eager, strict=True):
            assert torch.equal(g, e), f"max pixel difference {(g.int() - e.int()).abs().max()}"
    steps.graphs.enabled = True
    # a graph per bucket met, never per row count (5 rows ran as 6)
    shapes = steps.graphs.shapes()
    assert shapes and {sample[0] for sample, *_ in shapes} <= {1, 2, 4, 6, 8}


def test_company_changes_an_image_within_the_tolerance(steps):
    alone = [steps.run([r])[0] for r in requests(steps, 4)]
    together = steps.run(requests(steps, 4))
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        difference = (a.int() - b.int()).abs().max().item()
        assert difference <= TOLERANCE, f"request {i}: max pixel difference {difference}"


def test_the_engine_keeps_at_most_steps_ahead_steps_queued(steps):
    """Unbounded, the engine's thread queued steps far ahead of the GPU, and a new request's
    "next step" ran only after all of them (docs/benchmarks.md)."""
    engine, queued = steps.steps, []
    issue = engine._issue

    def counted(jobs, live):
        queued.append(len(engine._queued))
        return issue(jobs, live)

    engine._issue = counted
    try:
        images = steps.run(requests(steps, 3))
    finally:
        del engine._issue
    assert all(isinstance(image, torch.Tensor) for image in images), images
    assert len(queued) >= 6 and max(queued) < engine.steps_ahead == 2, queued


def test_exact_batching_is_bit_identical_on_the_gpu():
    exact = runner(batch_size=2, exact_batching=True)
    try:
        alone = [exact.run([r])[0] for r in requests(exact, 2)]
        together = exact.run(requests(exact, 2))
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a, b)
    finally:
        exact.close()


def test_the_engine_thread_never_waits_for_the_gpu(steps):
    """Admission, steps and decodes only queue work: a host-device sync in any of them
    idles the GPU while Python issues the rest (a scheduler indexing its CPU tables with
    a device timestep did, three times per request per step: a few per cent of an H200's
    throughput at 16 requests; a copy from pageable memory at admission did once per request)."""
    def embedded(n: int) -> list:  # embeddings from a caller, as text_to_image sends: no tokenizer at admission
        hidden = steps.limits.hidden_size
        return [steps.parse({"prompt_embeds": torch.randn(8, hidden, generator=torch.Generator().manual_seed(i)),
                             "seed": i, "num_inference_steps": 4 + i, "guidance_scale": 5.0,
                             "height": 64, "width": 64}) for i in range(n)]

    steps.run(embedded(3))  # the same buckets met first: graphs captured (a capture synchronises)
    with no_host_syncs(steps.steps, "_start", "_advance", "_finish") as failures:
        images = steps.run(embedded(3))
    assert not failures, failures[0]
    assert all(isinstance(image, torch.Tensor) and image.dtype == torch.uint8 for image in images), images


def test_most_behind_times_steps_on_the_gpu_without_waiting():
    """``group_order: most_behind`` learns what a step alone costs each group from CUDA events,
    read once the GPU has passed them: choosing the next group never waits for the GPU."""
    r = runner(batch_size=4, group_order="most_behind")
    engine = r.steps
    try:
        for size in (64, 64, 32, 32):  # each size alone, twice: graphs captured, then timed steps
            r.run([r.parse({"prompt": "a red fox", "seed": 1, "num_inference_steps": 6, "height": size,
                            "width": size})])
        with no_host_syncs(engine, "_next_group") as failures:
            r.run([r.parse({"prompt": "a red fox", "seed": 2, "num_inference_steps": 6, "height": size,
                            "width": size}) for size in (32, 64)])
        engine.costs.update()
        costs = dict(engine.costs.seconds)
    finally:
        r.close()
    assert not failures, failures[0]
    assert sorted(group[:2] for group in costs) == [(32, 32), (64, 64)], costs
    assert all(0 < seconds < 1 for seconds in costs.values()), costs


def test_a_wan_step_never_waits_for_the_gpu():
    """Wan's UniPC keeps its sigmas on the host and solves its corrector's coefficients on the
    device: each step waited for the forward pass before it until the engine ran the scheduler
    under ``transfers.queued`` (its copies through pinned memory, its solve unchecked)."""
    wan = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-wan", device="cuda", batching="step", batch_size=2,
                                                defaults={"num_frames": 5}))
    try:
        def videos(n: int) -> list:
            return wan.run([wan.parse({"prompt": f"a red fox, take {i}", "seed": i, "num_inference_steps": 6,
                                       "guidance_scale": 5.0, "height": 32, "width": 32}) for i in range(n)])

        videos(2)
        with no_host_syncs(wan.steps, "_advance") as failures:
            served = videos(2)
        assert not failures, failures[0]
        assert all(isinstance(video, torch.Tensor) for video in served), served
    finally:
        wan.close()
