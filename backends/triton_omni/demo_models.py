"""Tiny, seeded, random-weight demo models, built locally (no hub access): the AR model here,
the pipeline families' own in their modules (``triton_omni.families``), with the helpers here.

Everything runs offline: the tokenizer is a byte-level BPE trained on a small
built-in corpus, the weights come from ``torch.manual_seed``. The AR model is a
Qwen2 whose shape vLLM's CPU attention backend accepts (head_dim 64).

Model configs refer to these models as ``demo:<name>``; ``resolve_model``
turns that into a folder under the cache (``$TRITON_OMNI_CACHE``, default
``~/.cache/triton-omni``; the tools set it to a source checkout's ``.cache``).
Anything else is passed through as a local path or hub id.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_PREFIX = "demo:"
AR_DEMO = "tiny-qwen2"
DIFFUSION_DEMO = "tiny-sd"  # the pipeline families' demos are built by their modules (triton_omni.families)
# Real sizes, random weights: for benchmarks on a GPU (omni-triton bench --preset realistic).
AR_REALISTIC = "realistic-qwen2"
# Bump when a builder changes, so stale caches are rebuilt.
BUILD_VERSION = 11

AR_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}

# Qwen2.5-0.5B's shape (the tokenizer stays the small offline one: ids < 512), its output layer tied
# to its embeddings and its rotary base as its config.json has them; its context held to 1024.
AR_REALISTIC_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
# Qwen3-4B's shape (Z-Image's text encoder), as its config.json gives it.
QWEN3_4B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# A tiny UNet/VAE, and Stable Diffusion 1.5's (860M-parameter UNet, 8x VAE).
UNET_TINY = {"sample_size": 16, "layers_per_block": 1, "block_out_channels": (32, 64),
             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}
UNET_SD15 = {"sample_size": 64, "layers_per_block": 2, "block_out_channels": (320, 640, 1280, 1280),
             "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
             "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3}
VAE_TINY = {"block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 32}
VAE_SD15 = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "sample_size": 512}

_CORPUS = """
A red fox jumps over the lazy dog. The quick brown cat sleeps in the sun.
Paint a watercolor landscape with mountains, a lake and a small wooden cabin.
Triton serves models over HTTP and gRPC with dynamic batching and metrics.
An astronaut rides a horse on the moon; a robot reads a book in a library.
Diffusion models turn noise into images, step by step, guided by a prompt.
Once upon a time there was a lighthouse by the sea, and a keeper who sang.
0123456789 ,.;:!?'"()[]{}<>-+*/=_@#$%&
""".strip()


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "triton-omni"
    return Path(os.environ.get("TRITON_OMNI_CACHE", default)).resolve()


def resolve_model(model: str) -> str:
    """``demo:<name>`` -> its built folder (building it if missing); else unchanged."""
    if not model.startswith(DEMO_PREFIX):
        return model
    name = model.removeprefix(DEMO_PREFIX)
    from triton_omni.families import demo_folders  # the families' builders use this module's helpers
    from triton_omni.speech.demos import SPEECH_DEMOS

    builders = {AR_DEMO: build_ar_model, AR_REALISTIC: lambda out: build_ar_model(out, AR_REALISTIC_SHAPE),
                **demo_folders(), **SPEECH_DEMOS}
    if name not in builders:
        raise ValueError(f"unknown demo model {model!r}; known: {sorted(DEMO_PREFIX + n for n in builders)}")
    return str(ensure_built(name, builders[name]))


def ensure_built(name: str, builder) -> Path:
    """Build once into the cache (``built_once``)."""
    return built_once(cache_dir() / "models" / name, builder, str(BUILD_VERSION))


def built_once(target: Path, builder, version: str) -> Path:
    """``target``, built by ``builder(folder)`` unless a complete build of ``version`` is there; a
    stamp file marks a complete build.

    Several processes may ask for one folder at once (a server's model instances, servers started
    side by side, the tests' processes): a lock file lets one of them build while the others wait,
    and they then find its build. A complete build is never removed under a reader. The build goes
    to a temporary folder renamed into place, so a build cut short never looks complete.
    """
    if _complete(target, version):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _complete(target, version):  # built by another process while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            builder(staging)
            (staging / ".built").write_text(version)
            shutil.rmtree(target, ignore_errors=True)  # another version's build, or one cut short
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("Built %s", target)
    return target


def _complete(target: Path, version: str) -> bool:
    try:
        return (target / ".built").read_text() == version
    except OSError:  # not built, or an older build being replaced
        return False


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` across processes, held for the block: closing the file lets
    it go, and so does the kernel if the process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# The chat markers of the Qwen family, and a chat template shaped like Qwen3's (Z-Image renders its
# prompts with it; Qwen-Image writes the same markers into its own template string).
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int, max_length: int = AR_SHAPE["max_position_embeddings"],
                    chat: bool = False, template: str = "", markers: tuple[str, ...] = (),
                    chat_template: str | None = None, bos: str | None = None, eos_after: bool = False):
    """A byte-level BPE trained on the built-in corpus. ``template``: a prompt template the model's
    pipeline wraps every prompt in, trained on until each of its words is one token, as in the real
    tokenizer, so that the template's tokens a pipeline drops by count are the template's own.
    ``chat``: Qwen's chat markers and a template shaped like Qwen3's; or ``markers`` and
    ``chat_template``, another family's. ``bos``: a token put before every text the tokenizer
    encodes with its special tokens (as Mistral's and Llama's tokenizers do); ``eos_after``: the EOS
    put after it (as CLIP's and T5's tokenizers do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>", *(CHAT_TOKENS if chat else []), *markers,
                        *([bos] if bos else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4 + template.splitlines() * 20, trainer)
    if bos or eos_after:
        from tokenizers import processors

        around = [*([bos] if bos else []), "$A", *(["<|endoftext|>"] if eos_after else [])]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(around), special_tokens=[(token, tokenizer.token_to_id(token)) for token in around
                                                     if token != "$A"])
    chat_template = CHAT_TEMPLATE if chat else chat_template
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>", model_max_length=max_length,
        **({"chat_template": chat_template} if chat_template else {}), **({"bos_token": bos} if bos else {}),
    )
    fast.save_pretrained(out)
    return fast


def amplify(module, factor: float, where=lambda name: True) -> None:
    """Scale the weights of ``module``'s linear layers (those whose name ``where`` accepts) by
    ``factor``. At random init a tiny denoiser is nearly blind to its conditioning: another prompt,
    negative prompt or guidance scale moved the tiny Qwen-Image's image by 1 level of 255, so a
    parity test could not tell a wrong encoding from the right one. Scaled, each such change moves
    the image by tens of levels (tests/unit/test_demo_sensitivity.py holds it)."""
    import torch

    with torch.no_grad():
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear) and where(name):
                layer.weight.mul_(factor)


def build_ar_model(out: Path, shape: dict = AR_SHAPE) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out, AR_SHAPE["vocab_size"])
    # A chat template for /v1/chat/completions; its markers are plain text to this vocabulary.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(
        **({"tie_word_embeddings": False} | shape),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    (out / "README.md").write_text(
        "Tiny random-weight Qwen2 built by triton_omni.demo_models (seed 0). Output is gibberish by design.\n"
    )


def in_memory(model: str) -> bool:
    """Whether ``model`` names a family's real shapes with random weights, built in memory on the
    GPU (the DiTs do not fit a GPU host's disk as files, and need not)."""
    from triton_omni.families import realistic_builders

    return model in realistic_builders()


def build_in_memory(model: str, device, dtype):
    """The pipeline ``model`` names (``in_memory(model)``), built on ``device`` in ``dtype``."""
    from triton_omni.families import realistic_builders

    return realistic_builders()[model](device, dtype)


@contextlib.contextmanager
def built_as(device, dtype):
    """Modules built meanwhile are made on ``device`` in ``dtype`` directly, from seed 0."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            yield
    finally:
        torch.set_default_dtype(default)


def build_all() -> dict[str, str]:
    return {name: resolve_model(DEMO_PREFIX + name) for name in (AR_DEMO, DIFFUSION_DEMO)}


if __name__ == "__main__":
    print(json.dumps(build_all(), indent=2))
