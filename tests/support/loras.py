"""Tiny LoRA adapters for the demo pipelines, built the way their users train and save them: a
PEFT ``LoraConfig`` added to the pipeline's transformer, its factors drawn at random (trained
ones would be as arbitrary here), saved by the pipeline's own ``save_lora_weights``."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from tests.support.pipelines import pipeline

# Every linear layer of the blocks' attention; Z-Image's feed-forward too (its names differ)
TARGETS = {"z-image": ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]}
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def build_lora(family: str, folder: Path, seed: int, rank: int = 4, alpha: float | None = None,
               targets: list[str] | None = None, spread: float = 0.3, component: str = "transformer",
               weight_name: str | None = None) -> Path:
    """A LoRA of ``family``'s demo transformer (its ``component``: Wan 2.2 A14B's second expert is
    ``transformer_2``) in ``folder`` (``weight_name``, else ``pytorch_lora_weights.safetensors``);
    returns the folder, or the file where ``weight_name`` is given."""
    pipe = pipeline(family)
    transformer = copy.deepcopy(getattr(pipe, component))
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets or TARGETS.get(family, ATTENTION),
                        init_lora_weights=False)
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in transformer.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * spread
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                 transformer_lora_adapter_metadata=config.to_dict(), weight_name=weight_name)
    return folder if weight_name is None else folder / weight_name


def build_expert_pair(family: str, folder: Path, seed: int, rank: int = 4) -> dict[str, str]:
    """A Wan 2.2 A14B adapter as its users get one: a file per expert (``high_noise_model`` and
    ``low_noise_model``), as ``lora_adapters`` names it."""
    return {component: str(build_lora(family, folder, seed + index, rank, component=component,
                                      weight_name=f"{noise}_noise_model.safetensors"))
            for index, (component, noise) in enumerate((("transformer", "high"), ("transformer_2", "low")))}


def with_adapter(family: str, folder: Path | str | dict | None, scale: float = 1.0):
    """The demo pipeline with the adapter in ``folder`` loaded and set at ``scale`` (None: with none),
    as its users run one: ``load_lora_weights`` then ``set_adapters``; a pair of a two-expert
    pipeline (``{"transformer": file, "transformer_2": file}``) as Wan 2.2's users load one, the
    second with ``load_into_transformer_2=True``, both at ``scale``. Undone on exit."""
    import contextlib

    @contextlib.contextmanager
    def loaded():
        pipe = pipeline(family)
        if folder is None:
            yield pipe
            return
        parts = folder if isinstance(folder, dict) else {"transformer": folder}
        names = []
        for component, path in parts.items():
            names.append(f"request_{component}")
            pipe.load_lora_weights(str(path), adapter_name=names[-1],
                                   **({"load_into_transformer_2": True} if component == "transformer_2" else {}))
        pipe.set_adapters(names, [scale] * len(names))
        try:
            yield pipe
        finally:
            pipe.delete_adapters(names)

    return loaded()


def build_llm_lora(folder: Path, seed: int, rank: int = 8, alpha: float | None = None,
                   targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"), spread: float = 0.3) -> Path:
    """A PEFT LoRA of the demo AR model (``demo:tiny-qwen2``) in ``folder``, as ``save_pretrained``
    writes one (``adapter_config.json``, ``adapter_model.safetensors``)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from triton_omni.demo_models import AR_DEMO, resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(f"demo:{AR_DEMO}"), dtype=torch.float32)
    adapted = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                                               init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in adapted.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * spread
    adapted.save_pretrained(folder)
    return folder


def merged_llm(adapter: Path, folder: Path) -> Path:
    """The demo AR model with ``adapter`` merged into its weights by PEFT (``merge_and_unload``), saved
    with its tokenizer in ``folder``: what the model with that adapter is, as one model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from triton_omni.demo_models import AR_DEMO, resolve_model

    path = resolve_model(f"demo:{AR_DEMO}")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), str(adapter))
    model.merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return folder
