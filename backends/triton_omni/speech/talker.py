"""Qwen3-Omni's talker: the thinker's reply to codec frames, with continuous batching.

The talker is a MoE causal LM over codec tokens. Its prompt is the thinker's
conversation as the model's own ``generate`` builds it (the user turns and the
assistant's opening, each token's thinker embedding through the talker's
``text_projection``, the voice's codec marker added to the opening); each step
it reads one more token of the reply (then a pad), predicts the frame's first
codebook, and its code predictor (a small LM run afresh every step) predicts
the frame's other codebooks one after another. A frame is whole once its
residual codes are out, so a frame leaves one step after its first code was
drawn; an end-of-speech code or ``max_tokens`` ends the utterance, and, as in
``generate``, the last code drawn at ``max_tokens`` makes no frame.

For text the thinker's part is its token embeddings: the reply reaches the
talker only as those, never as the thinker's hidden states (the model reads
the thinker's middle layer only at the positions of input audio, images and
video: those states come with the request, from the ``ar`` stage's thinker,
``heard_states``). So this stage holds the thinker's embedding table, not
the thinker, and the ``ar`` stage's thinker hands it the token ids. A prompt
with images has multimodal rotary positions (an image's tokens at its rows
and columns, the text after it shifted): the talker numbers its own prompt
from the thinker's (``talker_positions``) as the model's ``get_rope_index``
numbers the talker's ids, and each step after it at its column plus the
prompt's shift.

``TalkerBatcher`` decodes every running utterance with one forward pass of
the talker and one batched run of the code predictor per step, on its own
thread; the utterances that arrived since the last step join after one
prefill of them all (their prompts left-padded to the longest), their KV
caches stacked onto the batch's (``PaddedCache``), and each leaves when it
ends or is cancelled.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from triton_omni import transfers
from triton_omni.ar.batching import ContinuousBatch, sample, sample_on_device, to_device
from triton_omni.ar.sampling import SamplingOptions
from triton_omni.errors import RequestValidationError

logger = logging.getLogger(__name__)

# the model's own talker defaults (Qwen3OmniMoeForConditionalGeneration.generate)
TALKER_DEFAULTS = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "max_tokens": 4096}
# the code predictor samples with top-k 50 and top-p 0.8 where the talker samples, greedily where it does not
_PREDICTOR_SAMPLED = SamplingOptions(temperature=1.0, top_k=50, top_p=0.8)
_PREDICTOR_GREEDY = SamplingOptions(temperature=0.0)
# the longest an utterance may grow, its prompt and its codes (vLLM's max_model_len): its KV cache's columns
TALKER_MAX_LEN = 5120
# what the model parameter `compile` may name: the code predictor's captured frames, the talker's captured
# steps' width-independent regions (``talker_regions.py``; the whole step compiled took minutes a load at real
# shapes, for its dozens of widths and batch sizes)
COMPILE_PARTS = ("predictor", "talker")


@dataclass
class TalkerPrompt:
    """What the talker reads for one reply: its prompt, then one trailing state a step: the
    reply's tokens after the first but its last, then the end-of-text marker, as ``generate``
    reads them (its thinker's embeddings stop at the last token the thinker was fed, which is
    the one before the last it wrote). While the thinker is still writing the reply, ``trailing``
    grows (``extend``: a token is read once the next one is there) until it is whole (``finish``);
    a row whose next state is not there yet waits (``ready``)."""

    embeds: torch.Tensor  # [length, width]
    trailing: list[torch.Tensor]  # [width] each
    whole: bool = True  # the end-of-text marker is in ``trailing``
    held: torch.Tensor | None = None  # the latest token's state, read only if another token follows
    prompt_codes: list[int] = field(default_factory=list)  # none: the repetition penalty reads the codes drawn
    # a prompt with images: its rotary positions [3, length] on the talker's device (``talker_positions``),
    # and the shift of every step's position after it from its column; None: each position its column
    positions: torch.Tensor | None = None
    shift: int = 0

    def extend(self, states: torch.Tensor) -> None:
        states = ([self.held] if self.held is not None else []) + list(states.unbind(0))
        self.trailing.extend(states[:-1])  # appended before ``whole`` is set: the talker's thread reads both
        self.held = states[-1]

    def finish(self, end_state: torch.Tensor) -> None:
        self.trailing.append(end_state)
        self.whole = True

    def ready(self, step: int) -> bool:
        """Whether the talker's step ``step`` (counted from 0 after the prefill) has what it reads."""
        return self.whole or step < len(self.trailing)


class Qwen3Talker:
    """The talker of a Qwen3-Omni checkpoint, with the thinker's embedding table."""

    def __init__(self, talker: torch.nn.Module, thinker_embedding: torch.nn.Embedding, config):
        self.talker = talker
        self.embedding = thinker_embedding
        self.config = config  # the whole model's: its token ids
        codec = config.talker_config
        self.voices: dict[str, int] = {name.lower(): int(code) for name, code in codec.speaker_id.items()}
        self.eos = codec.codec_eos_token_id
        self.stop_ids = [self.eos]  # the end of speech (``TalkerBatcher`` reads it)
        vocab = codec.text_config.vocab_size
        self.device = next(talker.parameters()).device
        # generate's suppress_tokens: the 1024 special codes at the top of the vocabulary, but the end of
        # speech (on the device once: a list as an index is copied there at every step)
        self.suppressed = torch.tensor([code for code in range(vocab - 1024, vocab) if code != self.eos],
                                       device=self.device)
        self.groups = codec.num_code_groups
        self.defaults = TALKER_DEFAULTS  # a request's sampling where it sets none
        self._openings: dict[str, torch.Tensor] = {}  # a voice's codec opening (_opening_codec)
        self.default_voice = "ethan" if "ethan" in self.voices else next(iter(self.voices))  # generate's default

    def _project(self, token_ids: list[int]) -> torch.Tensor:
        return self.talker.text_projection(self.embedding(self._on_device(token_ids)))

    def _codec(self, codes: list[int]) -> torch.Tensor:
        return self.talker.get_input_embeddings()(self._on_device(codes))

    def _on_device(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the talker's device without waiting for it: ``torch.tensor(ids, device=...)``
        copies and then waits for every step and decode queued there, which at 64 utterances held
        each prompt (and each reply's next tokens) for tens of ms, one after another."""
        return to_device(ids, torch.long, self.device)

    @torch.inference_mode()
    def reply_states(self, token_ids: list[list[int]], states: list | None = None) -> list[torch.Tensor]:
        """More of several replies' tokens as the talker reads them, one a step: [tokens, width]
        for each, projected in one pass (at 64 replies a token each, one pass, not 64). ``states``:
        the thinker's, which this talker does not read (its embeddings of the tokens are what it reads)."""
        states = self._project([token for ids in token_ids for token in ids])
        return list(states.split([len(ids) for ids in token_ids]))

    @functools.cached_property
    def end_state(self) -> torch.Tensor:
        """The state the talker reads after a reply's last token (its end-of-text marker)."""
        with torch.inference_mode():
            return self._project([self.config.tts_eos_token_id])[0]

    def _heard_at(self, prompt_ids: list[int]) -> list[int]:
        """The positions of the prompt's audio and image tokens: where the talker reads the thinker's
        hidden states, not its embeddings (the model reads them at video too, which ``ar`` does not
        take: a video marker reads as text there)."""
        thinker = self.config.thinker_config
        return [i for i, token in enumerate(prompt_ids) if token in (thinker.audio_token_id, thinker.image_token_id)]

    def check_ids(self, field: str, ids: list[int]) -> None:
        check_thinker_ids(self.embedding, field, ids)

    def check_request(self, request, max_len: int) -> None:
        """A speech request (``SpeechRequest``) this talker can speak: the thinker's ids, and where the
        prompt comes as the thinker read it, its states at the audio (``check_heard``)."""
        if request.states is not None:
            raise RequestValidationError("thinker_states", "is a Qwen2.5-Omni talker's input; this Qwen3-Omni "
                                         "talker reads the thinker's token embeddings (and heard_states at audio)",
                                         list(request.states.shape))
        self.check_ids("reply_ids", request.reply_ids)
        if request.prompt_ids is not None:
            self.check_heard(request.prompt_ids, request.heard, max_len)

    def check_heard(self, prompt_ids: list[int], heard: torch.Tensor | None, max_len: int) -> None:
        """``prompt_ids`` are the thinker's token ids, at most ``max_len`` of them, and ``heard`` holds
        a state of the thinker's width for each of their audio and image tokens."""
        if len(prompt_ids) > max_len:
            raise RequestValidationError("prompt_ids", f"holds {len(prompt_ids)} tokens, more than this model's "
                                         f"talker_max_len {max_len}", len(prompt_ids))
        self.check_ids("prompt_ids", prompt_ids)
        positions = len(self._heard_at(prompt_ids))
        rows = 0 if heard is None else heard.shape[0]
        if rows != positions:
            raise RequestValidationError("heard_states", f"holds {rows} states for the {positions} audio and image "
                                         "tokens of prompt_ids (ar's return_heard_states gives both)", rows)
        width = self.config.thinker_config.text_config.hidden_size
        if heard is not None and heard.shape[1] != width:
            raise RequestValidationError("heard_states", f"must be {width} wide (the thinker's hidden size)",
                                         list(heard.shape))

    @torch.inference_mode()
    def prompt(self, prompt_ids: list[int], reply_ids: list[int], voice: str, whole: bool = True,
               heard: torch.Tensor | None = None, states: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> TalkerPrompt:
        """The talker's prompt for a reply, as ``generate`` builds it for one conversation: its
        user turns (from each ``<|im_start|>user`` up to the next turn) and the assistant turn.
        ``whole``: ``reply_ids`` is the whole reply; else its first tokens (at least one), the
        rest to come (``TalkerPrompt.extend``). ``heard``: the thinker's states at the prompt's audio
        and image tokens (``check_heard``), which the talker reads there through its
        ``hidden_projection``. ``states``: a Qwen2.5-Omni talker's input (``check_request`` refuses it
        here). ``positions``: the thinker's rotary positions of a prompt with images [3, prompt]."""
        cfg = self.config
        user = [i for i, role in enumerate(_roles(prompt_ids, cfg.im_start_token_id)) if role == cfg.user_token_id]
        start = max(i for i in range(len(prompt_ids) - 1)
                    if prompt_ids[i] == cfg.im_start_token_id and prompt_ids[i + 1] == cfg.assistant_token_id)
        # the user turns' and the assistant turn's tokens projected in one pass (at 64 utterances
        # arriving together, each prompt's launches are a share of the last one's first audio)
        user_states, assistant = self._project([prompt_ids[i] for i in user] + (prompt_ids + reply_ids)[start:]
                                               ).split([len(user), len(prompt_ids) + len(reply_ids) - start])
        pad, bos, eos = self._specials
        opening_text = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        opening_codec = self._opening_codec(voice)
        if heard is not None and len(heard):
            row = {position: r for r, position in enumerate(self._heard_at(prompt_ids))}
            at = [(k, row[i]) for k, i in enumerate(user) if i in row]
            if at:
                columns, rows = (list(values) for values in zip(*at, strict=True))
                states = heard[rows].to(self.device, user_states.dtype)
                user_states = user_states.clone()  # a view of the pass's output: written here
                user_states[columns] = self.talker.hidden_projection(states).to(user_states.dtype)
        embeds = torch.cat([user_states, opening_text + opening_codec])
        # the reply's states in memory of their own: a view would hold the user turns' for the utterance's life
        reply = assistant[4:].clone()
        prompt = TalkerPrompt(embeds, [*reply[:-1].unbind(0), eos]) if whole else TalkerPrompt(embeds, [], whole=False)
        if not whole and len(reply):
            prompt.extend(reply)
        if positions is not None:  # the user turns' positions, then the assistant turn's opening as text
            numbered, prompt.shift = talker_positions(positions, user, len(embeds) - len(user))
            prompt.positions = transfers.to_device(numbered, self.device)  # (not waiting for the queued steps)
        return prompt

    @property
    def pad(self) -> torch.Tensor:
        return self._specials[0]

    @functools.cached_property
    def _specials(self) -> torch.Tensor:
        """The text side's pad, bos and eos states, the same in every prompt: made once."""
        cfg = self.config
        with torch.inference_mode():
            return self._project([cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id])

    def _opening_codec(self, voice: str) -> torch.Tensor:
        """The codec side of the assistant turn's opening for ``voice``: the same in every prompt,
        made at its first use (kept on this talker, not in a process-wide cache)."""
        if voice not in self._openings:
            codec = self.config.talker_config
            with torch.inference_mode():
                codes = self._codec([codec.codec_nothink_id, codec.codec_think_bos_id, codec.codec_think_eos_id,
                                     self.voices[voice], codec.codec_pad_id, codec.codec_bos_id])
                self._openings[voice] = torch.cat([codes.new_zeros(3, codes.shape[1]), codes])
        return self._openings[voice]


def talker_positions(positions: torch.Tensor, taken: list[int] | range, after: int) -> tuple[torch.Tensor, int]:
    """The rotary positions [3, len(taken) + after] of a talker prompt made of the thinker prompt's
    tokens ``taken`` (in order) and then ``after`` text tokens, as the model's ``get_rope_index``
    numbers the talker's own ids: each run of consecutive tokens keeps the shape the thinker's
    positions give it (an image's rows and columns), starting one past the largest position before
    it; and the shift of the positions after the prompt from their columns. ``positions``: the
    thinker's [3, prompt] (``ar``'s ``prompt_positions``). Each run starts at a text token (a turn's
    ``<|im_start|>``), whose three positions are one."""
    taken = torch.as_tensor(list(taken), dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long)
    pieces, start = [], 0
    breaks = ((taken[1:] - taken[:-1]) != 1).nonzero().flatten() + 1
    for run in torch.tensor_split(taken, breaks.tolist()):
        if len(run):
            pieces.append(positions[:, run] - positions[0, run[0]] + start)
            start = int(pieces[-1].max()) + 1
    pieces.append(torch.arange(start, start + after).expand(3, -1))
    return torch.cat(pieces, dim=1), start - len(taken)


def check_thinker_ids(embedding: torch.nn.Embedding, field: str, ids: list[int]) -> None:
    """``ids`` are the thinker's token ids (rows of its ``embedding`` table): one past it would fail the
    device (and every request after it), not the request."""
    vocab = embedding.num_embeddings
    if not all(0 <= token < vocab for token in ids):
        raise RequestValidationError(field, f"holds ids outside the thinker's vocabulary [0, {vocab})",
                                     [t for t in ids if not 0 <= t < vocab][:4])


def _roles(ids: list[int], im_start: int) -> list[int | None]:
    """Each position's role token: the token after the last ``<|im_start|>`` at or before it (one pass:
    a prompt of a few minutes of audio is tens of thousands of tokens)."""
    roles, role = [], None
    for i, token in enumerate(ids):
        if token == im_start:
            role = ids[i + 1] if i + 1 < len(ids) else None
        roles.append(role)
    return roles


@dataclass(eq=False)  # one utterance is itself only (the runner keys what it follows by it)
class Utterance:
    """One reply being spoken: its prompt, its options, where its frames go.

    ``emit`` gets each frame (a list of ``groups`` codes), then None at the end,
    or the exception that ended it. Owned by the batcher's thread once submitted;
    ``cancel`` is the only method other threads call."""

    prompt: TalkerPrompt
    options: SamplingOptions
    emit: Callable[[list[int] | BaseException | None], None]
    output_ids: list[int] = field(default_factory=list)  # first codes drawn (penalised, as generate's ids)
    prompt_ids: list[int] = field(default_factory=list)  # none: the penalty reads the codes drawn only
    generator: torch.Generator | None = None
    stop_ids: list[int] = field(default_factory=list)  # the end of speech, set by the batcher
    done: bool = False
    reason: str | None = None  # "stop" (end of speech), "length", "abort"
    joined_at: float | None = None  # time.monotonic() once prefilled into the step batch
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done, self.reason = True, reason
            self.emit(None)

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.done, self.reason = True, "error"
            self.emit(exc)


class TalkerBatcher(ContinuousBatch):
    """Speaks the running utterances together, one step at a time, on its own thread."""

    name = "omni-talker"

    def __init__(self, talker: Qwen3Talker, max_num_seqs: int, cuda_graphs: bool = True,
                 max_len: int = TALKER_MAX_LEN, slot_cache: bool | None = None, compile: tuple[str, ...] = ()):
        """``cuda_graphs``: on a GPU, the talker's step replayed as CUDA graphs (``talker_graphs.py``; a
        MoE talker's in bfloat16 only), and the code predictor's frame too (``predictor_graphs.py``);
        eager otherwise. ``slot_cache``: the talker's KV cache in ``max_len`` columns of fixed buffers
        (``SlotCache``), as the graphs need it; by default where they run, and on a CPU where
        asked (the tests, to hold those steps to the ``PaddedCache`` ones). ``compile``: the parts
        (``COMPILE_PARTS``) whose static passes run under torch.compile (the code predictor's captured
        frames; the steps over the slot cache of a Qwen3-Omni talker, their layers' width-independent
        regions); the other paths never do."""
        super().__init__(talker.device, max_num_seqs)
        self.talker = talker
        self.model = talker.talker
        # a talker whose code is the whole frame (Qwen2.5-Omni's, ``Qwen25Talker``): no code predictor,
        # each code spoken as it is drawn
        self.whole_codes = talker.groups == 1
        self._pad = None if self.whole_codes else talker.pad
        self.graphs = None
        on_gpu = cuda_graphs and self.device.type == "cuda"
        if on_gpu and not self.whole_codes:
            from triton_omni.speech.predictor_graphs import PredictorGraphs

            sampled = _PREDICTOR_SAMPLED
            self.graphs = PredictorGraphs(self.model.code_predictor, talker.groups, max_num_seqs,
                                          [sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p],
                                          compile="predictor" in compile)
        # a MoE's grouped GEMM runs in bfloat16 on the device alone (another dtype's copies offsets to the
        # host); a dense talker (Qwen2.5-Omni's) is captured in any dtype
        capture = on_gpu and (self.whole_codes or self.model.dtype == torch.bfloat16)
        if on_gpu and not capture:
            logger.info("the talker's step runs eagerly: in %s its MoE cannot be captured", self.model.dtype)
        self.talker_steps = None
        if slot_cache if slot_cache is not None else capture:
            from triton_omni.speech.talker_graphs import TalkerSteps

            self.talker_steps = TalkerSteps(self.model, max_num_seqs, max_len, capture=capture,
                                            compile="talker" in compile and not self.whole_codes)
            self._cache = self.talker_steps.cache
        if "predictor" in compile and self.graphs is None:
            logger.info("compile: predictor ignored: only the code predictor's CUDA graphs (a GPU's) are compiled")
        if "talker" in compile and (self.talker_steps is None or self.talker_steps.regions is None):
            logger.info("compile: talker ignored: only a Qwen3-Omni talker's steps over its slot cache are compiled")
        self._hidden: torch.Tensor | None = None  # [rows, 1, width]: each row's last-layer state of its last position
        self.steps = 0  # forward passes run (the tests read it)
        self.waits = 0  # rows left out of a step (or of a wait for one), waiting for their reply's next token
        self._start()

    def submit(self, utterance: Utterance) -> None:
        utterance.stop_ids = list(self.talker.stop_ids)
        super().submit(utterance)

    def _reset(self) -> None:
        super()._reset()
        self._hidden = None

    def _keep(self, rows: list[int]) -> None:
        self._hidden = self._hidden.index_select(0, to_device(rows, torch.long, self.device)) if rows else None

    def _join(self, utterance: Utterance) -> None:
        prompt = utterance.prompt
        positions = prompt.positions  # on the talker's device (None: each position its column)
        prefilled = self.talker_steps.prefill(prompt.embeds, positions) if self.talker_steps is not None else None
        if prefilled is not None:  # straight into its slot (a CUDA graph's replay on a GPU)
            last, normed = prefilled
        else:
            cache = DynamicCache()
            embeds = prompt.embeds[None]
            at = {} if positions is None else {"position_ids": positions[:, None]}
            out = self.model.model(inputs_embeds=embeds, past_key_values=cache, use_cache=True,
                                   output_hidden_states=True, **at)
            self._cache.add(cache, embeds.shape[1])
            last, normed = out.hidden_states[-1][:, -1:], out.last_hidden_state[:, -1]
        self.rows.append(utterance)
        self._shift_slots([utterance])
        # its last position's state: the code predictor's first input
        self._hidden = last if self._hidden is None else torch.cat([self._hidden, last])
        self._accept([utterance], self._draw([utterance], self.model.codec_head(normed)))
        utterance.joined_at = time.monotonic()  # after _accept's draw, which waits for the prefill

    def _join_all(self, utterances: list[Utterance]) -> None:
        """The utterances that arrived since the last step prefilled in one pass, their prompts
        left-padded to the longest (masked, each at its own positions): 64 requests arriving at
        once wait for one prefill, not for 64 in a row."""
        if len(utterances) == 1:
            self._join(utterances[0])
            return
        lengths = [len(u.prompt.embeds) for u in utterances]
        longest = max(lengths)
        embeds = torch.stack([torch.nn.functional.pad(u.prompt.embeds, (0, 0, longest - length, 0))
                              for u, length in zip(utterances, lengths, strict=True)])
        mask = (torch.arange(longest, device=self.device)[None, :]
                >= torch.tensor([longest - length for length in lengths], device=self.device)[:, None]).long()
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[None].expand(3, -1, -1)
        if any(u.prompt.positions is not None for u in utterances):  # a prompt with images: its own positions
            positions = positions.clone()
            for row, (utterance, length) in enumerate(zip(utterances, lengths, strict=True)):
                if utterance.prompt.positions is not None:
                    positions[:, row, longest - length:] = utterance.prompt.positions
        cache = DynamicCache()
        out = self.model.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=True, output_hidden_states=True)
        self._cache.add_rows(cache, mask)
        self.rows.extend(utterances)
        self._shift_slots(utterances)
        last = out.hidden_states[-1][:, -1:]  # each prompt ends at the last column
        self._hidden = last if self._hidden is None else torch.cat([self._hidden, last])
        self._accept(utterances, self._draw(utterances, self.model.codec_head(out.last_hidden_state[:, -1])))
        joined = time.monotonic()
        for utterance in utterances:
            utterance.joined_at = joined

    def _shift_slots(self, joined: list[Utterance]) -> None:
        """The rows just joined (the last ``joined``): each one's position shift in its slot, which the
        ``SlotCache``'s steps add to their columns (the ``PaddedCache``'s steps read the prompts')."""
        shifts = [u.prompt.shift for u in joined]
        if self.talker_steps is not None and any(shifts):
            self.talker_steps.cache.shift(len(self.rows) - len(joined), shifts)

    def _draw(self, rows: list[Utterance], logits: torch.Tensor) -> list[int]:
        """Each row's next first code: the one wait for the GPU in a step."""
        logits = logits.float()
        logits[:, self.talker.suppressed] = float("-inf")
        return sample(logits, rows, self.generator)

    def _accept(self, rows: list[Utterance], codes: list[int]) -> None:
        for utterance, code in zip(rows, codes, strict=True):
            utterance.output_ids.append(code)
            if code in utterance.stop_ids:
                utterance.finish("stop")
                continue
            if self.whole_codes:  # the code is its frame
                utterance.emit([code])
            if len(utterance.output_ids) >= utterance.options.max_tokens:
                # Qwen3-Omni's generate drops the last code drawn: its frame is never predicted
                utterance.finish("length")

    def _step(self) -> None:
        rows = self.rows
        # a row's steps since its prefill: one code drawn at the prefill, one at each step since
        steps = [len(u.output_ids) - 1 for u in rows]
        ready = [u.prompt.ready(s) for u, s in zip(rows, steps, strict=True)]
        if not any(ready):  # every row waits for its thinker's next token (``wake``), or for a row to join
            self.waits += len(rows)
            with self._wake:  # checked again under the lock ``wake`` takes: its notify is not lost
                can_join = self._pending and len(rows) < self.max_num_seqs
                if not can_join and not any(u.prompt.ready(len(u.output_ids) - 1) for u in rows):
                    self._wake.wait(timeout=0.05)
            return
        moving = None if all(ready) else to_device([i for i, r in enumerate(ready) if r], torch.long, self.device)
        if moving is not None:
            self.waits += len(rows) - len(moving)
            rows = [u for u, r in zip(rows, ready, strict=True) if r]
            steps = [s for s, r in zip(steps, ready, strict=True) if r]
        residual = None
        if self.whole_codes:
            inputs = self._whole_code_inputs(rows, steps)
        else:
            inputs, residual = self._frame_inputs(rows, steps, moving)
        if moving is None:
            self._hidden, logits = self._talker_forward(inputs, rows, steps)
        else:  # the waiting rows' passes are made and thrown away: their caches do not keep them
            everyone = self._hidden.new_zeros(len(ready), *inputs.shape[1:]).index_copy_(0, moving, inputs)
            hidden, logits = self._talker_forward(everyone, self.rows, [len(u.output_ids) - 1 for u in self.rows],
                                                  ready)
            self._hidden = self._hidden.index_copy(0, moving, hidden.index_select(0, moving))
            logits = logits.index_select(0, moving)
        self.steps += 1
        codes = self._draw(rows, logits)  # the GPU's work queued so far is done after it: the frames too
        if residual is not None:
            for utterance, frame in zip(rows, residual.tolist(), strict=True):
                utterance.emit([utterance.output_ids[-1], *frame])
        self._accept(rows, codes)

    def _frame_inputs(self, rows: list[Utterance], steps: list[int], moving: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-Omni's step: each row's frame finished by the code predictor (its residual codes
        [rows, groups - 1], spoken once the step's next codes are drawn: reading them here would wait
        for the predictor, and the GPU would wait for the host to queue the talker), then the
        talker's inputs, its codes' embeddings and its reply's next state [rows, 1, width]."""
        first = to_device([[u.output_ids[-1]] for u in rows], torch.long, self.device)
        first_embeds = self.model.get_input_embeddings()(first)  # [rows, 1, width]
        hidden = self._hidden if moving is None else self._hidden.index_select(0, moving)
        residual, residual_embeds = self._predict_residuals(hidden, first_embeds, rows)
        trailing = [u.prompt.trailing[s] if s < len(u.prompt.trailing) else self._pad
                    for u, s in zip(rows, steps, strict=True)]
        return first_embeds + residual_embeds + torch.stack(trailing)[:, None], residual

    def _whole_code_inputs(self, rows: list[Utterance], steps: list[int]) -> torch.Tensor:
        """Qwen2.5-Omni's step (its codes spoken as drawn): the talker's inputs from each row's last
        code and its reply's next state (``Qwen25Talker.step_inputs``)."""
        codes = to_device([u.output_ids[-1] for u in rows], torch.long, self.device)
        states = torch.stack([u.prompt.step_state(step) for u, step in zip(rows, steps, strict=True)])
        return self.talker.step_inputs(codes, states)

    def wake(self) -> None:
        """A waiting row's reply has grown (``TalkerPrompt.extend``): step again."""
        with self._wake:
            self._wake.notify()

    def _talker_forward(self, inputs: torch.Tensor, rows: list[Utterance], steps: list[int],
                        kept: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker's pass over ``inputs`` [rows, 1, hidden]: each row's last layer's state and
        first codebook's logits; over the ``SlotCache`` (replayed as a CUDA graph on a GPU) or the
        ``PaddedCache``. ``kept``: the rows whose new position the cache keeps (all by default)."""
        if self.talker_steps is not None:
            return self.talker_steps(inputs, kept)
        positions = torch.tensor([len(u.prompt.embeds) + u.prompt.shift + s for u, s in zip(rows, steps, strict=True)],
                                 device=self.device)[None, :, None].expand(3, -1, -1)
        mask = self._cache.extend()
        if kept is not None:  # a row's position not kept: hidden from its later steps
            mask[:, -1] = torch.tensor(kept, device=self.device)
        out = self.model.model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                               past_key_values=self._cache.cache, use_cache=True, output_hidden_states=True)
        return out.hidden_states[-1][:, -1:], self.model.codec_head(out.last_hidden_state[:, -1])

    def _predict_residuals(self, hidden: torch.Tensor, first_embeds: torch.Tensor, rows: list[Utterance]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The code predictor for every row at once: codebooks 1.. of each frame, and the
        sum of their embeddings (what the talker reads next, with the first code's)."""
        if self.graphs is not None:
            return self.graphs(hidden, first_embeds, [u.options.temperature == 0 for u in rows],
                               [u.generator or self.generator for u in rows])
        predictor = self.model.code_predictor
        draws = [_Draw(_PREDICTOR_SAMPLED if u.options.temperature > 0 else _PREDICTOR_GREEDY, u.generator)
                 for u in rows]
        cache = DynamicCache()
        inputs = torch.cat([hidden, first_embeds], dim=1)
        codes, total = [], torch.zeros_like(first_embeds)
        for group in range(self.talker.groups - 1):
            out = predictor.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True)
            logits = predictor.lm_head[group](out.last_hidden_state[:, -1])
            code = sample_on_device(logits, draws, self.generator)  # read once the frame is whole
            codes.append(code)
            inputs = predictor.get_input_embeddings()[group](code)[:, None]
            total = total + inputs
        return torch.stack(codes, dim=1), total


@dataclass
class _Draw:
    """A code predictor's draw for one row: its options and its utterance's generator."""

    options: SamplingOptions
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
