"""What the step engine (``steps.py``) needs of a pipeline family, one adapter each:
a request's starting state (its scheduler copy, timesteps and noise, drawn as
the pipeline draws them), one guided prediction for every request of a group
in shared forward passes, a scheduler step, and the decode.

Each adapter follows its pipeline's own ``__call__`` line by line, so that a
request stepped in any company gives the image of that call: the UNet of the
Stable Diffusion family (prompt and negative as rows of one batch), Qwen-Image's
MMDiT (packed latents, a resolution-dependent shift, true CFG in two passes with
its norm rescale) and Z-Image's DiT (latents as a list, the flow reversed, CFG
above a scale of 0).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import numpy as np
import torch

# A step's rows padded up to this count (a bucket): (real rows) -> padded rows
PadTo = Callable[[int], int]


def _pad(rows: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Padding rows repeat the last real row; their outputs are dropped."""
    return rows + [rows[-1]] * (size - len(rows))


def _flow_schedule(pipeline, job, device: torch.device, image_seq_len: int, sigmas) -> None:
    """A flow-matching request's scheduler copy, set as its pipeline sets it (the shift ``mu``
    follows the image's token count)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    scheduler = copy.deepcopy(pipeline.scheduler)
    config = scheduler.config
    mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, job.steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    job.scheduler, job.timesteps, job.schedule = scheduler, timesteps, list(timesteps)


class UNetDenoiser:
    """The Stable Diffusion family: DDIM-style schedulers, CFG rows (uncond, cond) in one batch."""

    caches = False  # step caching (step_cache.py) skips a DiT's blocks; a UNet has none to skip

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        self.pipeline, self.device, self.dtype = pipeline, device, dtype

    def group(self, job) -> tuple:
        return job.height, job.width, job.cond.shape[0]

    def start(self, job) -> None:
        from triton_omni.diffusion.steps import to_device

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        # The scheduler keeps its timesteps on the CPU and gets them as ints: its tables live
        # there, and indexing them with a device tensor (DDIM does it three times a step) waits
        # for the GPU to drain, once per request per step. Only the UNet needs them on the device.
        scheduler.set_timesteps(job.steps, device="cpu")
        job.scheduler, job.schedule = scheduler, scheduler.timesteps.tolist()
        job.timesteps = to_device(scheduler.timesteps, self.device)
        factor = self.pipeline.vae_scale_factor
        shape = (1, self.pipeline.unet.config.in_channels, job.height // factor, job.width // factor)
        noise = torch.randn(shape, generator=job.generator, device=self.device, dtype=self.dtype)
        job.latents = noise * scheduler.init_noise_sigma
        job.step_kwargs = self.pipeline.prepare_extra_step_kwargs(job.generator, 0.0)

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        """One UNet forward for every row of ``jobs``: each job's guided noise prediction."""
        samples, timesteps, embeds = [], [], []
        for job in jobs:
            x = job.scheduler.scale_model_input(job.latents, job.schedule[job.done])
            rows = [job.uncond, job.cond] if job.uncond is not None else [job.cond]
            samples += [x] * len(rows)
            timesteps += [job.timesteps[job.done]] * len(rows)
            embeds += rows
        n = len(samples)
        size = pad_to(n)
        out = self.pipeline.unet(torch.cat(_pad(samples, size)), torch.stack(_pad(timesteps, size)),
                                 encoder_hidden_states=torch.stack(_pad(embeds, size)), return_dict=False)[0][:n]
        preds, row = [], 0
        for job in jobs:
            if job.uncond is None:
                preds.append(out[row : row + 1])
                row += 1
            else:
                uncond, cond = out[row : row + 1], out[row + 1 : row + 2]
                preds.append(uncond + job.guidance_scale * (cond - uncond))
                row += 2
        return preds

    def step(self, job, pred: torch.Tensor) -> None:
        job.latents = job.scheduler.step(pred, job.schedule[job.done], job.latents, **job.step_kwargs,
                                         return_dict=False)[0]

    def decode(self, jobs: list) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = torch.cat([job.latents for job in jobs]) / vae.config.scaling_factor
        return (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


class FlowDenoiser(UNetDenoiser):
    """What the flow-matching DiTs share: a prompt and its negative keep their own text lengths
    (both are part of the group), a plain scheduler step on the velocity, and step caching per
    request (step_cache.py), which UNets lack."""

    caches = True  # step caching per request (step_cache.py)

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, device, dtype)
        self._step_cache = None  # the hooks, installed when a request first asks for them

    def start_cache(self, job, passes: tuple[str, ...]) -> None:
        """The job's passes' cache state, where it asked for step caching."""
        from triton_omni.diffusion.step_cache import FirstBlockCache, PassCache

        if job.step_cache is None or not job.step_cache.on:
            return
        if self._step_cache is None:
            self._step_cache = FirstBlockCache(self.pipeline.transformer)
        job.cache = {name: PassCache(job.step_cache.threshold) for name in passes}

    def cached(self, rows: list) -> contextlib.AbstractContextManager:
        """Around a forward pass whose row ``i`` is ``rows[i]``'s (a PassCache, or None)."""
        return contextlib.nullcontext() if self._step_cache is None else self._step_cache.passes(rows)

    @staticmethod
    def count_skips(jobs: list) -> None:
        for job in jobs:
            if job.cache is not None and not any(state.computed for state in job.cache.values()):
                job.steps_skipped += 1

    def group(self, job) -> tuple:
        return job.height, job.width, job.cond.shape[0], 0 if job.uncond is None else job.uncond.shape[0]

    def step(self, job, pred: torch.Tensor) -> None:
        job.latents = job.scheduler.step(pred, job.schedule[job.done], job.latents, return_dict=False)[0]


class QwenImageDenoiser(FlowDenoiser):
    """Qwen-Image's MMDiT: packed latents, the prompt and its negative in two passes, each with
    its own text length, combined with true CFG and rescaled to the prompt's norm.

    CFG parallel (``cfg_parallel``, set by the runner): the negatives' pass runs on a second GPU,
    in a worker process (cfg_parallel.py), while the prompts' pass runs on the first; the same
    kernels on the same rows, so the image is the one GPU's."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, device, dtype)
        self.cfg_parallel = None  # a CfgParallel: where the negatives' passes run

    def start(self, job) -> None:
        pipeline = self.pipeline
        channels = pipeline.transformer.config.in_channels // 4
        job.latents = pipeline.prepare_latents(1, channels, job.height, job.width, job.cond.dtype, self.device,
                                               job.generator)
        _flow_schedule(pipeline, job, self.device, job.latents.shape[1],
                       np.linspace(1.0, 1 / job.steps, job.steps))
        factor = pipeline.vae_scale_factor
        job.step_kwargs = {"img_shape": (1, job.height // factor // 2, job.width // factor // 2)}
        # the pipeline's cache contexts: the prompt's pass and the negative's keep apart states
        self.start_cache(job, ("cond", "uncond") if job.uncond is not None else ("cond",))

    @staticmethod
    def _pass(jobs: list, embeds: list[torch.Tensor], pad_to: PadTo, branch: str) -> tuple[dict, list]:
        """One pass's transformer arguments, its rows padded, and each row's cache owner."""
        n = len(jobs)
        size = pad_to(n)
        latents = torch.cat(_pad([job.latents for job in jobs], size))
        timesteps = torch.cat(_pad([job.schedule[job.done].expand(1).to(job.latents.dtype) for job in jobs], size))
        kwargs = {"hidden_states": latents, "timestep": timesteps / 1000, "guidance": None,
                  "encoder_hidden_states_mask": None, "encoder_hidden_states": torch.stack(_pad(embeds, size)),
                  "img_shapes": [[jobs[0].step_kwargs["img_shape"]]] * size, "return_dict": False}
        return kwargs, [job.cache and job.cache[branch] for job in jobs] + [None] * (size - n)

    def _forward(self, jobs: list, embeds: list[torch.Tensor], pad_to: PadTo, branch: str) -> torch.Tensor:
        kwargs, rows = self._pass(jobs, embeds, pad_to, branch)
        with self.cached(rows):
            return self.pipeline.transformer(**kwargs)[0][: len(jobs)]

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        guided = [job for job in jobs if job.uncond is not None]
        negatives = [job.uncond for job in guided]
        remote = self._pass(guided, negatives, pad_to, "uncond") if guided and self.cfg_parallel else None
        if remote is not None:
            self.cfg_parallel.send(*remote)
        cond = self._forward(jobs, [job.cond for job in jobs], pad_to, "cond")
        if remote is not None:  # received after the prompts' pass is queued: that pass must not wait for it
            uncond = iter(self.cfg_parallel.receive(*remote)[: len(guided)])
        else:
            uncond = iter(self._forward(guided, negatives, pad_to, "uncond") if guided else ())
        self.count_skips(jobs)
        preds = []
        for job, pred in zip(jobs, cond, strict=True):
            pred = pred[None]
            if job.uncond is not None:
                negative = next(uncond)[None]
                combined = negative + job.guidance_scale * (pred - negative)
                pred = combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
            preds.append(pred)
        return preds

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        latents = torch.cat([pipeline._unpack_latents(job.latents, job.height, job.width, pipeline.vae_scale_factor)
                             for job in jobs]).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                           latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                              latents.dtype)
        images = vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        return (images / 2 + 0.5).clamp(0, 1)


class ZImageDenoiser(FlowDenoiser):
    """Z-Image's DiT: latents handed over as a list, the prompt and its negative as rows of one
    call (each its own text length), the model's output negated into the flow's velocity (in
    float32, as the pipeline steps it).

    Its groups are by text length rounded up to the DiT's multiple (``SEQ_MULTI_OF``, 32): the DiT
    pads every caption to that multiple with a learned pad token it attends to, so prompts of 20
    and 25 tokens run the same rows, of the same length, as each runs alone. Prompts a token apart
    (most of them) step in one forward pass instead of one pass each."""

    def group(self, job) -> tuple:
        from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

        def padded(embeds: torch.Tensor | None) -> int:
            return 0 if embeds is None else -(-embeds.shape[0] // SEQ_MULTI_OF) * SEQ_MULTI_OF

        return job.height, job.width, padded(job.cond), padded(job.uncond)

    def start(self, job) -> None:
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        pipeline = self.pipeline
        job.latents = pipeline.prepare_latents(1, pipeline.transformer.in_channels, job.height, job.width,
                                               torch.float32, self.device, job.generator)
        image_seq_len = (job.latents.shape[2] // 2) * (job.latents.shape[3] // 2)
        _flow_schedule(pipeline, job, self.device, image_seq_len, get_default_z_image_sigmas(job.steps))
        self.start_cache(job, ("all",))  # the prompt's row and the negative's share one forward, one state

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        dtype = self.pipeline.transformer.dtype
        guided = [job for job in jobs if job.uncond is not None]
        latents = [job.latents.to(dtype) for job in jobs] + [job.latents.to(dtype) for job in guided]
        timesteps = [(1000 - job.schedule[job.done].expand(1)) / 1000 for job in jobs + guided]
        embeds = [job.cond for job in jobs] + [job.uncond for job in guided]
        n = len(latents)
        size = pad_to(n)
        owners = [job.cache and job.cache["all"] for job in jobs + guided]
        with self.cached(owners + [None] * (size - n)):
            out = self.pipeline.transformer([x[0].unsqueeze(1) for x in _pad(latents, size)],
                                            torch.cat(_pad(timesteps, size)), _pad(embeds, size),
                                            return_dict=False)[0][:n]
        self.count_skips(jobs)
        negative = iter(out[len(jobs):])
        preds = []
        for job, pos in zip(jobs, out[: len(jobs)], strict=True):
            pos = pos.float()
            if job.uncond is not None:
                neg = next(negative).float()
                pos = pos + job.guidance_scale * (pos - neg)
            preds.append(-pos.squeeze(1)[None])
        return preds

    def decode(self, jobs: list) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = torch.cat([job.latents for job in jobs]).to(vae.dtype)
        images = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1)


def denoiser_of(family, device: torch.device, dtype: torch.dtype) -> UNetDenoiser:
    """The step-batching adapter of a pipeline's family (``families.py``). A pipeline no family
    names is taken for Stable Diffusion's only if it has a UNet and its step arguments: step
    batching must know the loop it replaces."""
    pipeline = family.pipeline
    if family.step_adapter is UNetDenoiser and not (hasattr(pipeline, "unet")
                                                and hasattr(pipeline, "prepare_extra_step_kwargs")):
        raise ValueError(f"step batching does not know {type(pipeline).__name__}'s denoising loop "
                         "(use batching 'request')")
    return family.step_adapter(pipeline, device, dtype)
