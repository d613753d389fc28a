"""FLUX.2: a text encoder's hidden states of three layers, joined per token, condition a Flux2
MMDiT (double-stream blocks, then single-stream ones; packed 2x2 latents with position ids, flow
matching). Every prompt is padded to 512 tokens and the padding's states are part of the
conditioning: the DiT reads all 512 rows.

- FLUX.2 [klein] (``Flux2KleinPipeline``): Qwen3 reads the prompt in its chat template (thinking
  off), layers 9, 18, 27. CFG above 1 against ``""`` (the pipeline takes no negative prompt, only
  ``negative_prompt_embeds``); none at all for the step-distilled variant (``is_distilled``).
- FLUX.2 [dev] (``Flux2Pipeline``): Mistral-Small-3.1 reads the prompt after a system message, in
  its chat template, layers 10, 20, 30. Guidance-distilled: the scale is an input of the DiT, one
  pass a step, no negative at all.

The pipelines are the reference."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from triton_omni.errors import RequestValidationError
from triton_omni.families.base import (
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    Guidance,
    TwoPassStepAdapter,
    flow_schedule,
    pad_rows,
)

LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
MAX_TOKENS = 512  # its max_sequence_length: every prompt is padded to it


def _chat(tokenizer, prompt: str) -> str:
    """Flux2KleinPipeline's rendering: one user turn, the generation prompt, thinking off."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


# An absent negative prompt: the encoding of "", the only negative the pipeline encodes itself.
RECIPE = EncoderRecipe("flux2_klein", _chat, layers=LAYERS, padded_to=MAX_TOKENS)

DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers


def _mistral_chat(tokenizer, prompt: str) -> str:
    """Flux2Pipeline's rendering: its system message, then the prompt as the user's turn, no
    generation prompt (``format_input``, then the chat template; the pipeline tokenizes it through
    ``apply_chat_template``, which adds no special tokens of its own)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    [messages] = format_input([prompt])
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


DEV_RECIPE = EncoderRecipe("flux2_dev", _mistral_chat, layers=DEV_LAYERS, padded_to=MAX_TOKENS,
                           special_tokens=False)


MAX_REFERENCES = 4  # reference images a request may give


MAX_AREA = 1024 * 1024  # the pipelines bring a larger reference image down to this many pixels


def conditions(pipeline, images: list) -> list[torch.Tensor]:
    """The pipelines' reading of reference images (``__call__``'s step 4, line by line): each
    brought down to 1024² of area, cropped to the latents' multiple and normalized."""
    processor, multiple = pipeline.image_processor, pipeline.vae_scale_factor * 2
    tensors = []
    for image in images:
        if image.size[0] * image.size[1] > MAX_AREA:
            image = processor._resize_to_target_area(image, MAX_AREA)
        width, height = image.size
        width, height = (width // multiple) * multiple, (height // multiple) * multiple
        tensors.append(processor.preprocess(image, height=height, width=width, resize_mode="crop"))
    return tensors


def output_size(pipeline, image) -> tuple[int, int]:
    """The (height, width) a pipeline takes for its output from its last reference image when given
    none: ``conditions``' size for it, by arithmetic (``_resize_to_target_area``'s), without resizing."""
    width, height = image.size
    if width * height > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    multiple = pipeline.vae_scale_factor * 2
    return (height // multiple) * multiple, (width // multiple) * multiple


class Flux2Steps(TwoPassStepAdapter):
    """The Flux2 DiT's loop: packed latents with their position ids, each pass's text ids, the
    prompts' pass and the negatives' pass (as the pipeline runs them, so that ``exact_batching:
    pipeline`` is its image bit for bit), combined as ``neg + g (pos - neg)``; the scale per row
    into a guidance-distilled DiT. Reference images: their VAE latents follow the image's tokens in
    every pass, with their own position ids (the prediction keeps the image's tokens only)."""

    def start(self, job) -> None:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        pipeline = self.pipeline
        channels = pipeline.transformer.config.in_channels // 4
        job.latents, image_ids = pipeline.prepare_latents(1, channels, job.height, job.width, job.cond.dtype,
                                                          self.device, job.generator)
        sigmas = None if pipeline.scheduler.config.get("use_flow_sigmas") else \
            np.linspace(1.0, 1 / job.steps, job.steps)
        image_seq_len = job.latents.shape[1]
        flow_schedule(pipeline, job, self.device, image_seq_len, sigmas,
                      mu=compute_empirical_mu(image_seq_len, job.steps))
        # the DiT's dtype; each pass's text ids follow its own text's length
        job.step_kwargs = {"img_ids": image_ids, "dtype": pipeline.transformer.dtype}
        for branch, embeds in (("cond", job.cond), ("uncond", job.uncond)):
            if embeds is not None:
                job.step_kwargs[f"txt_ids_{branch}"] = pipeline._prepare_text_ids(embeds[None]).to(self.device)
        if pipeline.transformer.config.guidance_embeds:  # guidance-distilled: the scale is an input, per row
            job.step_kwargs["guidance"] = torch.full([1], job.guidance_scale, device=self.device, dtype=torch.float32)
        if job.images:
            latents, ids, shapes = self.input_latents.get(job.images, lambda: self.reference_latents(job))
            job.step_kwargs |= {"references": latents, "img_ids": torch.cat([image_ids, ids], dim=1),
                                "reference_shapes": shapes}
        self.start_passes(job)

    def reference_latents(self, job) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The reference images' packed VAE latents, their position ids and their pixel shapes, as the
        pipeline's ``prepare_image_latents`` makes them (in ``argmax`` mode: the generator is not drawn from)."""
        references = conditions(self.pipeline, job.images)
        latents, ids = self.pipeline.prepare_image_latents(images=references, batch_size=1, generator=job.generator,
                                                           device=self.device, dtype=self.pipeline.vae.dtype)
        return latents, ids, tuple(tuple(reference.shape) for reference in references)

    def group(self, job) -> tuple:
        """Requests with reference images of the same shapes share a pass (their ids are the same)."""
        return (*super().group(job), job.step_kwargs.get("reference_shapes", ()))

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        first = jobs[0].step_kwargs  # one group: one size and one text length a pass, so one set of ids
        rows = [job.latents if "references" not in job.step_kwargs else
                torch.cat([job.latents, job.step_kwargs["references"]], dim=1) for job in jobs]
        return {"hidden_states": torch.cat(pad_rows(rows, size)).to(first["dtype"]),
                "timestep": torch.cat(pad_rows([job.schedule[job.done].expand(1).to(job.latents.dtype)
                                                for job in jobs], size)) / 1000,
                "guidance": None if "guidance" not in first else
                torch.cat(pad_rows([job.step_kwargs["guidance"] for job in jobs], size)),
                "encoder_hidden_states": embeds, "txt_ids": first[f"txt_ids_{branch}"], "img_ids": first["img_ids"]}

    def guide(self, job, pred: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        return negative + job.guidance_scale * (pred - negative)

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        factor = pipeline.vae_scale_factor * 2
        # The pipelines scatter the packed tokens by their position ids; ours are the row-major grid
        # of _prepare_latent_ids, so the scatter is this reshape (without reading the ids' maximum
        # back from the device, as [dev]'s unpacking does)
        latents = torch.cat([job.latents.view(1, job.height // factor, job.width // factor, -1).permute(0, 3, 1, 2)
                             for job in jobs])
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                              latents.dtype)
        latents = pipeline._unpatchify_latents(latents * std + mean).to(vae.dtype)
        images = vae.decode(latents, return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1)


def _tiny_dit_and_vae(text_width: int, guidance_embeds: bool):
    """The tiny demos' DiT (one double-stream and two single-stream blocks, reading ``text_width``)
    and their two-level FLUX.2 VAE (32² pixels: 8² packed latents)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from triton_omni.demo_models import amplify

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,
    )
    # At random init the tiny DiT barely reads its text (most of its 512 rows are padding): the
    # double-stream attention, where the text meets the image, and the single-stream blocks are
    # scaled so that another prompt, negative or guidance moves the image by tens of levels
    amplify(transformer, 6.0, lambda name: name.startswith("single_transformer_blocks.") or
            (name.startswith("transformer_blocks.") and ".attn." in name))
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=16, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    )
    return transformer, vae


def build_tiny(out: Path, distilled: bool = False) -> None:
    """A ``Flux2KleinPipeline`` at about the shape of diffusers' pipeline test: a Qwen3 causal LM
    of 28 layers (so that layers 9, 18 and 27 exist, none of them the final norm's), 16 wide, so
    that the DiT reads 48; one double-stream and two single-stream blocks; a two-level FLUX.2 VAE
    (32² pixels: 8² packed latents); the flow-matching scheduler. ``distilled``: the step-distilled
    variant's flag (no guidance)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    hidden = 16
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True)
    transformer, vae = _tiny_dit_and_vae(len(LAYERS) * hidden, guidance_embeds=False)
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=hidden, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=AR_SHAPE["vocab_size"], max_position_embeddings=1024,
    )).eval()
    pipeline = Flux2KleinPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                  text_encoder=text_encoder, tokenizer=tokenizer, is_distilled=distilled)
    pipeline.save_pretrained(out)


def build_tiny_distilled(out: Path) -> None:
    build_tiny(out, distilled=True)


# A chat template shaped like Mistral-Small-3.1's (system prompt, then [INST] turns; content given as
# a string or as a list of typed parts, as Flux2Pipeline's format_input gives it)
MISTRAL_MARKERS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[IMG]")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}"
    "{% set text = message['content'] %}{% else %}"
    "{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def mistral_tokenizer(out: Path):
    """The demos' stand-in for Mistral's tokenizer: its chat template and BOS, the system message
    in single tokens (``build_tokenizer``)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    return build_tokenizer(out, AR_SHAPE["vocab_size"], template=SYSTEM_MESSAGE, markers=MISTRAL_MARKERS,
                           chat_template=MISTRAL_TEMPLATE, bos="<s>")


def build_tiny_dev(out: Path) -> None:
    """A ``Flux2Pipeline`` at about the shape of diffusers' pipeline test: a Mistral3 text encoder
    of 31 layers (layers 10, 20 and 30 exist, none of them the final norm's) with a tiny Pixtral
    vision tower, 16 wide; a tokenizer whose chat template renders the system message and the
    prompt as Mistral's does, BOS included (the real pipeline's tokenizer is Mistral's processor,
    whose chat template and tokenizer these stand in for: text-only prompts go through the same
    calls); the guidance-embedding DiT; the VAE and scheduler of the [klein] demo."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from triton_omni.demo_models import AR_SHAPE

    hidden = 16
    tokenizer = mistral_tokenizer(out / "tokenizer")
    transformer, vae = _tiny_dit_and_vae(len(DEV_LAYERS) * hidden, guidance_embeds=True)
    torch.manual_seed(0)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": AR_SHAPE["vocab_size"], "hidden_size": hidden,
                     "intermediate_size": 32, "max_position_embeddings": 1024, "num_attention_heads": 2,
                     "num_hidden_layers": 31, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": None,
                     **ids},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "intermediate_size": 32, "image_size": 30, "patch_size": 6},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1, **ids,
    )).eval()
    pipeline = Flux2Pipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                             text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(out)


def _flux2_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(  # FLUX's dynamic shift: the pipeline passes its mu
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
        use_dynamic_shifting=True)


def build_realistic_klein(device, dtype, distilled: bool = False):
    """FLUX.2 [klein] 4B's DiT (5 double-stream and 20 single-stream blocks, 24 heads of 128, read
    from three layers of Qwen3-4B: 3 x 2560) and FLUX.2's VAE and scheduler, random weights, in
    memory on ``device``; no text encoder (it serves ``prompt_embeds``). ``distilled``: the 4-step
    variant's flag."""
    from diffusers import (
        AutoencoderKLFlux2,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        transformer = Flux2Transformer2DModel(in_channels=128, num_layers=5, num_single_layers=20,
                                              attention_head_dim=128, num_attention_heads=24,
                                              joint_attention_dim=len(LAYERS) * 2560, guidance_embeds=False)
        return Flux2KleinPipeline(transformer=transformer, vae=AutoencoderKLFlux2(), scheduler=_flux2_scheduler(),
                                  text_encoder=None, tokenizer=None, is_distilled=distilled)


def build_realistic_klein_distilled(device, dtype):
    return build_realistic_klein(device, dtype, distilled=True)


def build_realistic_dev(device, dtype):
    """FLUX.2 [dev]'s 32 B DiT (diffusers' class defaults: 8 double-stream and 48 single-stream
    blocks, 48 heads of 128, guidance embedding, reading three layers of Mistral-Small-3.1: 3 x
    5120) and FLUX.2's VAE and scheduler, random weights, in memory on ``device`` (about 64 GB in
    bf16); no text encoder: ``ar_encoder`` serves it from another GPU (docs/gpu.md)."""
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline, Flux2Transformer2DModel

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        return Flux2Pipeline(transformer=Flux2Transformer2DModel(), vae=AutoencoderKLFlux2(),
                             scheduler=_flux2_scheduler(), text_encoder=None, tokenizer=None)


# Mistral-Small-3.1-24B's language model (its text_config): what FLUX.2 [dev]'s text encoder runs on a prompt
MISTRAL_SMALL_SHAPE = {"vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 131072, "rope_theta": 1000000000.0, "rms_norm_eps": 1e-05,
                       "sliding_window": None}


def build_realistic_dev_encoder(out: Path) -> None:
    """FLUX.2 [dev]'s text encoder for text, at Mistral-Small-3.1-24B's language-model shape (a
    ``MistralModel``: for a text prompt the vision tower of its ``Mistral3ForConditionalGeneration``
    takes no part), random weights, bf16 (about 46 GB), with the demos' Mistral-shaped tokenizer, as
    a pipeline folder: ``ar_encoder``'s model beside the in-memory 32 B DiT, on another GPU. Built on
    a GPU where there is one (``CUDA_VISIBLE_DEVICES`` picks which), then saved."""
    from transformers import MistralConfig, MistralModel

    from triton_omni.demo_models import built_as

    tokenizer = mistral_tokenizer(out / "tokenizer")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    with built_as("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16):
        encoder = MistralModel(MistralConfig(**MISTRAL_SMALL_SHAPE, **ids, torch_dtype="bfloat16")).eval()
    encoder.save_pretrained(out / "text_encoder", max_shard_size="5GB")
    del encoder
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux2Pipeline", "text_encoder": ["transformers", "MistralModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}, indent=2))


class Flux2Klein(Family):
    name = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    capabilities = Capabilities(Guidance.CFG, guides_above=1.0, step_cache=True, cfg_parallel=True,
                                sequence_parallel=True, compile=True, cuda_graphs=True, vae_compile=True,
                                images=MAX_REFERENCES, lora=True)
    recipe = RECIPE
    step_adapter = Flux2Steps
    demo = Demo("flux2-klein", "tiny-flux2-klein", build_tiny)
    demo_folders: ClassVar[dict] = {"tiny-flux2-klein-distilled": build_tiny_distilled}
    realistic: ClassVar[dict] = {"demo:realistic-flux2-klein": build_realistic_klein,
                                 "demo:realistic-flux2-klein-distilled": build_realistic_klein_distilled}
    # the double blocks keep a stream each (the single blocks read both, joined); the modulations
    # are outside the blocks, shared by all of them
    flop_streams = (("*.attn.add_*", "text"), ("*.attn.to_add_out", "text"), ("*.ff_context.*", "text"),
                    ("transformer_blocks.*", "image"))

    def uses_guidance(self, guidance_scale: float, has_negative: bool) -> bool:
        """The step-distilled variant never guides (its pipeline ignores the scale)."""
        return not self.pipeline.config.get("is_distilled", False) and super().uses_guidance(guidance_scale,
                                                                                           has_negative)

    def hidden_size(self) -> int:
        return int(self.network.config.joint_attention_dim)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * 2  # the VAE's factor, then 2x2 latents packed into one token

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        return self.pipeline.encode_prompt(prompt, device=device)[0][0]

    def check_images(self, images: list, field: str = "images") -> tuple[int, int]:
        for index, image in enumerate(images):
            try:
                self.pipeline.image_processor.check_image_input(image)
            except ValueError as exc:  # too small, or too far from square, for the pipeline
                name = field if field == "image" else f"{field}[{index}]"
                raise RequestValidationError(name, str(exc), "x".join(map(str, image.size))) from None
        return output_size(self.pipeline, images[-1])

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
        return kwargs


class Flux2Dev(Flux2Klein):
    name = "flux2_dev"
    pipeline_class = "Flux2Pipeline"
    # the scale goes into the DiT: one pass, no negative (the base rule), nothing for CFG parallel to move
    capabilities = Capabilities(Guidance.DISTILLED, step_cache=True, compile=True, cuda_graphs=True,
                                vae_compile=True, images=MAX_REFERENCES, lora=True)
    recipe = DEV_RECIPE
    demo = Demo("flux2-dev", "tiny-flux2-dev", build_tiny_dev)
    demo_folders: ClassVar[dict] = {"realistic-flux2-dev-encoder": build_realistic_dev_encoder}
    realistic: ClassVar[dict] = {"demo:realistic-flux2-dev": build_realistic_dev}

