"""``TensorSpec``: one tensor of the contract, and its types on every side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Kind = Literal["scalar", "list", "array"]

# Triton config type -> (KServe wire type, NumPy dtype)
TYPES: dict[str, tuple[str, Any]] = {
    "TYPE_STRING": ("BYTES", np.object_),
    "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_INT32": ("INT32", np.int32),
    "TYPE_INT64": ("INT64", np.int64),
    "TYPE_UINT8": ("UINT8", np.uint8),
    "TYPE_UINT32": ("UINT32", np.uint32),
    "TYPE_FP16": ("FP16", np.float16),
    "TYPE_FP32": ("FP32", np.float32),
    "TYPE_BF16": ("BF16", None),  # no NumPy type; sent through DLPack
}
# The `embeds_dtype` model parameter -> Triton config type of prompt embeddings.
EMBEDS_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton config type, e.g. "TYPE_STRING"
    dims: tuple[int, ...] = (1,)
    kind: Kind = "scalar"  # how the server hands the value to Python
    optional: bool = True

    @property
    def wire_type(self) -> str:
        """The KServe v2 datatype a client sends (``BYTES``, ``INT32``, ...)."""
        return TYPES[self.data_type][0]

    @property
    def numpy_dtype(self) -> Any:
        return TYPES[self.data_type][1]

    def config_entry(self, is_input: bool) -> dict[str, Any]:
        """The entry of a model config's ``input``/``output`` list."""
        entry = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if is_input and self.optional:
            entry["optional"] = True
        return entry
