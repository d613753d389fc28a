"""The one mapping between Triton tensors and Python values.

The stages' inputs and outputs are declared once, as ``TensorSpec`` tables
in ``triton_omni_protocol``; here those tables fill the model config in
``auto_complete_config`` and decode request tensors into plain Python
values for the request dataclasses; results leave as tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack
from triton_omni_protocol import TensorSpec

from triton_omni.errors import RequestValidationError


def complete_config(config, inputs: list[TensorSpec], outputs: list[TensorSpec]):
    """Add the declared inputs/outputs the user's config.pbtxt does not list."""
    model_config = config.as_dict()
    have_inputs = {i["name"] for i in model_config.get("input", [])}
    have_outputs = {o["name"] for o in model_config.get("output", [])}
    for spec in inputs:
        if spec.name not in have_inputs:
            config.add_input(spec.config_entry(is_input=True))
    for spec in outputs:
        if spec.name not in have_outputs:
            config.add_output(spec.config_entry(is_input=False))
    return config


def read_inputs(request, specs: list[TensorSpec]) -> dict[str, Any]:
    """Decode the inputs a request carries; absent optional inputs are left out.

    One walk over the request's tensors: ``pb_utils.get_input_tensor_by_name``
    lists them all again for every name it is asked, and ``ar`` has over twenty
    optional inputs."""
    given = {tensor.name(): tensor for tensor in request.inputs()}
    return {spec.name: _decode(spec, given[spec.name]) for spec in specs if spec.name in given}


def _decode(spec: TensorSpec, tensor) -> Any:
    if spec.kind == "array":
        return torch.from_dlpack(tensor.to_dlpack())
    flat = tensor.as_numpy().reshape(-1)
    if spec.kind == "blobs":
        return [item if isinstance(item, bytes) else bytes(item) for item in flat]
    is_text = spec.data_type == "TYPE_STRING"
    items = [_utf8(spec.name, item) for item in flat] if is_text else flat.tolist()
    if spec.kind == "list":
        return items
    if len(items) != 1:
        raise RequestValidationError(spec.name, f"must hold exactly one element, got {len(items)}",
                                     None, show_value=False)
    return items[0]


def _utf8(name: str, item: Any) -> str:
    if isinstance(item, str):
        return item
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError:
        raise RequestValidationError(name, "must be UTF-8 text", bytes(item)[:40]) from None


def string_tensor(name: str, value: str | list[str], batched: bool = False):
    values = [value] if isinstance(value, str) else value
    array = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    return pb_utils.Tensor(name, array[None] if batched else array)


def python_tensor(name: str, value: int | float | list, dtype: type, batched: bool = False):
    """A Python number or list, as a NumPy array: what a streamed response's
    token count is, built for every response the stub sends: for a small value
    NumPy is a few times cheaper than torch and DLPack, and the stub's GIL bounds
    ``ar`` under load. NumPy outputs
    need NumPy 1 in a 2.51 stub, as its text outputs always have (docs/operations.md)."""
    array = np.array(value if isinstance(value, list) else [value], dtype=dtype)
    return pb_utils.Tensor(name, array[None] if batched else array)


def numeric_tensor(name: str, value: torch.Tensor | int | float, dtype: torch.dtype | None = None,
                   batched: bool = False):
    """Tensors leave through DLPack: zero-copy for CUDA tensors, and
    immune to the NumPy 2 layout trap of Triton 2.51's stub."""
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=dtype)
    if dtype is not None:
        tensor = tensor.to(dtype)
    if batched:
        tensor = tensor.unsqueeze(0)
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


TORCH_TYPES = {"TYPE_BOOL": torch.bool, "TYPE_UINT8": torch.uint8, "TYPE_INT32": torch.int32,
               "TYPE_INT64": torch.int64, "TYPE_UINT32": torch.uint32, "TYPE_FP16": torch.float16,
               "TYPE_FP32": torch.float32, "TYPE_BF16": torch.bfloat16}
# Every type above but bfloat16, which NumPy lacks.
NUMPY_TYPES = {"TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
               "TYPE_UINT32": np.uint32, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32}


class Outputs:
    """The output tensors of one model, named and typed by its table in the
    protocol: a name outside the table is a ``KeyError``, and every value
    leaves in its declared type."""

    def __init__(self, specs: list[TensorSpec]):
        self.specs = {spec.name: spec for spec in specs}

    def tensor(self, name: str, value: Any, batched: bool = False):
        spec = self.specs[name]
        if spec.data_type == "TYPE_STRING":
            return string_tensor(name, value, batched)
        if not isinstance(value, torch.Tensor) and spec.data_type in NUMPY_TYPES:
            return python_tensor(name, value, NUMPY_TYPES[spec.data_type], batched)
        dtype = TORCH_TYPES[spec.data_type]
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value if isinstance(value, list) else [value], dtype=dtype)
        return numeric_tensor(name, value, dtype, batched)
