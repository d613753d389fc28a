"""A prompt that holds audio, as the thinker of a Qwen-Omni checkpoint reads it.

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
processor takes a list, because a clip's last frame and token count depend on the clips beside it.
Qwen3-Omni's and Qwen2.5-Omni's differ in how their processors pad the clips, how many tokens a clip
makes, and how their towers take the features (``Qwen3Ears``, ``Qwen25Ears``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from triton_omni.ar.language_model import architecture, saves_weights, weights
from triton_omni.errors import RequestValidationError

SAMPLE_RATE = 16000  # what every Qwen-Omni feature extractor reads


def has_ears(model: Path) -> bool:
    """Whether ``model`` is a checkpoint whose thinker hears through this module: its class one of
    ``EARS_OF``, its audio tower saved (a benchmark's realistic checkpoint may leave the thinker out)."""
    return architecture(model) in EARS_OF and saves_weights(model, "thinker.audio_tower.")


def ears_of(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> ThinkerEars:
    """The ears of ``checkpoint``'s thinker (``has_ears``)."""
    return EARS_OF[architecture(Path(checkpoint))](checkpoint, device, dtype)


def output_lengths(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Tokens of clips of ``frames`` log-mel frames: the tower's three stride-2 convolutions over
    windows of ``2 * n_window`` frames (13 tokens each), then the rest (the model's own formula)."""
    window = n_window * 2
    rest = (frames % window - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // window) * 13


class ThinkerEars:
    """A Qwen-Omni thinker's feature extractor, audio tower and token embeddings (a subclass per family)."""

    tower_class: str  # the audio tower's class in transformers' modeling module of the family
    modeling: str

    def __init__(self, checkpoint: Path, device: torch.device, dtype: torch.dtype):
        import importlib

        from transformers import AutoConfig, WhisperFeatureExtractor

        checkpoint = Path(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint)
        thinker = config.thinker_config
        self.audio_token_id = thinker.audio_token_id
        # the tokens whose places the towers' embeddings fill (audio and images): where a Qwen3-Omni talker
        # reads the thinker's states, and a Qwen2.5-Omni one zeros of the thinker's layer-0 input
        self.perceived_ids = (thinker.audio_token_id, thinker.image_token_id)
        # the thinker's layer whose states the talker reads at the audio's positions (hidden_states' index;
        # None: a Qwen2.5-Omni talker, which reads no states there)
        self.talker_layer: int | None = getattr(getattr(config, "talker_config", None), "accept_hidden_layer", None)
        self.n_window = thinker.audio_config.n_window
        self.device, self.dtype = device, dtype
        if (checkpoint / "preprocessor_config.json").exists():
            self.features = WhisperFeatureExtractor.from_pretrained(checkpoint)
        else:  # a checkpoint saved without its processor: the family's (128 mel bins, 16 kHz)
            self.features = self.default_features(thinker.audio_config.num_mel_bins)
        if self.features.sampling_rate != SAMPLE_RATE:
            raise ValueError(f"{checkpoint}: the feature extractor reads {self.features.sampling_rate} Hz, "
                             f"not {SAMPLE_RATE}")
        found = weights(checkpoint, ("thinker.audio_tower.", "thinker.model.embed_tokens."))
        tower = getattr(importlib.import_module(f"transformers.models.{self.modeling}"), self.tower_class)
        self.tower = tower._from_config(thinker.audio_config, dtype=dtype)
        self.tower.load_state_dict({k.removeprefix("thinker.audio_tower."): v for k, v in found.items()
                                    if k.startswith("thinker.audio_tower.")})
        self.tower.to(device).eval()
        self.embed_tokens = found["thinker.model.embed_tokens.weight"].to(device, dtype)

    @property
    def max_seconds(self) -> float | None:
        """The longest clip the processor hears whole (None: any the request limits allow)."""
        return None

    def default_features(self, mel_bins: int):
        raise NotImplementedError

    def extract(self, clips: list[np.ndarray]):
        """The clips' features as the family's processor extracts them (``input_features``, ``attention_mask``)."""
        raise NotImplementedError

    def token_counts(self, frames: torch.Tensor) -> torch.Tensor:
        """Each clip's tokens, from its log-mel frames."""
        raise NotImplementedError

    def hear(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """The tower's embeddings of the clips' features ``mel`` [mel bins, all clips' frames], one a token."""
        raise NotImplementedError

    def prompt(self, ids: list[int], clips: list[np.ndarray], field: str = "input_audio",
               max_tokens: int | None = None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``ids`` (one audio marker per clip) with each marker repeated as many times as its clip has
        tokens, the prompt's embeddings ``[tokens, hidden]`` (the clips' in the markers' places), and
        each clip's log-mel frames (what a Qwen2.5-Omni thinker's rotary positions read of it).
        A prompt that grows past ``max_tokens`` is refused before the tower runs."""
        markers = [i for i, token in enumerate(ids) if token == self.audio_token_id]
        if len(markers) != len(clips):
            raise RequestValidationError(field, f"the prompt holds {len(markers)} audio markers (the chat "
                                         f"template's audio parts) for {len(clips)} clips", len(clips))
        features = self.extract(clips)
        frames = features["attention_mask"].sum(-1)
        counts = self.token_counts(frames).tolist()
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
            heard = self.hear(mel.to(self.device, self.dtype), frames.to(self.device))
            tokens = torch.tensor(expanded, device=self.device)
            embeds = self.embed_tokens[tokens].clone()
            embeds[tokens == self.audio_token_id] = heard.to(embeds.dtype)
        return expanded, embeds, frames


class Qwen3Ears(ThinkerEars):
    """Qwen3-Omni's: clips padded to the longest of the prompt's, a window's 13 tokens plus the rest's."""

    tower_class, modeling = "Qwen3OmniMoeAudioEncoder", "qwen3_omni_moe.modeling_qwen3_omni_moe"

    def default_features(self, mel_bins: int):
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=SAMPLE_RATE)

    def extract(self, clips: list[np.ndarray]):
        return self.features(clips, sampling_rate=SAMPLE_RATE, padding=True, truncation=False,
                             return_attention_mask=True, return_tensors="pt")

    def token_counts(self, frames: torch.Tensor) -> torch.Tensor:
        return output_lengths(frames, self.n_window)

    def hear(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return self.tower(mel, feature_lens=frames).last_hidden_state


class Qwen25Ears(ThinkerEars):
    """Qwen2.5-Omni's: each clip padded to the extractor's window (its ``n_samples``: 300 s in the
    model's), which cuts a longer one (refused here instead: ``max_seconds``); two stride-2 halvings a clip."""

    tower_class, modeling = "Qwen2_5OmniAudioEncoder", "qwen2_5_omni.modeling_qwen2_5_omni"

    @property
    def max_seconds(self) -> float:
        return self.features.n_samples / SAMPLE_RATE

    def default_features(self, mel_bins: int):
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=SAMPLE_RATE, chunk_length=300)

    def extract(self, clips: list[np.ndarray]):
        return self.features(clips, sampling_rate=SAMPLE_RATE, padding="max_length", return_attention_mask=True,
                             return_tensors="pt")

    def token_counts(self, frames: torch.Tensor) -> torch.Tensor:
        return ((frames - 1) // 2 + 1 - 2) // 2 + 1

    def hear(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return self.tower(mel, feature_lens=frames, aftercnn_lens=(frames - 1) // 2 + 1).last_hidden_state


# the omni classes whose audio tower this module runs
EARS_OF: dict[str, type[ThinkerEars]] = {"Qwen3OmniMoeForConditionalGeneration": Qwen3Ears,
                                          "Qwen2_5OmniForConditionalGeneration": Qwen25Ears}
