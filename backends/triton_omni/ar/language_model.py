"""The language model inside a vision-language text encoder, as a folder vLLM
loads for its pooling runner.

Qwen-Image's text encoder is Qwen2.5-VL. Its prompts are text only, and for
text only its multimodal rotary embedding gives every section the same
position, which is ordinary rotary embedding: the language model alone is a
Qwen2 causal LM with the same weights. vLLM cannot load the vision-language
class for pooling everywhere (on a CPU it needs torchvision) and would hold
the vision tower for nothing, so the runner hands vLLM that Qwen2 instead:
its weights copied once, shard by shard, into the cache beside the demo
models, with the pipeline's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from triton_omni.demo_models import ensure_built

# The vision-language classes whose language model is a Qwen2 (text config, weights under model.*)
QWEN2_LANGUAGE_MODEL_OF = {"Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration"}


def language_key(key: str) -> str | None:
    """Qwen2's name of a vision-language checkpoint's tensor, or None for the
    vision tower's: checkpoints name the language model ``model.*`` (as
    released) or ``model.language_model.*`` (as transformers 5 lays it out)."""
    if key.startswith(("visual.", "model.visual.")):
        return None
    return key.replace("model.language_model.", "model.", 1)


def architecture(model: Path) -> str:
    config = model / "config.json"
    return (json.loads(config.read_text()).get("architectures") or [""])[0] if config.exists() else ""


def has_language_model(model: Path) -> bool:
    """Whether ``model`` is a vision-language encoder this module can take the language model of."""
    return architecture(model) in QWEN2_LANGUAGE_MODEL_OF


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
    (out / "config.json").write_text(json.dumps(_qwen2_config(json.loads((model / "config.json").read_text())),
                                                indent=2))
    if (model / "generation_config.json").exists():
        shutil.copy(model / "generation_config.json", out)
    _copy_language_weights(model, out)
    for path in tokenizer.iterdir():
        if path.is_file():
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


def _copy_language_weights(model: Path, out: Path) -> None:
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
            tensors = {language_key(key): source.get_tensor(key) for key in names if language_key(key)}
        if tensors:
            save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, shard.name)
    if not weight_map:
        raise ValueError(f"{model}: no language-model weights (model.*) in its shards")
    if len(set(weight_map.values())) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
