"""The sampling contract of the ``ar`` model: every key, written once.

The keys are vLLM's ``SamplingParams`` fields that a client may set (what
Triton's vLLM backend accepts in ``sampling_parameters``), each with the
converter that reads it from JSON, request parameters or tensors (numbers and
booleans may come in their string forms) and vLLM's default, i.e. the value
that changes nothing. ``SamplingOptions`` is built from this table;
the engines decide which keys they honour:

* vLLM honours all of them and validates them itself (``SamplingParams``);
* the transformers engine honours ``TRANSFORMERS_KEYS`` and refuses any other
  key set to a value other than its default, naming the key and the engine.

Keys that vLLM's ``SamplingParams`` had or that Triton's vLLM backend reads
but this server cannot honour are refused with the reason (``REFUSED_KEYS``).
No key is ever silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from triton_omni.errors import RequestValidationError
from triton_omni.validation import (
    INT64_MAX,
    as_bool,
    as_float,
    as_int,
    as_int_list,
    as_json_value,
    as_optional_int,
    as_str_list,
    in_range,
    require,
)


@dataclass(frozen=True)
class ArLimits:
    """Server-side bounds, from model parameters; not settable by clients."""

    max_tokens: int = 1024
    max_prompt_chars: int = 100_000
    max_stop_strings: int = 8
    max_n: int = 4  # completions per request (vLLM's `n`)
    max_logprobs: int = 20  # top log probabilities per token (vLLM's own default limit)
    # Encode mode: most prompt tokens. Set it to the diffusion model's `max_embeds_tokens`,
    # so a long prompt is refused here, naming `text_input`, not downstream naming `prompt_embeds`.
    max_prompt_tokens: int | None = None


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    require(isinstance(value, dict), name, "must be an object mapping token ids to biases", value)
    return {as_int(name, token): as_float(name, bias) for token, bias in value.items()}


@dataclass
class SamplingOptions:
    """Typed sampling options (vLLM's names and defaults); ``metadata["read"]``
    converts a loosely typed value."""

    n: int = field(default=1, metadata={"read": as_int})
    max_tokens: int = field(default=16, metadata={"read": as_int})
    min_tokens: int = field(default=0, metadata={"read": as_int})
    temperature: float = field(default=1.0, metadata={"read": as_float})
    top_p: float = field(default=1.0, metadata={"read": as_float})
    top_k: int = field(default=0, metadata={"read": as_int})
    min_p: float = field(default=0.0, metadata={"read": as_float})
    seed: int | None = field(default=None, metadata={"read": as_optional_int})
    presence_penalty: float = field(default=0.0, metadata={"read": as_float})
    frequency_penalty: float = field(default=0.0, metadata={"read": as_float})
    repetition_penalty: float = field(default=1.0, metadata={"read": as_float})
    stop: list[str] = field(default_factory=list, metadata={"read": as_str_list})
    stop_token_ids: list[int] = field(default_factory=list, metadata={"read": as_int_list})
    bad_words: list[str] = field(default_factory=list, metadata={"read": as_str_list})
    include_stop_str_in_output: bool = field(default=False, metadata={"read": as_bool})
    ignore_eos: bool = field(default=False, metadata={"read": as_bool})
    logprobs: int | None = field(default=None, metadata={"read": as_optional_int})
    skip_special_tokens: bool = field(default=True, metadata={"read": as_bool})
    spaces_between_special_tokens: bool = field(default=True, metadata={"read": as_bool})
    logit_bias: dict[int, float] = field(default_factory=dict, metadata={"read": _logit_bias})
    allowed_token_ids: list[int] = field(default_factory=list, metadata={"read": as_int_list})
    structured_outputs: dict[str, Any] | None = field(default=None, metadata={"read": as_json_value})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_values(cls, values: dict[str, Any], limits: ArLimits, source: str = "sampling_parameters"
                    ) -> SamplingOptions:
        """Convert loosely typed values (JSON, request parameters, tensors), then range check.

        ``source`` names where unknown keys came from, for the message."""
        for key in values:
            _check_known(key, source)
        options = cls(**{key: _READERS[key](key, value) for key, value in values.items()})
        options.normalise()
        options.verify(limits)
        return options

    def normalise(self) -> None:
        if self.seed is not None and self.seed < 0:
            self.seed = None  # -1 (any negative) means "no seed", as in vLLM
        if self.top_k == -1:
            self.top_k = 0  # -1 means "disabled", as in vLLM

    def verify(self, limits: ArLimits) -> None:
        """This server's bounds and the ranges both engines share (vLLM's).

        The vLLM engine then validates everything again with vLLM's own
        ``SamplingParams`` (and the keys only it knows)."""
        in_range("max_tokens", self.max_tokens, 1, limits.max_tokens)
        in_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        in_range("n", self.n, 1, limits.max_n)
        in_range("temperature", self.temperature, 0.0, 100.0)
        require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k >= 0, "top_k", "must be -1 or 0 (disabled), or at least 1", self.top_k)
        in_range("min_p", self.min_p, 0.0, 1.0)
        in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        require(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]",
                self.repetition_penalty)
        in_range("seed", self.seed or 0, 0, INT64_MAX)
        if self.logprobs is not None:
            in_range("logprobs", self.logprobs, 0, limits.max_logprobs)
        require(len(self.stop) <= limits.max_stop_strings, "stop",
                f"at most {limits.max_stop_strings} stop strings", self.stop)
        require(all(self.stop), "stop", "stop strings must be non-empty", self.stop)
        require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0",
                self.stop_token_ids)

    def changed_keys(self) -> list[str]:
        """Keys whose value differs from the default (the ones that have an effect)."""
        default = SamplingOptions()
        return [key for key in self.names() if getattr(self, key) != getattr(default, key)]


_READERS: dict[str, Callable[[str, Any], Any]] = {f.name: f.metadata["read"] for f in fields(SamplingOptions)}

# Keys Triton's vLLM backend or older vLLM releases accept that this server
# cannot honour, with the reason the client gets.
REFUSED_KEYS = {
    "best_of": "is not supported: vLLM V1 removed it; ask for `n` completions instead",
    "use_beam_search": "is not supported: vLLM V1 removed beam search from sampling parameters",
    "prompt_logprobs": "is not supported: no output of this model carries prompt log probabilities",
    "guided_decoding": "was renamed by vLLM; use `structured_outputs`",
}

# What the transformers engine honours (beside keys left at their defaults).
TRANSFORMERS_KEYS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop",
    "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
})


def _check_known(key: str, source: str) -> None:
    if key in REFUSED_KEYS:
        raise RequestValidationError(key, REFUSED_KEYS[key], None, show_value=False)
    if key not in SamplingOptions.names():
        close = [k for k in SamplingOptions.names() if _similar(k, key)]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RequestValidationError(
            key, f"is not a sampling parameter (from {source}){hint} Allowed: {', '.join(SamplingOptions.names())}",
            None, show_value=False,
        )


def _similar(known: str, given: str) -> bool:
    """A cheap typo check: one is a prefix of the other, or they differ by one edit."""
    if known.startswith(given) or given.startswith(known):
        return True
    if abs(len(known) - len(given)) > 1:
        return False
    from difflib import SequenceMatcher

    return SequenceMatcher(None, known, given).ratio() >= 0.85
