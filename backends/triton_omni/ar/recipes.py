"""Text-encoding recipes: how a diffusion pipeline turns a prompt into the
hidden states that condition it, so that ``ar_encoder`` hands ``diffusion``
exactly what the pipeline's own ``encode_prompt`` would compute.

A recipe is the text the encoder reads (the raw prompt, or the prompt in a
template), which layer's hidden states are taken, and how many leading
tokens (the template's) are dropped. The reference for each is diffusers'
pipeline of that family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42)
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_IMAGE_DROPPED = 34


@dataclass(frozen=True)
class EncoderRecipe:
    name: str
    render: Callable[[object, str], str]  # (tokenizer, prompt) -> the text the encoder reads
    layer: int = -1  # index into the model's hidden states (-1: the last, after the final norm)
    dropped: int = 0  # leading tokens of the rendered text left out of the output
    # What the pipeline encodes for a negative prompt it was not given: "" (the empty prompt's
    # encoding), or None: nothing, it runs without a negative (zero tokens leave the encoder).
    absent_negative: str | None = ""

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """One prompt's ``[num_tokens, hidden]`` of the recipe's layer, template tokens dropped."""
        return hidden[self.dropped :]


def _chat(tokenizer, prompt: str) -> str:
    """ZImagePipeline's rendering: one user turn, the generation prompt, thinking on."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


RECIPES = {
    "last_hidden_state": EncoderRecipe("last_hidden_state", lambda tokenizer, prompt: prompt),
    # QwenImagePipeline runs true CFG only when given a negative prompt ("" and " " included)
    "qwen_image": EncoderRecipe("qwen_image", lambda tokenizer, prompt: QWEN_IMAGE_TEMPLATE.format(prompt),
                                dropped=QWEN_IMAGE_DROPPED, absent_negative=None),
    "z_image": EncoderRecipe("z_image", _chat, layer=-2),
}


def recipe(name: str) -> EncoderRecipe:
    if name not in RECIPES:
        raise ValueError(f"model parameter recipe must be one of {sorted(RECIPES)}, got {name!r}")
    return RECIPES[name]
