"""``ar_encoder`` for a family whose text encoders are not one causal LM (FLUX.1: CLIP's pooled
vector and T5's sequence), or whose encoder reads the input image with the prompt (Qwen-Image-Edit:
Qwen2.5-VL's vision tower): the family's pipeline loaded without its DiT and VAE, each batch
encoded by the pipeline's own ``encode_prompt`` (the family's ``encode_batch``), so that the
embeddings are the pipeline's by construction. It runs on transformers' models; vLLM's pooling
runner returns neither CLIP's nor T5's states, nor hidden states for multimodal input."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from triton_omni.families import family_of


def dropped_components(pipeline_path: Path) -> dict[str, None]:
    """The components the encoder does without: the VAE and every denoiser (Wan 2.2 A14B has two,
    ``transformer`` and ``transformer_2``), by the names the pipeline's ``model_index.json`` gives."""
    index = Path(pipeline_path) / "model_index.json"
    components = json.loads(index.read_text()) if index.is_file() else {"transformer": None, "vae": None}
    return {name: None for name in components if name == "vae" or name.startswith("transformer")}


class PipelineTextEngine:
    def __init__(self, pipeline_path: Path, device: str, dtype: torch.dtype):
        from diffusers import DiffusionPipeline

        self.device = torch.device(device)
        pipeline = DiffusionPipeline.from_pretrained(pipeline_path, **dropped_components(pipeline_path), dtype=dtype)
        pipeline.to(self.device)
        self.family = family_of(pipeline)
        self.hidden_size = self.family.hidden_size()
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-ar-encode")

    async def encode_prompts(self, prompts: list[str],
                             images: list[list]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each prompt's sequence ``[tokens, hidden]`` and pooled embedding ``[pooled]`` (or None),
        one batch; ``images``: each prompt's input images, for a family whose encoder reads them."""
        return await asyncio.get_running_loop().run_in_executor(self._encoder, self._encode_blocking, prompts,
                                                                images)

    def _encode_blocking(self, prompts: list[str], images: list[list]) -> list[tuple[torch.Tensor,
                                                                                     torch.Tensor | None]]:
        with torch.inference_mode():
            return self.family.encode_batch(prompts, self.device, images)

    async def shutdown(self) -> None:
        self._encoder.shutdown(wait=True)
