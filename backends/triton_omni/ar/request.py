"""Typed AR requests, validated once, where they are built.

Two ways to pass sampling options reach the same dataclass: the
``sampling_parameters`` JSON string (as Triton's vLLM backend accepts) and one
tensor per parameter. A tensor wins over the same key in the JSON. Values are
normalised first (``seed=-1`` means none, ``stop`` string -> list), then range
checked; every failure names the parameter and echoes the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from triton_omni.errors import RequestValidationError
from triton_omni.validation import as_bool, as_float, as_int, as_json_object, as_str, as_str_list, in_range, require


@dataclass(frozen=True)
class ArLimits:
    """Server-side bounds, from model parameters; not settable by clients."""

    max_tokens: int = 1024
    max_prompt_chars: int = 100_000
    max_stop_strings: int = 8


@dataclass
class SamplingOptions:
    """The sampling options both engines implement (a subset of vLLM's)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_values(cls, values: dict[str, Any], limits: ArLimits) -> SamplingOptions:
        """Convert loosely typed values (JSON or tensors), then range check."""
        unknown = sorted(set(values) - cls.field_names())
        if unknown:
            raise RequestValidationError(
                "sampling_parameters", f"unknown key(s) {unknown}; allowed: {sorted(cls.field_names())}", values,
                show_value=False,
            )
        converters = {
            "max_tokens": as_int, "min_tokens": as_int, "top_k": as_int,
            "temperature": as_float, "top_p": as_float, "repetition_penalty": as_float,
            "stop": as_str_list, "ignore_eos": as_bool,
            "seed": lambda name, v: None if v is None else as_int(name, v),
        }
        options = cls(**{key: converters[key](key, value) for key, value in values.items()})
        options.normalise()
        options.verify(limits)
        return options

    def normalise(self) -> None:
        if self.seed is not None and self.seed < 0:
            self.seed = None  # -1 (any negative) means "no seed", as in vLLM
        if self.top_k < 0:
            self.top_k = 0  # -1 means "disabled", as in vLLM

    def verify(self, limits: ArLimits) -> None:
        in_range("max_tokens", self.max_tokens, 1, limits.max_tokens)
        in_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        in_range("temperature", self.temperature, 0.0, 100.0)
        require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        in_range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        in_range("seed", self.seed or 0, 0, 2**63 - 1)
        require(len(self.stop) <= limits.max_stop_strings, "stop",
                f"at most {limits.max_stop_strings} stop strings", self.stop)
        require(all(self.stop), "stop", "stop strings must be non-empty", self.stop)


def _verify_prompt(prompt: Any, limits: ArLimits) -> str:
    prompt = as_str("text_input", prompt)
    require(prompt.strip() != "", "text_input", "must be a non-empty prompt", prompt)
    require(len(prompt) <= limits.max_prompt_chars, "text_input",
            f"prompt is longer than {limits.max_prompt_chars} characters", len(prompt))
    return prompt


@dataclass
class GenerateRequest:
    """One text-generation request for the ``ar`` model."""

    prompt: str
    sampling: SamplingOptions
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_output_tokens: bool = False

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: ArLimits) -> GenerateRequest:
        """Build from decoded tensors (name -> Python value); missing optional
        inputs are simply absent from ``inputs``."""
        if "text_input" not in inputs:
            raise RequestValidationError("text_input", "is required", None, show_value=False)
        prompt = _verify_prompt(inputs["text_input"], limits)
        values = as_json_object("sampling_parameters", inputs.get("sampling_parameters"))
        values.update({k: v for k, v in inputs.items() if k in SamplingOptions.field_names()})
        return cls(
            prompt=prompt,
            sampling=SamplingOptions.from_values(values, limits),
            stream=as_bool("stream", inputs.get("stream", False)),
            exclude_input_in_output=as_bool("exclude_input_in_output", inputs.get("exclude_input_in_output", False)),
            return_num_output_tokens=as_bool("return_num_output_tokens",
                                             inputs.get("return_num_output_tokens", False)),
        )


@dataclass
class EncodeRequest:
    """One prompt to encode into per-token hidden states (``ar_encoder``).

    The empty string encodes to zero tokens (``prompt=None``): it is how the
    text_to_image ensemble says "no negative prompt", since a Triton 2.51
    ensemble cannot skip a step and a batched model cannot take a request
    without inputs. Zero tokens mean "none" to the diffusion stage. A blank
    prompt ("  ") is still an error.
    """

    prompt: str | None

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: ArLimits) -> EncodeRequest:
        if "text_input" not in inputs:
            raise RequestValidationError("text_input", "is required", None, show_value=False)
        if inputs["text_input"] == "":
            return cls(prompt=None)
        return cls(prompt=_verify_prompt(inputs["text_input"], limits))
