"""Wan 2.1 text-to-video (``WanPipeline``): UMT5 reads the raw prompt, its last hidden states,
cut to the prompt's tokens and padded with zero rows to 512, condition a video DiT (3D patches of
1x2x2 latents, self-attention over every frame's tokens, cross-attention to the text); flow
matching stepped by UniPC; CFG above 1, against ``""`` unless a negative prompt is given, in two
passes. Its VAE folds four frames into one latent frame after the first, so a video has
``1 + 4k`` frames (81 by default, played at 16 per second).

The pipeline is the reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.families.base import (
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    Guidance,
    Output,
    TwoPassStepAdapter,
    pad_rows,
)

MAX_TOKENS = 512  # the pipeline's max_sequence_length: every prompt's states padded with zeros to it
FPS = 16  # the frame rate Wan 2.1's videos are made for (its model cards export at 16)

# The pipeline's own encoding (UMT5 is no causal LM: ar_encoder loads the pipeline without its DiT and
# VAE); an absent negative prompt encodes "", as the pipeline's does.
RECIPE = EncoderRecipe("wan", lambda tokenizer, prompt: prompt, padded_to=MAX_TOKENS, by_pipeline=True)


class WanSteps(TwoPassStepAdapter):
    """The video DiT's loop, as ``WanPipeline`` and ``WanImageToVideoPipeline`` run it: float32
    latents ``[1, C, F', H', W']`` handed to the DiT in its dtype, the prompts' pass and the
    negatives' pass apart, and each request's own copy of the (multistep) scheduler. What the
    pipeline's config switches on, it switches on here:

    - ``boundary_ratio`` (Wan 2.2 A14B): two experts, ``transformer`` for the timesteps at or
      above ``boundary_ratio x num_train_timesteps``, ``transformer_2`` below; requests at
      either side of it in one group run their own expert's passes;
    - ``expand_timesteps`` (Wan 2.2 TI2V-5B): a timestep per token, and with a first image its
      latents in place of the first latent frame's, at timestep 0."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, device, dtype)
        ratio = pipeline.config.get("boundary_ratio")
        self.experts = experts(pipeline)
        self.boundary = None if ratio is None else ratio * pipeline.scheduler.config.num_train_timesteps
        self.expand = bool(pipeline.config.get("expand_timesteps", False))

    def start(self, job) -> None:
        pipeline = self.pipeline
        self.start_latents(job)
        scheduler = copy.deepcopy(pipeline.scheduler)
        scheduler.set_timesteps(job.steps, device=self.device)
        scheduler.set_begin_index(0)
        job.scheduler, job.timesteps, job.schedule = scheduler, scheduler.timesteps, list(scheduler.timesteps)
        # each step's expert, read once from the host's copy (a comparison on the device would wait for it)
        job.step_kwargs["experts"] = [0] * job.steps if self.boundary is None else \
            [0 if t >= self.boundary else 1 for t in scheduler.timesteps.cpu().tolist()]
        job.step_kwargs["expert"] = 0
        self.start_passes(job)

    def start_latents(self, job) -> None:
        """The request's noise, drawn as ``WanPipeline.prepare_latents`` draws it, and with
        ``expand_timesteps`` the first-frame mask (ones: every token denoised; with a first image,
        zeros on its latent frame) and that image's latents, as ``WanImageToVideoPipeline`` makes them."""
        job.latents = self.pipeline.prepare_latents(1, self.experts[0].config.in_channels, job.height, job.width,
                                                    job.frames, torch.float32, self.device, job.generator)
        if not self.expand:
            return
        mask = torch.ones(1, 1, *job.latents.shape[2:], dtype=torch.float32, device=self.device)
        if job.images:
            mask[:, :, 0] = 0
            job.step_kwargs["condition"] = self.input_latents.get(
                job.images, lambda: self.first_frame(job), job.height, job.width)
        job.step_kwargs["mask"] = mask

    def first_frame(self, job) -> torch.Tensor:
        """The request's image, resized to the video's size, through the VAE (``argmax``: no draw
        from the generator), normalized as the pipeline normalizes its latents."""
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

        pipeline, vae = self.pipeline, self.pipeline.vae
        image = pipeline.video_processor.preprocess(job.images[0], height=job.height, width=job.width)
        image = image.to(self.device, dtype=torch.float32).unsqueeze(2).to(dtype=vae.dtype)
        latents = retrieve_latents(vae.encode(image), sample_mode="argmax").to(self.device, torch.float32)
        mean, inverse_std = latent_statistics(vae, latents)
        return (latents - mean) * inverse_std

    def networks_of(self, jobs: list) -> list[tuple[torch.nn.Module, list]]:
        parts: dict[int, list] = {}
        for job in jobs:
            expert = job.step_kwargs["experts"][job.done]
            if expert != job.step_kwargs["expert"]:  # the next expert's step cache starts afresh, as its hook does
                job.step_kwargs["expert"] = expert
                self.start_passes(job, self.experts[expert])
            parts.setdefault(expert, []).append(job)
        return [(self.experts[expert], part) for expert, part in sorted(parts.items())]

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        dtype = self.experts[0].dtype
        return {"hidden_states": torch.cat(pad_rows([self.model_input(job).to(dtype) for job in jobs], size)),
                "timestep": torch.cat(pad_rows([self.timestep(job) for job in jobs], size)),
                "encoder_hidden_states": embeds.to(dtype)}

    def model_input(self, job) -> torch.Tensor:
        """What the DiT reads of a request (float32): its latents, the first image's in its frame."""
        return self.final_latents(job)

    def final_latents(self, job) -> torch.Tensor:
        """A request's latents, its first image's in the first latent frame where it gave one."""
        condition = job.step_kwargs.get("condition")
        if condition is None:
            return job.latents
        mask = job.step_kwargs["mask"]
        return (1 - mask) * condition + mask * job.latents

    def timestep(self, job) -> torch.Tensor:
        """The DiT's timestep input for one row: the step's, or (``expand_timesteps``) a token's each,
        the mask's (its 2x2 patches') times the step's."""
        t = job.schedule[job.done]
        if not self.expand:
            return t.expand(1)
        return (job.step_kwargs["mask"][0][0][:, ::2, ::2] * t).flatten()[None]

    def guide(self, job, pred: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        """The pipeline's rule, at the scale of the expert that ran: ``guidance_scale``, or on the
        low-noise expert ``guidance_scale_2`` where the request gave one."""
        scale = job.guidance_scale
        if job.step_kwargs["expert"] == 1 and job.guidance_scale_2 is not None:
            scale = job.guidance_scale_2
        return negative + scale * (pred - negative)

    def output_shape(self, kwargs: dict) -> tuple[int, ...]:
        """The DiT unpatchifies its output: latents of every frame, ``out_channels`` deep."""
        rows, _, *frames_and_sides = kwargs["hidden_states"].shape
        return rows, int(self.experts[0].config.out_channels), *frames_and_sides

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        latents = torch.cat([self.final_latents(job) for job in jobs]).to(vae.dtype)
        mean, inverse_std = latent_statistics(vae, latents)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return pipeline.video_processor.postprocess_video(video, output_type="pt")  # [N, F, 3, H, W] in [0, 1]


def experts(pipeline) -> tuple[torch.nn.Module, ...]:
    """The pipeline's denoisers in the order of the schedule: ``transformer``, and with a
    ``boundary_ratio`` (Wan 2.2 A14B) ``transformer_2`` for the low-noise steps."""
    if pipeline.config.get("boundary_ratio") is None:
        return (pipeline.transformer,)
    return pipeline.transformer, pipeline.transformer_2


def latent_statistics(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and 1 / std, shaped to broadcast over ``[N, C, F, H, W]`` latents (as
    the pipelines compute them, in ``like``'s device and dtype)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inverse_std


def build_tiny(out: Path) -> None:
    """A ``WanPipeline`` at the shape of diffusers' pipeline test: a UMT5 encoder (32 wide) with a
    tokenizer built here that ends every text with its EOS, as UMT5's does; a two-block video DiT;
    Wan's VAE at its smallest (4x temporal, 8x spatial); UniPC on flow sigmas, as Wan 2.1 ships."""
    from diffusers import WanPipeline

    tokenizer, text_encoder = tiny_text_encoder(out)
    transformer = tiny_transformer()
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(), scheduler=flow_scheduler(),
                transformer=transformer).save_pretrained(out)


def tiny_text_encoder(out: Path):
    """The tiny demos' UMT5 (32 wide) and its tokenizer, saved under ``out / "tokenizer"``."""
    from transformers import UMT5Config, UMT5EncoderModel

    from triton_omni.demo_models import AR_SHAPE, amplify, build_tokenizer

    vocab, width = AR_SHAPE["vocab_size"], TINY_TEXT_WIDTH
    tokenizer = build_tokenizer(out / "tokenizer", vocab, max_length=MAX_TOKENS, eos_after=True)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        d_model=width, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=tokenizer.pad_token_id)).eval()
    # At random init the tiny models barely carry the prompt (another prompt moved the frames by 1
    # level): sharper attention in UMT5, and (tiny_transformer) a stronger cross-attention and second
    # block in the DiT, make each input move them by tens of levels (tests/unit/test_demo_sensitivity.py)
    amplify(text_encoder, 6.0, lambda name: name.endswith((".SelfAttention.q", ".SelfAttention.k")))
    return tokenizer, text_encoder


TINY_TEXT_WIDTH = 32


def tiny_transformer(channels: int = 16, out_channels: int | None = None, seed: int = 0):
    """A two-block video DiT reading ``channels`` latent channels (predicting ``out_channels``, by
    default as many), amplified as ``tiny_text_encoder`` says."""
    from diffusers import WanTransformer3DModel

    from triton_omni.demo_models import amplify

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=channels, out_channels=out_channels or channels,
                                        text_dim=TINY_TEXT_WIDTH, freq_dim=256, ffn_dim=32, num_layers=2,
                                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    amplify(transformer, 6.0, lambda name: ".attn2." in name or name.startswith("blocks.1."))
    amplify(transformer, 8.0, lambda name: name.startswith("condition_embedder.text_embedder."))
    return transformer


def tiny_vae(**wan22):
    """Wan's VAE at its smallest (``wan22``: Wan 2.2's, 48 channels, 16x spatial, as diffusers' test
    builds it); a VAE this small decodes to nearly flat grey: three times the contrast."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**{"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                              "temperal_downsample": [False, True, True]} | wan22)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(3.0)
        vae.decoder.conv_out.bias.mul_(3.0)
    return vae


def flow_scheduler(flow_shift: float = 3.0):
    """UniPC on flow sigmas with the model card's shift, as every Wan pipeline ships it."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift)


# UMT5-XXL, every Wan pipeline's text encoder (google/umt5-xxl's config.json)
UMT5_XXL_SHAPE = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
                  "vocab_size": 256384, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}


def build_realistic_encoder(out: Path) -> None:
    """Wan's text encoder alone at UMT5-XXL's shape (random weights, bf16, about 5.7 B parameters)
    with the tiny demos' tokenizer (its ids are a part of UMT5's vocabulary), as a pipeline folder:
    ``ar_encoder``'s model beside the in-memory realistic DiT, so that a prompt is served end to
    end (``/v1/videos``). Built on a GPU where there is one, saved as safetensors (about 11 GB)."""
    import json

    from transformers import UMT5Config, UMT5EncoderModel

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer, built_as

    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], max_length=MAX_TOKENS, eos_after=True)
    with built_as("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16):
        encoder = UMT5EncoderModel(UMT5Config(
            **UMT5_XXL_SHAPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")).eval()
    encoder.save_pretrained(out / "text_encoder")
    flow_scheduler().save_pretrained(out / "scheduler")  # the pipeline loads with one
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "transformer": [None, None], "vae": [None, None]},
        indent=2))


# Wan 2.1 T2V's DiTs (their config.json): 1.3B and 14B
SHAPES = {"1.3b": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
          "14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}}


def build_realistic(device, dtype, size: str = "1.3b", flow_shift: float = 3.0):
    """Wan 2.1 T2V's DiT at ``size``'s real shape, Wan's VAE (diffusers' defaults are Wan 2.1's) and
    UniPC with the model card's shift (3.0 for 480p, 5.0 for 720p), random weights, in memory on
    ``device``; no text encoder (it serves ``prompt_embeds``: UMT5-XXL's 4096 wide)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        transformer = realistic_transformer(**SHAPES[size])
        vae = AutoencoderKLWan()
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae.to(torch.float32), transformer=transformer,
                       scheduler=flow_scheduler(flow_shift))


def realistic_transformer(in_channels: int = 16, out_channels: int = 16, **shape):
    """A Wan DiT at a real shape (``shape``: heads, feed-forward width, layers), 128-wide heads
    reading UMT5-XXL's 4096-wide states."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=in_channels,
                                 out_channels=out_channels, text_dim=4096, freq_dim=256, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", eps=1e-6, **shape)


def build_realistic_14b(device, dtype):
    return build_realistic(device, dtype, "14b", flow_shift=5.0)


class Wan(Family):
    name = "wan"
    pipeline_class = "WanPipeline"
    # the prompts' and the negatives' passes apart: CFG parallel; First Block Cache on its blocks, as
    # diffusers' hook runs them; sequence parallel by diffusers' plan (the video's tokens, every latent
    # frame's, split at the first block); its blocks compiled; LoRA adapters per request; the
    # self-attention's q, k and v as one layer, the cross-attention's k and v as another
    # (`fuse_projections`). Not yet: CUDA graphs
    capabilities = Capabilities(Guidance.CFG, cfg_parallel=True, step_cache=True, sequence_parallel=True,
                                compile=True, lora=True, fused_projections=True)
    # self-attention and the feed-forward read the video's tokens; the cross-attention's keys and values
    # the text's; the modulation is a learnt table, no layer
    flop_streams = (("*.attn2.to_k", "text"), ("*.attn2.to_v", "text"), ("*.attn2.to_kv", "text"),
                    ("blocks.*", "image"))
    attention_streams = (("*.attn1", "image"), ("*.attn2", "cross"))
    recipe = RECIPE
    step_adapter = WanSteps
    output = Output("video", fps=FPS, default_frames=81, max_side=1280)
    images_in_latents = True  # a first image (Wan 2.2) is a latent frame, or channels beside the noise
    demo = Demo("wan", "tiny-wan", build_tiny)
    demo_folders: ClassVar[dict] = {"realistic-wan-encoder": build_realistic_encoder}
    realistic: ClassVar[dict] = {"demo:realistic-wan2.1-1.3b": build_realistic,
                                 "demo:realistic-wan2.1-14b": build_realistic_14b}

    @classmethod
    def serves(cls, pipeline) -> bool:
        """Wan 2.1's loop: one DiT, one timestep per step (Wan 2.2's pipelines say otherwise in their config)."""
        return pipeline.config.get("boundary_ratio") is None and not pipeline.config.get("expand_timesteps", False)

    def hidden_size(self) -> int:
        """UMT5's width: the DiT's, or (ar_encoder loads the pipeline without its DiT) the encoder's."""
        if self.pipeline.transformer is not None:
            return int(self.network.config.text_dim)
        return int(self.pipeline.text_encoder.config.d_model)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor_spatial) * int(self.network.config.patch_size[1])

    def frames_step(self) -> int:
        return int(self.pipeline.vae_scale_factor_temporal)

    def attention_shape(self) -> tuple[int, int]:
        config = self.network.config
        return int(config.num_attention_heads), int(config.attention_head_dim)

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        [(embeds, _)] = self.encode_batch([prompt], device)
        return embeds

    def encode_batch(self, prompts: list[str], device: torch.device,
                     images: list[list] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each prompt's UMT5 states, by the pipeline's own encoding: cut to its tokens, zero rows up
        to 512 (the encoder's attention is masked: a row's states do not depend on its company)."""
        self.require_text_encoder()
        embeds = self.pipeline._get_t5_prompt_embeds(prompts, max_sequence_length=MAX_TOKENS, device=device)
        return [(row, None) for row in embeds]

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
        return kwargs

    @property
    def networks(self) -> tuple[torch.nn.Module, ...]:
        return experts(self.pipeline)

    def call_output(self, result: Any) -> torch.Tensor:
        return result.frames

    def check_images(self, images: list, field: str = "images") -> None:
        """Any first image (where the model takes one): the pipeline resizes it to the video's size,
        which does not follow it."""
        return None

    def image_kwargs(self, images: list) -> dict[str, Any]:
        return {"image": images[0]}
