"""A value its input tensor cannot hold is refused by name before anything is sent: by the
protocol's ``TensorSpec.scalar``, which the client builds every scalar tensor with."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import InputValueError, OmniClient
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


BF16 = "bfloat16"  # ml_dtypes' NumPy type, the one tritonclient reads and writes BF16 tensors as


@pytest.mark.parametrize(("given", "declared", "sent"), [
    ("float32", None, "FP32"), ("float16", None, "FP16"), (BF16, None, "BF16"),  # as given, undeclared
    ("float32", "BF16", "BF16"), ("float64", "FP32", "FP32"), (BF16, "FP32", "FP32"), ("float32", "FP16", "FP16"),
    (BF16, "BF16", "BF16"),
])
def test_embeddings_go_as_their_input_declares_them(given, declared, sent):
    import ml_dtypes

    values = np.array([[0.1, -2.5, 3.0e4]], dtype=np.float32)
    embeds = values.astype(ml_dtypes.bfloat16 if given == BF16 else given)
    (tensor,) = batched_inputs(grpcclient, None, {"prompt_embeds": declared} if declared else None,
                               prompt_embeds=embeds)
    assert tensor.datatype() == sent and tensor.shape() == [1, 1, 3]
    width = {"FP32": 4, "FP16": 2, "BF16": 2}[sent]
    assert len(tensor._get_content()) == 3 * width


def test_bf16_embeddings_sent_as_bf16_lose_nothing_of_their_values():
    import ml_dtypes

    embeds = (np.random.default_rng(0).standard_normal((4, 8)) * 3).astype(ml_dtypes.bfloat16)
    (tensor,) = batched_inputs(grpcclient, None, {"prompt_embeds": "BF16"}, prompt_embeds=embeds)
    received = np.frombuffer(tensor._get_content(), dtype=ml_dtypes.bfloat16).reshape(4, 8)
    assert np.array_equal(received.astype(np.float32), embeds.astype(np.float32))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(("method", "args"), [
    ("generate_text", ("a fox",)), ("generate", ("a fox",)), ("generate_image", ("a fox",)),
    ("generate_video", ("a fox",)), ("edit_image", ("a fox", [b"png"])), ("stream_image", ("a fox",)),
])
def test_an_option_no_input_takes_is_refused_by_name_before_sending(method, args, protocol):
    """A misspelt option (``steps`` for ``num_inference_steps``) is a ``TypeError`` naming it and the
    options the call takes, as Python's own for an unexpected keyword argument; nothing listens at
    this address, so a call that tried to send would fail otherwise."""
    client = OmniClient("127.0.0.1:9", protocol=protocol)
    with pytest.raises(TypeError, match=rf"^OmniClient\.{method}\(\) got unexpected option\(s\) 'steps'; it takes "
                                        r".*\bseed\b") as error:
        result = getattr(client, method)(*args, steps=2)
        if method in ("generate", "generate_text"):  # generators: their checks run at the first event
            next(result)
    assert "num_inference_steps" in str(error.value) or method == "generate_text"


@pytest.mark.parametrize(("build", "name"), [
    (lambda: omni_inputs(grpcclient, {"negative_prompt": 5}), "negative_prompt"),
    (lambda: omni_inputs(grpcclient, {"modalities": ["text", 3]}), "modalities"),
    (lambda: batched_inputs(grpcclient, negative_prompt=5), "negative_prompt"),
    (lambda: batched_inputs(grpcclient, prompt_embeds=[[0.1, 0.2]]), "prompt_embeds"),
])
def test_a_value_of_the_wrong_kind_for_a_text_or_array_input_is_refused_by_name(build, name):
    with pytest.raises(InputValueError, match=f"^{name}: takes ") as error:
        build()
    assert error.value.name == name
