"""Qwen-Image-Edit: Qwen-Image's MMDiT editing an input image. The image enters twice, as the
pipeline has it: Qwen2.5-VL reads it with the instruction (its vision tower, in the edit
template, whose 64 system tokens are dropped), and its VAE latents follow the output's latents in
the DiT's sequence. True CFG as Qwen-Image (the negative prompt is encoded with the same image).

- Qwen-Image-Edit (``QwenImageEditPipeline``): one image, read by both at about 1024² pixels at its
  aspect ratio, which is also the output's size when the request gives none.
- Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``, the 2509 and 2511 releases): several
  images, each announced as "Picture i:" before the instruction; the text encoder reads each at
  about 384², the VAE at about 1024², and their latents follow one another; the output takes the
  last image's size.

The pipelines are the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from triton_omni.errors import RequestValidationError
from triton_omni.families.base import Capabilities, Demo, EncoderRecipe, Guidance
from triton_omni.families.qwen_image import QwenImage, QwenImageSteps

# QwenImageEditPipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42)
TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROPPED = 64
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
AREA = 1024 * 1024  # the pipeline reads its input image brought to this many pixels
PLUS_ENCODER_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE (its VAE reads AREA)
PLUS_IMAGES = 4  # input images an Edit-Plus request may give (the releases show up to 3)

# The prompt is read with the image, by the pipeline's own encode_prompt (ar_encoder loads the
# pipeline without its DiT and VAE); the length counted is the template's, one token for the image.
RECIPE = EncoderRecipe("qwen_image_edit", lambda tokenizer, prompt: TEMPLATE.format(prompt), dropped=0,
                       absent_negative=None, by_pipeline=True, images=1)
# Edit-Plus's template has no vision markers of its own: each image's "Picture i: ..." goes before the
# prompt (counted here for one image)
PLUS_TEMPLATE = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
PLUS_RECIPE = EncoderRecipe(
    "qwen_image_edit_plus",
    lambda tokenizer, prompt: PLUS_TEMPLATE.format(f"Picture 1: {''.join(VISION_TOKENS)}{prompt}"), dropped=0,
    absent_negative=None, by_pipeline=True, images=PLUS_IMAGES)


class ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor for images and text, without its video processor: transformers builds
    that one on torchvision, which has no CPU build on PyPI. The tiny demo's pipeline holds this
    one (its image processing is Qwen2-VL's own, ``Qwen2VLImageProcessorPil``); a released
    checkpoint holds the full processor. diffusers loads it once this module is imported, as the
    runtime's families are."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token = self.video_token_id = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def condition_size(image, area: int = AREA) -> tuple[int, int]:
    """The (height, width) the pipelines bring an input image to: about ``area`` pixels at the
    image's aspect ratio, each side a multiple of 32 (their ``calculate_dimensions``)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(area, image.size[0] / image.size[1])
    return int(height), int(width)


def encoder_image(pipeline, image, area: int = AREA):
    """An input image resized as the pipeline's text encoder reads it: to ``condition_size``."""
    return pipeline.image_processor.resize(image, *condition_size(image, area))


def _image_required() -> RequestValidationError:
    return RequestValidationError("images", "is required: this model edits an input image (its text encoder "
                                  "reads the prompt with it)", None, show_value=False)


class QwenImageEditSteps(QwenImageSteps):
    """Qwen-Image's loop with the input image's VAE latents after the output's in every pass, and
    their grid in ``img_shapes`` (the prediction keeps the output's tokens)."""

    def noise(self, job, channels: int) -> torch.Tensor:
        encoded, sizes = self.input_latents.get(job.images, lambda: self.encode_images(job), job.cond.dtype)
        # the pipeline's prepare_latents takes latents in place of pixels, and draws the noise as before
        latents, references = self.pipeline.prepare_latents(encoded, 1, channels, job.height, job.width,
                                                            job.cond.dtype, self.device, job.generator)
        factor = self.pipeline.vae_scale_factor
        job.step_kwargs["references"] = references
        job.step_kwargs["img_shapes"] += [(1, height // factor // 2, width // factor // 2) for height, width in sizes]
        return latents

    def encode_images(self, job) -> tuple[Any, list[tuple[int, int]]]:
        """The input images' VAE latents, as the pipeline's ``prepare_latents`` encodes its pixels
        (``_encode_vae_image``, in ``argmax`` mode: the generator is not drawn from), and their sizes."""
        pixels, sizes = self.vae_images(job.images)

        def encode(image):
            return self.pipeline._encode_vae_image(image.to(self.device, job.cond.dtype), job.generator)

        return (encode(pixels) if torch.is_tensor(pixels) else [encode(image) for image in pixels]), sizes

    def vae_images(self, images: list) -> tuple[Any, list[tuple[int, int]]]:
        """The pipeline's ``prepare_latents``' images and each one's (height, width): the one image,
        resized as its text encoder reads it, then normalized."""
        height, width = condition_size(images[0])
        image = self.pipeline.image_processor.preprocess(encoder_image(self.pipeline, images[0]), height, width)
        return image.unsqueeze(2), [(height, width)]


class QwenImageEditPlusSteps(QwenImageEditSteps):
    """Edit-Plus: each image brought to about 1024² from the image as given, their latents one after
    another."""

    def vae_images(self, images: list) -> tuple[Any, list[tuple[int, int]]]:
        sizes = [condition_size(image) for image in images]
        return [self.pipeline.image_processor.preprocess(image, height, width).unsqueeze(2)
                for image, (height, width) in zip(images, sizes, strict=True)], sizes


def build_tiny(out: Path, pipeline_class: str = "QwenImageEditPipeline") -> None:
    """A ``QwenImageEditPipeline`` at about the shape of diffusers' pipeline test: the tiny
    Qwen-Image demo's DiT, with its attention's query and key norms scaled so that its few output
    tokens read the input image's thousands (about 1024² pixels at the VAE's factor of 8); a
    Qwen2.5-VL with a two-block vision tower, whose image processor reads at most 112² pixels; a
    tokenizer whose vision markers are the model's and whose template prefix is the 64 tokens the
    pipeline drops."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer
    from triton_omni.families.qwen_image import tiny_transformer

    hidden, vocab = 64, AR_SHAPE["vocab_size"]
    tokenizer = build_tokenizer(out / "tokenizer", vocab, chat=True, template=TEMPLATE.format(""),
                                markers=VISION_TOKENS)
    prefix = TEMPLATE[: TEMPLATE.index(VISION_TOKENS[0])]
    assert len(tokenizer(prefix).input_ids) == DROPPED, "the template's system prompt must be what is dropped"
    marker = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    transformer = tiny_transformer(hidden)
    with torch.no_grad():  # the norms undo a scaled projection: scaling them sharpens the attention
        for name, module in transformer.named_modules():
            if name.endswith((".norm_q", ".norm_k", ".norm_added_q", ".norm_added_k")):
                module.weight.mul_(4.0)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": vocab,
                     "rope_scaling": {"mrope_section": [4, 6, 6], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        vocab_size=vocab, vision_start_token_id=marker["<|vision_start|>"],
        vision_end_token_id=marker["<|vision_end|>"], image_token_id=marker["<|image_pad|>"],
    )).eval()
    processor = ImageTextProcessor(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112), tokenizer)
    getattr(diffusers, pipeline_class)(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                       text_encoder=text_encoder, tokenizer=tokenizer,
                                       processor=processor).save_pretrained(out)


def build_tiny_plus(out: Path) -> None:
    """The tiny demo's components as a ``QwenImageEditPlusPipeline``."""
    build_tiny(out, "QwenImageEditPlusPipeline")


# Qwen2.5-VL-7B-Instruct's config: the language model and the vision tower Qwen-Image-Edit reads with
QWEN25_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "vocab_size": 152064,
                     "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}}
QWEN25_VL_7B_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}


def build_realistic_encoder(out: Path) -> None:
    """Qwen-Image-Edit's text encoder at Qwen2.5-VL-7B's shape, vision tower included (8.3 B
    parameters, random, bf16, about 17 GB), with the tiny demo's tokenizer (its vision markers'
    ids given to the model) and Qwen2-VL's image processor at its released pixel bounds, as a
    pipeline folder without DiT and VAE: ``ar_encoder``'s model beside the in-memory realistic
    DiT. Built on a GPU where there is one, then saved."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer, built_as

    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True, template=TEMPLATE.format(""),
                                markers=VISION_TOKENS)
    marker = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    with built_as("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16):
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=QWEN25_VL_7B_TEXT, vision_config=QWEN25_VL_7B_VISION, vocab_size=152064,
            vision_start_token_id=marker["<|vision_start|>"], vision_end_token_id=marker["<|vision_end|>"],
            image_token_id=marker["<|image_pad|>"], torch_dtype="bfloat16")).eval()
    processor = ImageTextProcessor(Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056), tokenizer)
    QwenImageEditPipeline(transformer=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                          text_encoder=encoder, tokenizer=tokenizer, processor=processor).save_pretrained(out)
    del encoder
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_realistic(device, dtype, pipeline_class: str = "QwenImageEditPipeline"):
    """Qwen-Image-Edit's 20.4 B MMDiT (Qwen-Image's), VAE and scheduler, random weights, in memory
    on ``device``; no text encoder (it serves ``prompt_embeds`` with the input image)."""
    import diffusers

    from triton_omni.families.qwen_image import build_realistic as build_qwen_image

    base = build_qwen_image(device, dtype)
    return getattr(diffusers, pipeline_class)(transformer=base.transformer, vae=base.vae, scheduler=base.scheduler,
                                              text_encoder=None, tokenizer=None, processor=None)


def build_realistic_plus(device, dtype):
    return build_realistic(device, dtype, "QwenImageEditPlusPipeline")


class QwenImageEdit(QwenImage):
    name = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    # sequence parallel splits the output's tokens, which an edit's image latents follow: not served
    capabilities = Capabilities(Guidance.TRUE_CFG, guides_above=1.0, step_cache=True, cfg_parallel=True,
                                compile=True, cuda_graphs=True, images=1, edits=True, lora=True)
    recipe = RECIPE
    step_adapter = QwenImageEditSteps
    demo = Demo("qwen-image-edit", "tiny-qwen-image-edit", build_tiny)
    demo_folders: ClassVar[dict] = {"realistic-qwen-image-edit-encoder": build_realistic_encoder}
    realistic: ClassVar[dict] = {"demo:realistic-qwen-image-edit": build_realistic}

    def hidden_size(self) -> int:
        """The DiT's text width, or (ar_encoder loads the pipeline without its DiT) the encoder's."""
        if self.pipeline.transformer is not None:
            return super().hidden_size()
        return int(self.pipeline.text_encoder.config.text_config.hidden_size)

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        raise _image_required()

    def encoder_images(self, images: list):
        """What the pipeline's ``encode_prompt`` is given as ``image``: the one image, at about 1024²."""
        return encoder_image(self.pipeline, images[0])

    def encode_prompt(self, prompt: str, device: torch.device,
                      images: list = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        [(embeds, _)] = self.encode_batch([prompt], device, [list(images)])
        return embeds, None

    def encode_batch(self, prompts: list[str], device: torch.device,
                     images: list[list] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each prompt read with its image by the pipeline's own ``encode_prompt``, one at a time
        (a row's vision tokens and positions are its own)."""
        self.require_text_encoder()
        encoded = []
        for prompt, given in zip(prompts, images or [[]] * len(prompts), strict=True):
            if not given:
                raise _image_required()
            embeds, mask = self.pipeline.encode_prompt(prompt, image=self.encoder_images(given), device=device)
            encoded.append((embeds[0] if mask is None else embeds[0][mask[0].bool()], None))
        return encoded

    def check_images(self, images: list, field: str = "images") -> tuple[int, int]:
        multiple = self.size_multiple()
        height, width = condition_size(images[-1])
        return height // multiple * multiple, width // multiple * multiple

    def image_kwargs(self, images: list) -> dict[str, Any]:
        return {"image": images[0]}


class QwenImageEditPlus(QwenImageEdit):
    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    capabilities = Capabilities(Guidance.TRUE_CFG, guides_above=1.0, step_cache=True, cfg_parallel=True,
                                compile=True, cuda_graphs=True, images=PLUS_IMAGES, edits=True, lora=True)
    recipe = PLUS_RECIPE
    step_adapter = QwenImageEditPlusSteps
    demo = Demo("qwen-image-edit-plus", "tiny-qwen-image-edit-plus", build_tiny_plus)
    demo_folders: ClassVar[dict] = {}
    realistic: ClassVar[dict] = {"demo:realistic-qwen-image-edit-plus": build_realistic_plus}

    def encoder_images(self, images: list):
        """Every image, each at about 384², as a list."""
        return [encoder_image(self.pipeline, image, PLUS_ENCODER_AREA) for image in images]

    def image_kwargs(self, images: list) -> dict[str, Any]:
        return {"image": list(images)}
