"""A stand-in for ``triton_python_backend_utils``, for unit tests of the adapters.

Only what the adapters touch: tensors (from NumPy or DLPack), responses,
errors with their codes, the FINAL flag, metrics (recording each update). ``install()`` puts it in
``sys.modules`` so ``import triton_python_backend_utils`` finds it.
"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import torch

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name = name
        self._array = np.asarray(array)

    @classmethod
    def from_dlpack(cls, name: str, capsule) -> Tensor:
        return cls(name, torch.from_dlpack(capsule).numpy())

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL, NOT_FOUND, UNSUPPORTED, ALREADY_EXISTS, UNKNOWN = range(8)

    def __init__(self, message: str, code: int = 3):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)  # a new list, sharing the tensors (the stub's shares ownership so)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


# Every metric update, each of which is one IPC round trip in a real stub:
# (family name, labels, method, value, the updating thread's name).
metric_updates: list[tuple] = []


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict, buckets=None) -> Metric:
        return Metric(self, labels)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict):
        self.family, self.labels, self._value = family, dict(labels), 0.0
        self._record("made", None)

    def increment(self, value: float) -> None:
        self._value += value
        self._record("increment", value)

    def set(self, value: float) -> None:
        self._value = value
        self._record("set", value)

    def observe(self, value: float) -> None:
        self._record("observe", value)

    def value(self) -> float:
        return self._value

    def _record(self, method: str, value) -> None:
        metric_updates.append((self.family.name, self.labels, method, value, threading.current_thread().name))


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def install() -> types.ModuleType:
    module = sys.modules[__name__]
    sys.modules["triton_python_backend_utils"] = module
    return module
