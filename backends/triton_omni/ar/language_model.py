"""The language model inside a multimodal model, as a folder an engine loads
as a plain causal LM.

Qwen-Image's text encoder is Qwen2.5-VL. Its prompts are text only, and for
text only its multimodal rotary embedding gives every section the same
position, which is ordinary rotary embedding: the language model alone is a
Qwen2 causal LM with the same weights. vLLM cannot load the vision-language
class for pooling everywhere (on a CPU it needs torchvision) and would hold
the vision tower for nothing, so the runner hands vLLM that Qwen2 instead:
its weights copied once, shard by shard, into the cache beside the demo
models, with the pipeline's tokenizer.

The same holds for a Qwen-Omni model's thinker (the ``ar`` stage's model where
the speech stage speaks its replies): for text its language model is a
Qwen3-MoE (Qwen3-Omni) or Qwen2 (Qwen2.5-Omni) causal LM, under ``thinker.``
beside the audio and vision towers, the talker and the codec decoder, none of
which the text stage needs to hold.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from triton_omni.demo_models import ensure_built

# The vision-language classes whose language model is a Qwen2 (text config, weights under model.*)
QWEN2_LANGUAGE_MODEL_OF = {"Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration"}
# The omni classes: their thinker's causal LM (model_type, architecture), text config in
# thinker_config.text_config, weights under thinker.model.* and thinker.lm_head.*
THINKER_LANGUAGE_MODEL_OF = {
    "Qwen3OmniMoeForConditionalGeneration": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2_5OmniForConditionalGeneration": ("qwen2", "Qwen2ForCausalLM"),
}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # the checkpoint's weights: never the tokenizer's


def language_key(key: str, omni: bool = False) -> str | None:
    """The causal LM's name of a checkpoint's tensor, or None for the towers' and
    the other stages': a vision-language checkpoint names the language model
    ``model.*`` (as released) or ``model.language_model.*`` (as transformers 5
    lays it out); an omni checkpoint ``thinker.model.*`` and ``thinker.lm_head.*``."""
    if omni:
        return key.removeprefix("thinker.") if key.startswith(("thinker.model.", "thinker.lm_head.")) else None
    if key.startswith(("visual.", "model.visual.")):
        return None
    return key.replace("model.language_model.", "model.", 1)


def architecture(model: Path) -> str:
    config = model / "config.json"
    return (json.loads(config.read_text()).get("architectures") or [""])[0] if config.exists() else ""


def saves_weights(checkpoint: Path, prefix: str) -> bool:
    """Whether any of ``checkpoint``'s shards holds a tensor under ``prefix`` (a benchmark's realistic
    checkpoint may leave a model's towers out)."""
    from safetensors import safe_open

    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            if any(key.startswith(prefix) for key in names):
                return True
    return False


def weights(checkpoint: Path, prefixes: tuple[str, ...]) -> dict:
    """The checkpoint's tensors under ``prefixes``, read shard by shard."""
    from safetensors import safe_open

    found = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            found |= {key: source.get_tensor(key) for key in names if key.startswith(prefixes)}
    return found


def has_language_model(model: Path) -> bool:
    """Whether ``model`` is a vision-language encoder this module can take the language model of."""
    return architecture(model) in QWEN2_LANGUAGE_MODEL_OF


def is_omni(model: Path) -> bool:
    """Whether ``model`` is a Qwen-Omni checkpoint, whose thinker this module takes out."""
    return architecture(model) in THINKER_LANGUAGE_MODEL_OF


def language_model(model: Path, tokenizer: Path) -> Path:
    """A Qwen2ForCausalLM folder holding ``model``'s language model and ``tokenizer``'s
    files, built once into the cache (keyed by the source files, so a changed
    checkpoint builds anew)."""
    return ensure_built(f"language-model-{_fingerprint(model, tokenizer)}", lambda out: _write(model, tokenizer, out))


def _fingerprint(*folders: Path) -> str:
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.resolve().iterdir()):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _write(model: Path, tokenizer: Path, out: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    omni = is_omni(model)
    (out / "config.json").write_text(json.dumps(_thinker_config(config) if omni else _qwen2_config(config), indent=2))
    if (model / "generation_config.json").exists() and not omni:  # an omni's is the whole model's generate
        shutil.copy(model / "generation_config.json", out)
    _copy_language_weights(model, out, omni)
    for path in tokenizer.iterdir():  # an omni's tokenizer sits beside its own config and weights
        if path.is_file() and not path.name.startswith((".", "config.json", "generation_config.json", "model")) \
                and path.suffix not in WEIGHT_SUFFIXES:  # a shard of the same name would undo its copy's
            shutil.copy(path, out)


def _qwen2_config(config: dict) -> dict:
    """Qwen2's config from a vision-language one: its text part (nested in
    ``text_config`` since transformers 4.5x, at the top level before), with
    the rotary sections dropped (text only: one position for all of them)."""
    text = dict(config.get("text_config") or config)
    for key in ("vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id", "vision_token_id", "layer_types", "auto_map"):
        text.pop(key, None)
    for rope_key in ("rope_parameters", "rope_scaling"):
        rope = text.get(rope_key)
        if isinstance(rope, dict):
            rope = {k: v for k, v in rope.items() if k != "mrope_section"}
            text[rope_key] = None if rope_key == "rope_scaling" and rope.get("type", "default") == "default" \
                else rope
    text["rope_theta"] = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta", 1e6)
    text |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
             "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
             "use_sliding_window": False, "sliding_window": None}
    for dtype_key in ("torch_dtype", "dtype"):
        if dtype_key in config:
            text[dtype_key] = config[dtype_key]
    return text


def _thinker_config(config: dict) -> dict:
    """The thinker's causal LM config: its text config, the multimodal rotary
    sections dropped (for text, every section has the same position)."""
    model_type, architecture_name = THINKER_LANGUAGE_MODEL_OF[config["architectures"][0]]
    text = dict(config["thinker_config"]["text_config"])
    rope = text.get("rope_parameters") or {}
    text["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("mrope_section", "interleaved")} or None
    text.pop("rope_scaling", None)
    return text | {"model_type": model_type, "architectures": [architecture_name], "tie_word_embeddings": False,
                   "use_sliding_window": False, "sliding_window": None}


def _copy_language_weights(model: Path, out: Path, omni: bool = False) -> None:
    """Shard by shard (one shard in memory at a time), the language model's
    tensors only; an index when the source had several shards."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(model.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{model}: no .safetensors weights to take the language model from")
    weight_map = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            tensors = {language_key(key, omni): source.get_tensor(key) for key in names if language_key(key, omni)}
        if tensors:
            save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, shard.name)
    if not weight_map:
        raise ValueError(f"{model}: no language-model weights ({'thinker.' if omni else ''}model.*) in its shards")
    if len(set(weight_map.values())) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
