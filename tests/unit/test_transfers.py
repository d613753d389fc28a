"""``queued``: a scheduler's step under it computes what it computes without it. The mode's
point, that the step no longer waits for the GPU, is tests/gpu's (test_diffusion_steps.py); here,
on the CPU, the mode is entered directly so that its replacements run."""

from __future__ import annotations

import torch
from triton_omni.families.wan import flow_scheduler
from triton_omni.transfers import _Queued, queued


def unipc_run(mode) -> torch.Tensor:
    """Ten steps of Wan's UniPC (its order-2 corrector solves a system each step) on fixed
    predictions, as a request's loop runs them."""
    scheduler = flow_scheduler()
    scheduler.set_timesteps(10)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 2, 8, 8, generator=generator)
    for t in scheduler.timesteps:
        pred = torch.randn(latents.shape, generator=generator).to(torch.bfloat16)
        with mode():
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


class Counted(_Queued):
    solves = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        Counted.solves += func is torch.linalg.solve
        return super().__torch_function__(func, types, args, kwargs)


def test_a_unipc_step_under_the_mode_is_bit_identical():
    import contextlib

    assert torch.equal(unipc_run(Counted), unipc_run(contextlib.nullcontext))
    assert Counted.solves >= 8  # the corrector's solves went through the mode's


def test_the_mode_solves_as_linalg_solve_and_can_still_be_wrong():
    a = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
    b = torch.tensor([1.0, 2.0])
    with _Queued():
        solved = torch.linalg.solve(a, b)
        other = torch.linalg.solve(a, b.flip(0))
    assert torch.equal(solved, torch.linalg.solve(a, b))
    assert not torch.allclose(solved, other)  # the mode hands the arguments on, not a cached answer


def test_host_copies_keep_their_meaning_under_the_mode():
    host = torch.arange(4, dtype=torch.float32)
    with _Queued():
        assert host.to(torch.float16).dtype == torch.float16
        copied = host.to("cpu", copy=True)
        assert copied.data_ptr() != host.data_ptr() and torch.equal(copied, host)
        positional = host.to(torch.float16, False, True)  # copy, positionally: torch's parser refuses it
        assert positional.dtype == torch.float16 and positional.data_ptr() != host.data_ptr()
        assert host[:1].expand(3).to(torch.float64).tolist() == [0.0, 0.0, 0.0]
        out = torch.empty(2)
        torch.linalg.solve(torch.eye(2), torch.ones(2), out=out)  # `out`: torch's own solve
        assert out.tolist() == [1.0, 1.0]


def test_queued_changes_nothing_on_a_cpu():
    with queued(torch.device("cpu")):
        assert not torch.overrides._get_current_function_mode_stack()
