"""A prompt that holds images, as the thinker of a Qwen2.5-Omni checkpoint reads it.

As with audio (``audio_prompt.py``), what the thinker does with an image happens before its causal LM:
its processor resizes the image onto the vision tower's patch grid and widens the prompt's one image
marker into a token per merged patch, and the vision tower turns the patches into one embedding per
token, which takes its marker's place among the prompt's embeddings. Unlike audio, an image moves the
LM's rotary positions: the thinker's rotary embedding has three sections (time, height, width), and an
image's tokens take their patch's row and column there, the text after it continuing from the largest
position so far. Those positions (``MropePositions``) are the model's own ``get_rope_index``'s; the
transformers engine applies them in the prefill and decodes each new token at its index plus the
prompt's ``delta`` (every section at the same position: ordinary rotary embedding, shifted). vLLM is
handed the plain LM, which knows no sections, so a prompt with images runs on the transformers engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, SimpleNamespace

import torch

from triton_omni.ar.audio_prompt import weights
from triton_omni.ar.language_model import architecture
from triton_omni.errors import RequestValidationError

# the omni classes whose vision tower this module runs (Qwen3-Omni's adds deepstack features its LM
# reads at several layers: not served)
EYES_OF = {"Qwen2_5OmniForConditionalGeneration": "qwen2_5_omni.modeling_qwen2_5_omni"}


@dataclass(frozen=True)
class MropePositions:
    """A prompt's multimodal rotary positions: ``positions`` [3, prompt] (time, height, width), the
    rotary dimensions' split among them (``section``, as the model's ``mrope_section``), and ``delta``:
    a generated token's position less its index."""

    positions: torch.Tensor
    section: tuple[int, ...]
    delta: int


def has_eyes(model: Path) -> bool:
    """Whether ``model``'s thinker sees through this module: its class one of ``EYES_OF``, its vision
    tower saved (a benchmark's realistic checkpoint may leave the towers out)."""
    if architecture(model) not in EYES_OF:
        return False
    from safetensors import safe_open

    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            if any(key.startswith("thinker.visual.") for key in names):
                return True
    return False


class ThinkerEyes:
    """A Qwen2.5-Omni thinker's image processor and vision tower, and its rotary positions."""

    def __init__(self, checkpoint: Path, device: torch.device, dtype: torch.dtype,
                 embed_tokens: torch.Tensor | None = None):
        """``embed_tokens``: the thinker's token embeddings where already loaded (the ears')."""
        import importlib

        from transformers import AutoConfig

        checkpoint = Path(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint).thinker_config
        self.config = config
        self.image_token_id = config.image_token_id
        self.section = tuple(config.text_config.rope_parameters["mrope_section"])
        self.processor = _image_processor(checkpoint)
        modeling = importlib.import_module(f"transformers.models.{EYES_OF[architecture(checkpoint)]}")
        self._rope_index = modeling.Qwen2_5OmniPreTrainedModelForConditionalGeneration
        prefixes = ("thinker.visual.",) + (() if embed_tokens is not None else ("thinker.model.embed_tokens.",))
        found = weights(checkpoint, prefixes)
        self.tower = modeling.Qwen2_5OmniVisionEncoder._from_config(config.vision_config, dtype=dtype)
        self.tower.load_state_dict({k.removeprefix("thinker.visual."): v for k, v in found.items()
                                    if k.startswith("thinker.visual.")})
        self.tower.to(device).eval()
        self.merge = config.vision_config.spatial_merge_size
        self.device, self.dtype = device, dtype
        self.embed_tokens = embed_tokens if embed_tokens is not None \
            else found["thinker.model.embed_tokens.weight"].to(device, dtype)

    def prompt(self, ids: list[int], embeds: torch.Tensor | None, images: list, field: str = "images",
               max_tokens: int | None = None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``ids`` (one image marker per image) with each marker repeated as many times as its image
        has tokens, the prompt's embeddings ``[tokens, hidden]`` (``embeds``, the ids' own where None,
        with the tower's in the markers' places), and the images' patch grids [images, 3], as the
        processor makes them. A prompt that grows past ``max_tokens`` is refused before the tower runs."""
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
            seen = self.tower(processed["pixel_values"].to(self.device, self.dtype), grid_thw=grid.to(self.device))
            seen = seen.pooler_output.split(counts)
            if embeds is None:
                embeds = self.embed_tokens[torch.tensor(ids, device=self.device)]
            pieces, expanded, start = [], [], 0
            for marker, count, tokens in zip(markers, counts, seen, strict=True):
                pieces += [embeds[start:marker], tokens.to(embeds.dtype)]
                expanded += ids[start:marker] + [self.image_token_id] * count
                start = marker + 1
            pieces.append(embeds[start:])
            expanded += ids[start:]
            return expanded, torch.cat(pieces).clone(), grid

    def positions(self, ids: list[int], grid: torch.Tensor, audio_frames: torch.Tensor | None) -> MropePositions:
        """The model's ``get_rope_index`` on the widened prompt: its images' patch grids ``grid`` and
        its clips' log-mel frames ``audio_frames`` (what the thinker reads of them)."""
        model = SimpleNamespace(config=self.config, spatial_merge_size=self.merge)
        for name in ("get_llm_pos_ids_for_vision", "get_chunked_index"):
            setattr(model, name, MethodType(getattr(self._rope_index, name), model))
        tokens = torch.tensor([ids])
        positions, delta = self._rope_index.get_rope_index(
            model, tokens, image_grid_thw=grid, attention_mask=torch.ones_like(tokens), audio_seqlens=audio_frames)
        return MropePositions(positions[:, 0], self.section, int(delta))


def mrope(rotary: torch.nn.Module, hidden: torch.Tensor, positions: MropePositions) -> tuple[torch.Tensor, ...]:
    """``rotary``'s (a plain rotary embedding's) cos and sin [1, prompt, head dim] at the three sections'
    positions, each rotary dimension taken from its section's (the model's multimodal rotary embedding
    followed by its ``apply_multimodal_rotary_pos_emb``'s split)."""
    per_axis = [rotary(hidden, axis[None].to(hidden.device)) for axis in positions.positions]
    split = list(positions.section) * 2  # cos and sin repeat their frequencies over the two halves

    def joined(which: int) -> torch.Tensor:
        parts = [axis[which].split(split, dim=-1) for axis in per_axis]
        return torch.cat([parts[i % 3][i] for i in range(len(split))], dim=-1)

    return joined(0), joined(1)


def _image_processor(checkpoint: Path):
    """The checkpoint's image processor (its ``preprocessor_config.json`` holds the image side beside
    the audio's), or the family's defaults where it saved only the audio side; the PIL one, which
    needs no torchvision."""
    from transformers import Qwen2VLImageProcessorPil

    config = checkpoint / "preprocessor_config.json"
    saved = json.loads(config.read_text()) if config.exists() else {}
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**{key: saved[key] for key in keys if key in saved})
