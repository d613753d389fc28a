"""Qwen2.5-Omni's talker prompt: the thinker's states as the model's own ``generate`` hands them on.

Unlike Qwen3-Omni's talker, which reads the thinker's token embeddings, Qwen2.5-Omni's reads at every
position the thinker's layer-0 input (the token's embedding, or zeros at audio, image and video
tokens) plus its last layer's state, summed in the thinker's dtype: of the prompt, then of each reply
token but the last (no pass ever runs on it). The ``ar`` stage's thinker hands those sums on
(``ThinkerStates``); this stage holds the thinker's embedding table for the rest (a voice's marker,
the end-of-text and pad markers), never the thinker. As ``generate`` (transformers 5.19) builds it
for one conversation (held to it, codes and waveform, by
``benchmarks/records/research/qwen25_speech_recipe.py``):

- the prefill: the prompt's states, the voice's ``bos_token`` embedding, the first reply token's
  state, through ``thinker_to_talker_proj``. Not the codec pad and bos embeddings the talker's own
  forward adds at those last two positions: ``generate`` passes the talker no attention mask, and the
  forward adds them only with one, so the model's speech never has them;
- then a step each: the last code's embedding plus the next of the reply tokens' states, then the
  end-of-text marker's embedding, then the pad marker's for every step after, projected together;
- its repetition penalty reads the prefill's codec ids (a mask id a prompt token, then pad, bos)
  beside the codes drawn; the codec bos is never drawn; the codec pad or eos ends the speech and is
  not spoken.

While the thinker is still writing, the talker starts once the reply's first token has its state
(the thinker's second token is out), and each state after joins its prompt as it comes (``extend``);
a step whose state is not there yet waits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from triton_omni.errors import RequestValidationError
from triton_omni.speech.talker import check_thinker_ids

# the model's own talker defaults (Qwen2_5OmniForConditionalGeneration.generate)
TALKER_DEFAULTS_25 = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 4096}


@dataclass
class Qwen25Prompt:
    """One reply's talker input: the prefill (projected) and the states its steps add to their codes;
    while the thinker is still writing, ``trailing`` grows (``extend``) until the reply is whole
    (``finish``: its end-of-text marker)."""

    embeds: torch.Tensor  # [prompt + 2, talker width], projected
    trailing: list[torch.Tensor]  # [thinker width] each: reply tokens 1 .. n-2, then the end-of-text marker
    pad: torch.Tensor  # [thinker width]: what every step after reads
    prompt_codes: list[int]  # the prefill's codec ids, which the repetition penalty reads
    whole: bool = True  # the end-of-text marker is in ``trailing``
    positions = None  # each position its column, a prompt with images' too (``Qwen25Talker.prompt``)
    shift = 0

    def extend(self, states: torch.Tensor) -> None:
        self.trailing.extend(states.unbind(0))

    def finish(self, end_state: torch.Tensor) -> None:
        self.trailing.append(end_state)  # before ``whole``: the talker's thread reads both
        self.whole = True

    def ready(self, step: int) -> bool:
        """Whether the talker's step ``step`` (counted from 0 after the prefill) has what it reads."""
        return self.whole or step < len(self.trailing)

    def step_state(self, step: int) -> torch.Tensor:
        """What the talker's step ``step`` (from 0, after the prefill) adds to its last code's embedding."""
        return self.trailing[step] if step < len(self.trailing) else self.pad


class Qwen25Talker:
    """The talker of a Qwen2.5-Omni checkpoint, with the thinker's embedding table and its voices."""

    def __init__(self, talker: torch.nn.Module, thinker_embedding: torch.nn.Embedding, speakers: dict, config):
        """``speakers``: the checkpoint's ``spk_dict.pt`` (a voice's name to its ``bos_token``, ``cond``
        and ``ref_mel``); ``config``: the whole model's."""
        self.talker = talker
        self.embedding = thinker_embedding
        self.speakers = {name.lower(): params for name, params in speakers.items()}
        codec = config.talker_config
        self.codec_pad, self.codec_bos = codec.tts_codec_pad_token_id, codec.tts_codec_start_token_id
        self.codec_mask = codec.tts_codec_mask_token_id
        self.stop_ids = [codec.tts_codec_pad_token_id, codec.tts_codec_end_token_id]
        self.device = next(talker.parameters()).device
        # generate's suppressed start code, and the codes token2wav has no embedding for but the stop codes
        # (its DiT reads 8193 codes of the talker's 8448 in the model's: a trained talker never draws the
        # rest, a random-weight one does, and the decoder would index past its table)
        readable = config.token2wav_config.dit_config.num_embeds
        unreadable = [code for code in range(readable, codec.vocab_size) if code not in self.stop_ids]
        self.suppressed = torch.tensor([codec.tts_codec_start_token_id, *unreadable], device=self.device)
        self.groups = 1  # a code a frame: no code predictor (``TalkerBatcher`` reads it)
        self.defaults = TALKER_DEFAULTS_25
        self.text_eos, self.text_pad = codec.tts_text_end_token_id, codec.tts_text_pad_token_id
        self.width = config.thinker_config.text_config.hidden_size
        self.default_voice = "chelsie" if "chelsie" in self.speakers else self.voices[0]  # generate's default

    @property
    def voices(self) -> list[str]:
        return sorted(self.speakers)

    def voice_conditioning(self, voice: str) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``token2wav`` reads of a voice: its ``cond`` [1, C] and ``ref_mel`` [1, T, mel bins], float32."""
        return self.speakers[voice]["cond"].float(), self.speakers[voice]["ref_mel"].float()

    def _embed(self, token_id: int) -> torch.Tensor:
        return self.embedding(torch.tensor([token_id], device=self.embedding.weight.device))[0]

    @functools.cached_property
    def end_state(self) -> torch.Tensor:
        """What the step after a reply's last state reads: the end-of-text marker's embedding."""
        with torch.inference_mode():
            return self._embed(self.text_eos)

    def check_ids(self, field: str, ids: list[int]) -> None:
        check_thinker_ids(self.embedding, field, ids)

    def check_request(self, request, max_len: int) -> None:
        """A speech request (``SpeechRequest``) this talker can speak: the prompt as the thinker read it
        and the thinker's states (``check``); no states of another model's kind."""
        if request.heard is not None:
            raise RequestValidationError("heard_states", "is a Qwen3-Omni talker's input; a Qwen2.5-Omni talker "
                                         "reads thinker_states", list(request.heard.shape))
        if request.states is None or request.prompt_ids is None:
            raise RequestValidationError("thinker_states", "is required: a Qwen2.5-Omni talker reads the thinker's "
                                         "states at every prompt and reply token (ar's return_thinker_states "
                                         "gives them, with prompt_token_ids for prompt_ids); omni sends both", None)
        if len(request.prompt_ids) + 2 > max_len:
            raise RequestValidationError("prompt_ids", f"holds {len(request.prompt_ids)} tokens, more than this "
                                         f"model's talker_max_len {max_len} leaves room for", len(request.prompt_ids))
        self.check_ids("prompt_ids", request.prompt_ids)
        self.check_ids("reply_ids", request.reply_ids)
        self.check(request.prompt_ids, request.reply_ids, request.states, request.voice)

    def check(self, prompt_ids: list[int], reply_ids: list[int], states: torch.Tensor, voice: str) -> None:
        """``states`` hold one of the thinker's width for each prompt token and each reply token but
        the last, and ``voice`` is one of the checkpoint's; each refusal names its field."""
        if voice not in self.speakers:
            raise RequestValidationError("voice", f"unknown voice; this model speaks {self.voices}", voice)
        if not reply_ids:
            raise RequestValidationError("reply_ids", "holds no token: the talker starts from the reply's first", [])
        expected = [len(prompt_ids) + len(reply_ids) - 1, self.width]
        if list(states.shape) != expected:
            raise RequestValidationError("thinker_states", f"must be {expected}: one state of the thinker's width "
                                         "for each prompt token and each reply token but the last",
                                         list(states.shape))

    @torch.inference_mode()
    def prompt(self, prompt_ids: list[int], reply_ids: list[int], voice: str, whole: bool = True,
               heard: torch.Tensor | None = None, states: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> Qwen25Prompt:
        """The talker's input for a reply (``check``'s arguments): ``states`` the thinker's layer-0
        input plus last layer at each position. ``whole``: ``reply_ids`` is the whole reply; else its
        first tokens (at least two: the talker's prefill reads the first one's state), the rest of
        the states to come (``Qwen25Prompt.extend``). ``heard``: a Qwen3-Omni talker's, never given.
        ``positions``: the thinker's rotary positions of a prompt with images, which this talker does
        not read: ``generate`` (transformers 5.19) runs it at each token's index, images' too (its
        forward numbers the images only given an attention mask, which ``generate`` drops when it
        masks nothing)."""
        self.check(prompt_ids, reply_ids, states, voice)
        if not whole and len(reply_ids) < 2:
            raise RequestValidationError("reply_ids", "a reply still being written is spoken from its second token "
                                         "on (the first one's state comes with it)", reply_ids)
        count = len(prompt_ids)
        states = self.on_device(states)
        opening = torch.cat([states[:count], self._embed(self.speakers[voice]["bos_token"])[None],
                             states[count:count + 1]])
        trailing = [*states[count + 1:].unbind(0)] + ([self.end_state] if whole else [])
        return Qwen25Prompt(embeds=self.talker.thinker_to_talker_proj(opening), trailing=trailing,
                            pad=self._embed(self.text_pad),
                            prompt_codes=[self.codec_mask] * count + [self.codec_pad, self.codec_bos], whole=whole)

    def on_device(self, states: torch.Tensor) -> torch.Tensor:
        """The thinker's states (float32 from ``ar``) in the embedding table's device and dtype."""
        weight = self.embedding.weight
        return torch.as_tensor(states).to(weight.device, weight.dtype)

    def reply_states(self, token_ids: list[list[int]], states: list[torch.Tensor]) -> list[torch.Tensor]:
        """More of several replies' states as the talker's steps read them (``token_ids``: their new
        tokens, which a Qwen2.5-Omni talker reads only as these states)."""
        return [self.on_device(s) for s in states]

    @torch.inference_mode()
    def step_inputs(self, codes: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """A step's talker inputs: ``codes`` [rows] (each row's last code) and ``states`` [rows, thinker
        width] (each row's ``step_state``) to [rows, 1, talker width]."""
        return self.talker.thinker_to_talker_proj(self.talker.model.embed_tokens(codes) + states)[:, None]
