"""Helpers for tests that drive a ``DiffusionRunner`` in the test's process."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig


def alone_then_together(config: DiffusionRunnerConfig, requests: Callable[[int], list[dict]],
                        cached_steps: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """Each request (``requests(hidden size)``) submitted alone, then all of them together, on
    one runner, which is freed after (a 20 B DiT leaves no room for a second on its GPU).
    ``cached_steps`` collects (steps computed, steps skipped) of each request that used the step cache."""
    runner = DiffusionRunner(config)
    on_cached = None if cached_steps is None else lambda computed, skipped: cached_steps.append((computed, skipped))
    try:
        values = [with_pooled(v, runner.limits.pooled_size, seed) for seed, v in
                  enumerate(requests(runner.limits.hidden_size))]
        alone = [runner.submit(runner.parse(v), on_cached=on_cached).result() for v in values]
        together = [f.result() for f in [runner.submit(runner.parse(v), on_cached=on_cached) for v in values]]
        return alone + together
    finally:
        runner.close()
        del runner
        gc.collect()  # the runner's reference cycles: its GPU memory goes only with them
        torch.cuda.empty_cache()


def with_pooled(values: dict, size: int, seed: int) -> dict:
    """``values`` with a seeded pooled embedding where the family reads one (FLUX.1) and none is given."""
    if not size or "pooled_prompt_embeds" in values:
        return values
    pooled = torch.randn(size, generator=torch.Generator().manual_seed(5000 + seed)) * 0.5
    return values | {"pooled_prompt_embeds": pooled.to(torch.bfloat16)}
