"""A prompt that holds audio, as the thinker of a Qwen3-Omni checkpoint reads it.

The ``ar`` stage serves the thinker's causal LM alone (``language_model.py``); what the thinker
does with audio happens before that LM: its processor turns each clip into log-mel features
(Whisper's, 16 kHz) and the prompt's one audio marker per clip into as many markers as the clip has
tokens, its audio tower turns the features into one embedding per token, and those embeddings take
the markers' places among the prompt's token embeddings. For a prompt with audio and no images the
thinker's multimodal rotary positions are the ordinary ones (every section at the token's index), so
the LM, handed the prompt as embeddings, reads it as the whole model does.

``ThinkerEars`` does those steps with the checkpoint's own feature extractor, audio tower and token
embeddings (the tower and the table are loaded here, on the runner's device, beside the engine's
copy of the LM): the clips of one prompt go through the feature extractor in one call, as the
processor takes a list, because a clip's last frame and token count depend on the longest clip
beside it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from triton_omni.ar.language_model import architecture
from triton_omni.errors import RequestValidationError

# the omni classes whose audio tower this module runs (Qwen2.5-Omni's encoder is another)
EARS_OF = {"Qwen3OmniMoeForConditionalGeneration"}
SAMPLE_RATE = 16000  # what every Qwen-Omni feature extractor reads


def has_ears(model: Path) -> bool:
    """Whether ``model`` is a checkpoint whose thinker hears through this module: its class one of
    ``EARS_OF``, its audio tower saved (a benchmark's realistic checkpoint may leave the thinker out)."""
    if architecture(model) not in EARS_OF:
        return False
    from safetensors import safe_open

    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            if any(key.startswith("thinker.audio_tower.") for key in names):
                return True
    return False


def output_lengths(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Tokens of clips of ``frames`` log-mel frames: the tower's three stride-2 convolutions over
    windows of ``2 * n_window`` frames (13 tokens each), then the rest (the model's own formula)."""
    window = n_window * 2
    rest = (frames % window - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // window) * 13


class ThinkerEars:
    def __init__(self, checkpoint: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoConfig, WhisperFeatureExtractor
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

        checkpoint = Path(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint)
        thinker = config.thinker_config
        self.audio_token_id = thinker.audio_token_id
        # the thinker's layer whose states the talker reads at the audio's positions (hidden_states' index)
        self.talker_layer: int | None = getattr(getattr(config, "talker_config", None), "accept_hidden_layer", None)
        self.n_window = thinker.audio_config.n_window
        self.device, self.dtype = device, dtype
        if (checkpoint / "preprocessor_config.json").exists():
            self.features = WhisperFeatureExtractor.from_pretrained(checkpoint)
        else:  # a checkpoint saved without its processor: Qwen3-Omni's (128 mel bins, 16 kHz)
            self.features = WhisperFeatureExtractor(feature_size=thinker.audio_config.num_mel_bins,
                                                    sampling_rate=SAMPLE_RATE)
        if self.features.sampling_rate != SAMPLE_RATE:
            raise ValueError(f"{checkpoint}: the feature extractor reads {self.features.sampling_rate} Hz, "
                             f"not {SAMPLE_RATE}")
        weights = _weights(checkpoint, ("thinker.audio_tower.", "thinker.model.embed_tokens."))
        self.tower = Qwen3OmniMoeAudioEncoder._from_config(thinker.audio_config, dtype=dtype)
        self.tower.load_state_dict({k.removeprefix("thinker.audio_tower."): v for k, v in weights.items()
                                    if k.startswith("thinker.audio_tower.")})
        self.tower.to(device).eval()
        self.embed_tokens = weights["thinker.model.embed_tokens.weight"].to(device, dtype)

    def prompt(self, ids: list[int], clips: list[np.ndarray], field: str = "input_audio",
               max_tokens: int | None = None) -> tuple[list[int], torch.Tensor]:
        """``ids`` (one audio marker per clip) with each marker repeated as many times as its clip has
        tokens, and the prompt's embeddings ``[tokens, hidden]``: the clips' in the markers' places.
        A prompt that grows past ``max_tokens`` is refused before the tower runs."""
        markers = [i for i, token in enumerate(ids) if token == self.audio_token_id]
        if len(markers) != len(clips):
            raise RequestValidationError(field, f"the prompt holds {len(markers)} audio markers (the chat "
                                         f"template's audio parts) for {len(clips)} clips", len(clips))
        features = self.features(clips, sampling_rate=SAMPLE_RATE, padding=True, truncation=False,
                                 return_attention_mask=True, return_tensors="pt")
        frames = features["attention_mask"].sum(-1)
        counts = output_lengths(frames, self.n_window).tolist()
        expanded: list[int] = []
        start = 0
        for marker, count in zip(markers, counts, strict=True):
            expanded += ids[start:marker] + [self.audio_token_id] * count
            start = marker + 1
        expanded += ids[start:]
        if max_tokens is not None and len(expanded) > max_tokens:
            raise RequestValidationError(field, f"the prompt with its audio has {len(expanded)} tokens; this model "
                                         f"allows at most {max_tokens}", f"{len(clips)} clips")
        with torch.inference_mode():
            mel = features["input_features"].permute(0, 2, 1)[features["attention_mask"].bool()].permute(1, 0)
            heard = self.tower(mel.to(self.device, self.dtype), feature_lens=frames.to(self.device)).last_hidden_state
            tokens = torch.tensor(expanded, device=self.device)
            embeds = self.embed_tokens[tokens].clone()
            embeds[tokens == self.audio_token_id] = heard.to(embeds.dtype)
        return expanded, embeds


def _weights(checkpoint: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``prefixes``, read shard by shard."""
    from safetensors import safe_open

    found = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as source:
            names = source.keys()  # a safetensors file is not iterable itself
            found |= {key: source.get_tensor(key) for key in names if key.startswith(prefixes)}
    return found
