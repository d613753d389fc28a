"""Z-Image: Qwen3 reads the prompt in its chat template, its second-to-last layer conditions a
6 B single-stream DiT (latents as a list, flow matching reversed); CFG whenever the scale is
above 0 (``pos + g (pos - neg)``; Turbo runs at 0), against ``""`` unless a negative prompt is
given. ``ZImagePipeline`` is the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.families.base import (
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    FlowStepAdapter,
    Guidance,
    PadTo,
    flow_schedule,
    pad_rows,
)

# The DiT pads every caption and the image's tokens to a multiple of this (diffusers' SEQ_MULTI_OF).
SEQUENCE_MULTIPLE = 32


def _chat(tokenizer, prompt: str) -> str:
    """ZImagePipeline's rendering: one user turn, the generation prompt, thinking on."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


RECIPE = EncoderRecipe("z_image", _chat, layers=(-2,))  # an absent negative prompt: the encoding of ""


class ZImageSteps(FlowStepAdapter):
    """The DiT's loop: latents handed over as a list, the prompt and its negative as rows of one
    call (each its own text length), the model's output negated into the flow's velocity (in
    float32, as the pipeline steps it).

    Its groups are by text length rounded up to the DiT's multiple (32): the DiT pads every caption
    to that multiple with a learned pad token it attends to, so prompts of 20 and 25 tokens run the
    same rows, of the same length, as each runs alone. Prompts a token apart (most of them) step in
    one forward pass instead of one pass each."""

    def group(self, job) -> tuple:
        def padded(embeds: torch.Tensor | None) -> int:
            return 0 if embeds is None else -(-embeds.shape[0] // SEQUENCE_MULTIPLE) * SEQUENCE_MULTIPLE

        return job.height, job.width, padded(job.cond), padded(job.uncond)

    def start(self, job) -> None:
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        pipeline = self.pipeline
        job.latents = pipeline.prepare_latents(1, pipeline.transformer.in_channels, job.height, job.width,
                                               torch.float32, self.device, job.generator)
        image_seq_len = (job.latents.shape[2] // 2) * (job.latents.shape[3] // 2)
        flow_schedule(pipeline, job, self.device, image_seq_len, get_default_z_image_sigmas(job.steps))
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
        with self.cached(owners + [None] * (size - n)), \
                self.adapted([job.lora for job in jobs + guided], size):
            out = self.pipeline.transformer([x[0].unsqueeze(1) for x in pad_rows(latents, size)],
                                            torch.cat(pad_rows(timesteps, size)), pad_rows(embeds, size),
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


def sequence_parallel_plan(transformer: Any) -> dict:
    """Z-Image's main layers run one joint sequence (image and prompt tokens, each padded to a
    multiple of 32): split it and its rotary frequencies at every layer, gather after the final
    layer. The refiners before run whole on every rank; they are a small share of the work.
    diffusers (0.42) ships no plan for Z-Image."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "layers.0": {"x": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "layers.*": {"freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    } | {f"all_final_layer.{patch}": ContextParallelOutput(gather_dim=1, expected_dims=3)
         for patch in transformer.all_final_layer}  # one final layer per patch size


def build_tiny(out: Path) -> None:
    """A ``ZImagePipeline`` at the shape of diffusers' pipeline test: a Qwen3 text encoder (its
    second-to-last hidden state conditions), a single-stream DiT, a 16-channel VAE and a
    flow-matching scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    hidden = 64
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True)
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=hidden, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159)
    torch.manual_seed(0)
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=AR_SHAPE["vocab_size"], max_position_embeddings=1024,
    )).eval()
    pipeline = ZImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                              text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(out)


def build_realistic_encoder(out: Path) -> None:
    """Z-Image's text encoder alone at Qwen3-4B's shape (a ``Qwen3Model``, random weights, bf16)
    with its tokenizer, as a pipeline folder: ``model_index.json``, ``text_encoder/``,
    ``tokenizer/``: ``ar_encoder``'s model beside the in-memory realistic DiT. Built on a GPU where
    there is one (seconds for 4 B parameters), saved as safetensors (about 8 GB)."""
    from transformers import Qwen3Config, Qwen3Model

    from triton_omni.demo_models import AR_SHAPE, QWEN3_4B_SHAPE, build_tokenizer, built_as

    build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True)
    with built_as("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16):
        encoder = Qwen3Model(Qwen3Config(**QWEN3_4B_SHAPE, torch_dtype="bfloat16")).eval()
    encoder.save_pretrained(out / "text_encoder")
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "ZImagePipeline", "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}, indent=2))


def build_realistic(device, dtype):
    """The 6 B DiT (diffusers' class defaults but its rotary table's length, ``axes_lens``, which
    Z-Image-Turbo's config.json sets longer) and FLUX.1's autoencoder, which Z-Image uses, random
    weights, in memory on ``device``; no text encoder (it serves ``prompt_embeds``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False)
        return ZImagePipeline(transformer=ZImageTransformer2DModel(axes_lens=[1536, 512, 512]), vae=vae,
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
                              text_encoder=None, tokenizer=None)


class ZImage(Family):
    name = "z_image"
    pipeline_class = "ZImagePipeline"
    capabilities = Capabilities(Guidance.CFG, guides_above=0.0, step_cache=True, sequence_parallel=True,
                                compile=True, cuda_graphs=True, vae_compile=True, lora=True)
    # the patch and caption embedders read every row's tokens concatenated (the transformer's forward)
    lora_flattened = ("all_x_embedder", "cap_embedder")
    # the refiners read one stream each before the main layers read both, joined
    flop_streams = (("*.adaLN_modulation.*", "row"), ("noise_refiner.*", "image"), ("context_refiner.*", "text"))
    attention_streams = (("noise_refiner.*", "image"), ("context_refiner.*", "text"))
    # the transformer pads each row's caption to the longest in the pass, masked
    attention_masked = True
    recipe = RECIPE
    step_adapter = ZImageSteps
    demo = Demo("z-image", "tiny-z-image", build_tiny)
    demo_folders: ClassVar[dict] = {"realistic-z-image-encoder": build_realistic_encoder}
    realistic: ClassVar[dict] = {"demo:realistic-z-image": build_realistic}

    def attention_shape(self) -> tuple[int, int]:
        config = self.network.config
        return int(config.n_heads), int(config.dim) // int(config.n_heads)

    def hidden_size(self) -> int:
        return int(self.network.config.cap_feat_dim)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * self.network.config.all_patch_size[0]

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        [embeds] = self.pipeline._encode_prompt(prompt=prompt, device=device)
        return embeds

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        # Z-Image takes a list of per-prompt embeddings, each its own length
        kwargs: dict[str, Any] = {"prompt_embeds": list(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = list(unconds)
        return kwargs

    def check_sequence_parallel(self, request, ranks: int, on_cpu: bool) -> None:
        """Our plan pads the joint sequence it splits (sequence_parallel.py): any size splits."""

    @staticmethod
    def sequence_parallel_plan(transformer: Any) -> tuple[dict, int] | None:
        if type(transformer).__name__ != "ZImageTransformer2DModel":
            return None
        return sequence_parallel_plan(transformer), SEQUENCE_MULTIPLE
