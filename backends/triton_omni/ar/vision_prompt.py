"""A prompt that holds images, as the thinker of a Qwen3-Omni or Qwen2.5-Omni checkpoint reads it.

As with audio (``audio_prompt.py``), what the thinker does with an image happens before its causal LM:
its processor resizes the image onto the vision tower's patch grid and widens the prompt's one image
marker into a token per merged patch, and the vision tower turns the patches into one embedding per
token, which takes its marker's place among the prompt's embeddings. Unlike audio, an image moves the
LM's rotary positions: the thinker's rotary embedding has three sections (time, height, width), and an
image's tokens take their patch's row and column there, the text after it continuing from the largest
position so far. Those positions (``VisionInputs``) are the model's own ``get_rope_index``'s; the
transformers engine applies them in the prefill and decodes each new token at its index plus the
prompt's ``delta`` (every section at the same position: ordinary rotary embedding, shifted). The two
families join the sections differently (Qwen2.5-Omni: a block of rotary dimensions a section;
Qwen3-Omni: interleaved), and Qwen3-Omni's vision tower also gives "deepstack" features, which its LM
adds to the outputs of its first decoder layers at the images' tokens. vLLM is handed the plain LM,
which knows none of this, so a prompt with images runs on the transformers engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, SimpleNamespace

import torch

from triton_omni.ar.language_model import architecture, saves_weights, weights
from triton_omni.errors import RequestValidationError


@dataclass(frozen=True)
class VisionInputs:
    """What the LM reads of a prompt's images beyond its embeddings: ``positions`` [3, prompt] (time,
    height, width), the rotary dimensions' split among them (``section``, the model's ``mrope_section``,
    joined in blocks or ``interleaved``), ``delta``: a generated token's position less its index; and
    Qwen3-Omni's ``deepstack`` features (one [image tokens, hidden] a layer, added to the output of
    decoder layer i at the prompt positions ``image_at``)."""

    positions: torch.Tensor
    section: tuple[int, ...]
    delta: int
    interleaved: bool = False
    deepstack: tuple[torch.Tensor, ...] = ()
    image_at: torch.Tensor | None = None


@dataclass(frozen=True)
class SeenPrompt:
    """A prompt with its images read: its widened ids, its embeddings, the images' patch grids, and
    the tower's deepstack features (Qwen3-Omni's)."""

    ids: list[int]
    embeds: torch.Tensor
    grid: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


def has_eyes(model: Path) -> bool:
    """Whether ``model``'s thinker sees through this module: its class one of ``EYES_OF``, its vision
    tower saved (a benchmark's realistic checkpoint may leave the towers out)."""
    return architecture(model) in EYES_OF and saves_weights(model, "thinker.visual.")


def eyes_of(checkpoint: Path, device: torch.device, dtype: torch.dtype,
            embed_tokens: torch.Tensor | None = None) -> ThinkerEyes:
    """The eyes of ``checkpoint``'s thinker (``has_eyes``); ``embed_tokens``: the thinker's token
    embeddings where already loaded (the ears')."""
    return EYES_OF[architecture(Path(checkpoint))](checkpoint, device, dtype, embed_tokens)


class ThinkerEyes:
    """A Qwen-Omni thinker's image processor and vision tower, and its rotary positions (a subclass a
    family: its modeling module's classes, how it joins the rotary sections)."""

    modeling: str  # transformers' modeling module of the family
    tower_class: str  # its vision tower's class there
    rope_class: str  # the class whose get_rope_index the thinker runs
    interleaved = False

    def __init__(self, checkpoint: Path, device: torch.device, dtype: torch.dtype,
                 embed_tokens: torch.Tensor | None = None):
        import importlib

        from transformers import AutoConfig

        checkpoint = Path(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint).thinker_config
        self.config = config
        self.image_token_id = config.image_token_id
        self.section = tuple(config.text_config.rope_parameters["mrope_section"])
        self.processor = _image_processor(checkpoint, config.vision_config)
        modeling = importlib.import_module(f"transformers.models.{self.modeling}")
        self._rope_index = getattr(modeling, self.rope_class)
        prefixes = ("thinker.visual.",) + (() if embed_tokens is not None else ("thinker.model.embed_tokens.",))
        found = weights(checkpoint, prefixes)
        self.tower = getattr(modeling, self.tower_class)._from_config(config.vision_config, dtype=dtype)
        self.tower.load_state_dict({k.removeprefix("thinker.visual."): v for k, v in found.items()
                                    if k.startswith("thinker.visual.")})
        self.tower.to(device).eval()
        self.merge = config.vision_config.spatial_merge_size
        self.device, self.dtype = device, dtype
        self.embed_tokens = embed_tokens if embed_tokens is not None \
            else found["thinker.model.embed_tokens.weight"].to(device, dtype)

    def prompt(self, ids: list[int], embeds: torch.Tensor | None, images: list, field: str = "images",
               max_tokens: int | None = None) -> SeenPrompt:
        """``ids`` (one image marker per image) with each marker repeated as many times as its image
        has tokens, the prompt's embeddings ``[tokens, hidden]`` (``embeds``, the ids' own where None,
        with the tower's in the markers' places), the images' patch grids [images, 3] as the processor
        makes them, and the tower's deepstack features. A prompt that grows past ``max_tokens`` is
        refused before the tower runs."""
        markers = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(markers) != len(images):
            raise RequestValidationError(field, f"the prompt holds {len(markers)} image markers (the chat "
                                         f"template's image parts) for {len(images)} images", len(images))
        processed = self.processor(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge**2).tolist()
        length = len(ids) - len(images) + sum(counts)
        if max_tokens is not None and length > max_tokens:
            raise RequestValidationError(field, f"the prompt with its images has {length} tokens; this model "
                                         f"allows at most {max_tokens}", f"{len(images)} images")
        with torch.inference_mode():
            out = self.tower(processed["pixel_values"].to(self.device, self.dtype), grid_thw=grid.to(self.device))
            seen = out.pooler_output.split(counts)
            if embeds is None:
                embeds = self.embed_tokens[torch.tensor(ids, device=self.device)]
            pieces, expanded, start = [], [], 0
            for marker, count, tokens in zip(markers, counts, seen, strict=True):
                pieces += [embeds[start:marker], tokens.to(embeds.dtype)]
                expanded += ids[start:marker] + [self.image_token_id] * count
                start = marker + 1
            pieces.append(embeds[start:])
            expanded += ids[start:]
            deepstack = tuple(features.clone() for features in getattr(out, "deepstack_features", None) or ())
            return SeenPrompt(expanded, torch.cat(pieces).clone(), grid, deepstack)

    def inputs(self, seen: SeenPrompt, audio_frames: torch.Tensor | None) -> VisionInputs:
        """What the LM reads of ``seen`` beyond its embeddings: the model's ``get_rope_index`` on the
        widened prompt (its images' patch grids, and its clips' log-mel frames ``audio_frames``: what
        the thinker reads of them), and the deepstack features at the images' tokens."""
        model = SimpleNamespace(config=self.config, spatial_merge_size=self.merge)
        for name in ("get_llm_pos_ids_for_vision", "get_chunked_index"):  # the helpers it calls on itself
            setattr(model, name, MethodType(getattr(self._rope_index, name), model))
        tokens = torch.tensor([seen.ids])
        positions, delta = self._rope_index.get_rope_index(
            model, tokens, image_grid_thw=seen.grid, attention_mask=torch.ones_like(tokens), audio_seqlens=audio_frames)
        image_at = (tokens[0] == self.image_token_id).nonzero().flatten() if seen.deepstack else None
        return VisionInputs(positions[:, 0], self.section, int(delta), self.interleaved, seen.deepstack, image_at)


class Qwen25Eyes(ThinkerEyes):
    """Qwen2.5-Omni's: its rotary sections in blocks."""

    modeling = "qwen2_5_omni.modeling_qwen2_5_omni"
    tower_class, rope_class = "Qwen2_5OmniVisionEncoder", "Qwen2_5OmniPreTrainedModelForConditionalGeneration"


class Qwen3Eyes(ThinkerEyes):
    """Qwen3-Omni's: its rotary sections interleaved, and deepstack features."""

    modeling = "qwen3_omni_moe.modeling_qwen3_omni_moe"
    tower_class, rope_class = "Qwen3OmniMoeVisionEncoder", "Qwen3OmniMoePreTrainedModelForConditionalGeneration"
    interleaved = True


# the omni classes whose vision tower this module runs
EYES_OF: dict[str, type[ThinkerEyes]] = {"Qwen3OmniMoeForConditionalGeneration": Qwen3Eyes,
                                         "Qwen2_5OmniForConditionalGeneration": Qwen25Eyes}


def mrope(rotary: torch.nn.Module, hidden: torch.Tensor, vision: VisionInputs) -> tuple[torch.Tensor, ...]:
    """``rotary``'s (a plain rotary embedding's) cos and sin [1, prompt, head dim] at the three sections'
    positions, each rotary dimension taken from its section's as the model joins them: Qwen2.5-Omni's
    a block a section (its ``apply_multimodal_rotary_pos_emb``'s split), Qwen3-Omni's interleaved
    (time, height, width, time, ...: its rotary embedding's ``recomposition_frequencies``)."""
    per_axis = [rotary(hidden, axis[None].to(hidden.device)) for axis in vision.positions]

    def joined(which: int) -> torch.Tensor:
        if vision.interleaved:
            half = per_axis[0][which].shape[-1] // 2  # cos and sin repeat their frequencies over two halves
            freqs = per_axis[0][which][..., :half].clone()
            for axis in (1, 2):
                pick = slice(axis, vision.section[axis] * 3, 3)
                freqs[..., pick] = per_axis[axis][which][..., :half][..., pick]
            return torch.cat([freqs, freqs], dim=-1)
        split = list(vision.section) * 2
        parts = [axis[which].split(split, dim=-1) for axis in per_axis]
        return torch.cat([parts[i % 3][i] for i in range(len(split))], dim=-1)

    return joined(0), joined(1)


def _image_processor(checkpoint: Path, vision_config):
    """The checkpoint's image processor (its ``preprocessor_config.json`` holds the image side beside
    the audio's), or, where it saved only the audio side, one at its vision tower's patch grid; the
    PIL one, which needs no torchvision."""
    from transformers import Qwen2VLImageProcessorPil

    config = checkpoint / "preprocessor_config.json"
    saved = json.loads(config.read_text()) if config.exists() else {}
    grid = {"patch_size": vision_config.patch_size, "merge_size": vision_config.spatial_merge_size,
            "temporal_patch_size": vision_config.temporal_patch_size}
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**(grid | {key: saved[key] for key in keys if key in saved}))
