"""``TensorSpec``: one tensor of the contract, and its types on every side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np

Kind = Literal["scalar", "list", "array", "blobs"]  # blobs: BYTES elements as raw bytes (encoded images)

# Triton config type -> (KServe wire type, NumPy dtype's name). NumPy is imported where a value is
# converted, not with the tables: a command's --help reads the tables on a bare install.
TYPES: dict[str, tuple[str, str | None]] = {
    "TYPE_STRING": ("BYTES", "object_"),
    "TYPE_BOOL": ("BOOL", "bool_"),
    "TYPE_INT32": ("INT32", "int32"),
    "TYPE_INT64": ("INT64", "int64"),
    "TYPE_UINT8": ("UINT8", "uint8"),
    "TYPE_UINT32": ("UINT32", "uint32"),
    "TYPE_FP16": ("FP16", "float16"),
    "TYPE_FP32": ("FP32", "float32"),
    "TYPE_BF16": ("BF16", None),  # no NumPy type; sent through DLPack
}
# The `embeds_dtype` model parameter -> Triton config type of prompt embeddings.
EMBEDS_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


class InputValueError(ValueError):
    """A value that its input tensor cannot hold; ``name`` is the tensor's."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"{name}: {message}")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton config type, e.g. "TYPE_STRING"
    dims: tuple[int, ...] = (1,)
    kind: Kind = "scalar"  # how the server hands the value to Python
    optional: bool = True
    doc: str = ""  # what a user reads of it (a command's --help): a table's option is documented once

    @property
    def python_type(self) -> type:
        """The Python type of one value (a JSON body's, a command-line flag's)."""
        name = TYPES[self.data_type][1]
        if name in ("bool_", "object_"):
            return bool if name == "bool_" else str
        return float if name is None or name.startswith("float") else int

    @property
    def wire_type(self) -> str:
        """The KServe v2 datatype a client sends (``BYTES``, ``INT32``, ...)."""
        return TYPES[self.data_type][0]

    @property
    def numpy_dtype(self) -> Any:
        import numpy as np

        name = TYPES[self.data_type][1]
        return None if name is None else getattr(np, name)

    def scalar(self, value: Any) -> np.ndarray:
        """``value`` as this one-value tensor's NumPy array (shape ``[1]``), or ``InputValueError``
        naming the tensor when the value is not of its type or outside its range: NumPy would
        raise an ``OverflowError`` naming nothing, or wrap the value around silently."""
        import numpy as np

        dtype = self.numpy_dtype
        if dtype is np.bool_:
            ok = isinstance(value, (bool, np.bool_))
            expected = "true or false"
        elif np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and \
                info.min <= value <= info.max
            expected = f"an integer in [{info.min}, {info.max}] ({self.wire_type})"
        elif np.issubdtype(dtype, np.floating):
            ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
                and bool(np.isfinite(value)) and abs(value) <= np.finfo(dtype).max
            expected = f"a finite number ({self.wire_type})"
        else:
            raise TypeError(f"{self.name} is not a numeric scalar tensor")
        if not ok:
            raise InputValueError(self.name, f"must be {expected}, got {value!r:.60}")
        return np.array([value], dtype=dtype)

    def config_entry(self, is_input: bool) -> dict[str, Any]:
        """The entry of a model config's ``input``/``output`` list."""
        entry = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if is_input and self.optional:
            entry["optional"] = True
        return entry
