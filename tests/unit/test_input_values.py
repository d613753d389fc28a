"""A value its input tensor cannot hold is refused by name before anything is sent: by the
protocol's ``TensorSpec.scalar``, which the client builds every scalar tensor with."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import InputValueError
from triton_omni_client.client import batched_inputs, check_scalars, omni_inputs
from triton_omni_protocol import scalar_inputs

SPECS = scalar_inputs()


@pytest.mark.parametrize(("name", "value"), [
    ("seed", 2**70), ("seed", -(2**63) - 1), ("seed", "5"), ("seed", 1.5), ("seed", True),
    ("num_inference_steps", 2**31), ("height", "64"), ("max_tokens", 5.0),
    ("guidance_scale", float("nan")), ("guidance_scale", 1e39), ("guidance_scale", "4"),
    ("stream", 1),
])
def test_a_value_outside_its_tensor_s_type_is_refused_by_name(name, value):
    with pytest.raises(InputValueError, match=f"^{name}: must be") as error:
        SPECS[name].scalar(value)
    assert error.value.name == name and isinstance(error.value, ValueError)
    for build in (lambda: batched_inputs(grpcclient, **{name: value}), lambda: omni_inputs(grpcclient, {name: value}),
                  lambda: check_scalars({name: value})):
        with pytest.raises(InputValueError):
            build()


@pytest.mark.parametrize(("name", "value"), [
    ("seed", 2**63 - 1), ("seed", -1), ("seed", np.int64(3)), ("num_inference_steps", 2**31 - 1),
    ("guidance_scale", 4), ("guidance_scale", 7.5), ("stream", True), ("stream", np.bool_(False)),
])
def test_values_in_range_keep_their_type(name, value):
    array = SPECS[name].scalar(value)
    assert array.dtype == SPECS[name].numpy_dtype and array.tolist() == [value]
