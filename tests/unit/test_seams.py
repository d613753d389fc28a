"""Unit tests of the small seams: the status tag round trip, the validation
guards, the scheduler-to-stage side channel."""

from __future__ import annotations

import asyncio
import math

import pytest
from triton_omni.channel import Cancellations, ProgressListener, ProgressSender, new_id, valid_id
from triton_omni.errors import RequestValidationError
from triton_omni.validation import as_bool, as_float, as_int, as_int_list, as_json_object, as_str_list, in_range
from triton_omni_protocol import STATUS_NAMES, parse_status, tag_status

# -- status tags -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", STATUS_NAMES)
def test_status_round_trip(status):
    message = tag_status(status, "invalid `top_p`: must be in (0, 1], got 2")
    assert parse_status(message) == (status, "invalid `top_p`: must be in (0, 1], got 2")
    # Triton prefixes some messages (an ensemble step, a BLS call); the tag is still found.
    assert parse_status(f"in ensemble 'text_to_image', {message}") == (
        status, "in ensemble 'text_to_image', invalid `top_p`: must be in (0, 1], got 2")


def test_untagged_and_unknown_statuses():
    assert parse_status("unexpected shape for input 'x'") == (None, "unexpected shape for input 'x'")
    assert parse_status("[NOT_A_STATUS] x") == (None, "[NOT_A_STATUS] x")
    with pytest.raises(ValueError):
        tag_status("TEAPOT", "x")


# -- validation guards -------------------------------------------------------------------------


@pytest.mark.parametrize(("guard", "value", "expected"), [
    (as_int, 3, 3), (as_int, 3.0, 3), (as_int, "32", 32), (as_int, " -4 ", -4), (as_int, "1e3", 1000),
    (as_float, 0.5, 0.5), (as_float, "0.1", 0.1), (as_float, 2, 2.0),
    (as_bool, True, True), (as_bool, "false", False), (as_bool, "TRUE", True), (as_bool, 0, False),
    (as_str_list, "x", ["x"]), (as_str_list, ["a", "b"], ["a", "b"]),
    (as_int_list, [1, "2"], [1, 2]),
])
def test_guards_accept_values_and_their_string_forms(guard, value, expected):
    assert guard("p", value) == expected


@pytest.mark.parametrize(("guard", "value"), [
    (as_int, True), (as_int, 2.5), (as_int, "two"), (as_int, 2**63), (as_int, None),
    (as_float, "nan"), (as_float, math.inf), (as_float, "0.1.2"), (as_float, False), (as_float, 10**400),
    (as_bool, "yes"), (as_bool, 2), (as_bool, None),
    (as_str_list, [1]), (as_str_list, b"x"),
    (as_int_list, 3), (as_int_list, ["a"]),
])
def test_guards_reject_naming_the_parameter(guard, value):
    with pytest.raises(RequestValidationError) as info:
        guard("the_param", value)
    assert info.value.parameter == "the_param"
    assert str(info.value).startswith("invalid `the_param`")


def test_json_objects_and_ranges():
    assert as_json_object("p", None) == {}
    assert as_json_object("p", '{"a": 1}') == {"a": 1}
    for raw, reason in (("[1]", "JSON object"), ("{", "valid JSON"), ("[" * 50_000 + "]" * 50_000, "nested")):
        with pytest.raises(RequestValidationError, match=reason):
            as_json_object("p", raw)
    in_range("p", 5, 0, 10)
    with pytest.raises(RequestValidationError, match=r"must be in \[0, 10\], got 11"):
        in_range("p", 11, 0, 10)


# -- the side channel -----------------------------------------------------------------------------


def test_ids_are_random_hex_and_nothing_else_is_a_valid_id():
    key = new_id()
    assert valid_id(key) == key
    for bad in ("../../etc/passwd", key.upper(), key[:-1], 42, None):
        assert valid_id(bad) is None


def test_cancellations_are_shared_through_the_directory(tmp_path):
    scheduler, stage = Cancellations(tmp_path), Cancellations(tmp_path)
    key = new_id()
    assert not stage.is_cancelled(key) and not stage.is_cancelled(None)
    scheduler.cancel(key)
    assert stage.is_cancelled(key)
    scheduler.forget(key)
    assert not stage.is_cancelled(key)


def test_progress_reaches_the_subscriber_of_its_key_only(tmp_path):
    async def scenario():
        listener = await ProgressListener(tmp_path).start()
        sender = ProgressSender(tmp_path)
        mine, other = new_id(), new_id()
        got: list[tuple[int, int]] = []
        listener.subscribe(mine, lambda step, total: got.append((step, total)))
        for step in (1, 2):
            sender.send(listener.name, mine, step, 2)
        sender.send(listener.name, other, 1, 2)  # nobody listens for it
        sender.send(None, mine, 9, 9)  # a request without a listener: nothing is sent
        listener._route(b"garbage")  # a malformed datagram is logged, not raised
        for _ in range(50):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        listener.close()
        sender.close()
        sender.send(listener.name, mine, 3, 3)  # listener gone: advisory, no error
        return got

    assert asyncio.run(scenario()) == [(1, 2), (2, 2)]


# -- prompt embeddings ------------------------------------------------------------------------


def test_prompt_embeds_checks_metadata_before_values():
    import torch
    from triton_omni.diffusion.request import DiffusionLimits, check_embeds

    limits = DiffusionLimits(hidden_size=8, max_embeds_tokens=4, max_embeds_bytes=4 * 8 * 4)
    good = torch.ones(3, 8)
    assert check_embeds("prompt_embeds", good, limits).shape == (3, 8)
    assert check_embeds("prompt_embeds", good[None], limits).shape == (3, 8)  # a batch dimension of 1
    bad = {
        "dtype": torch.ones(3, 8, dtype=torch.float64),
        "2-D": torch.ones(2, 3, 8),
        "hidden size": torch.ones(3, 7),
        "token count": torch.ones(5, 8),
        "finite": torch.tensor([[float("nan")] * 8]),
    }
    for reason, embeds in bad.items():
        with pytest.raises(RequestValidationError, match=reason) as info:
            check_embeds("prompt_embeds", embeds, limits)
        assert info.value.parameter == "prompt_embeds"
    with pytest.raises(RequestValidationError, match="token count"):
        check_embeds("prompt_embeds", torch.ones(0, 8), limits)  # zero tokens: only a negative side may say "none"
    with pytest.raises(RequestValidationError, match="larger than"):
        check_embeds("prompt_embeds", torch.ones(4, 8), DiffusionLimits(hidden_size=8, max_embeds_bytes=64))
    with pytest.raises(RequestValidationError, match="must be a tensor"):
        check_embeds("prompt_embeds", [[1.0] * 8], limits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_all_finite_is_exact_where_a_sum_is_not(dtype):
    """One sum decides the common case; where it overflows (finite values, large), the element-wise
    check answers; a NaN or an infinity anywhere, alone or beside its opposite, is never finite."""
    import torch
    from triton_omni.diffusion.request import all_finite

    dtype = getattr(torch, dtype)
    largest = torch.finfo(dtype).max
    assert all_finite(torch.randn(64, 32).to(dtype))
    assert all_finite(torch.full((4, 8), largest, dtype=dtype))  # finite, but their sum is not
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.randn(64, 32).to(dtype)
        values[17, 3] = bad
        assert not all_finite(values), bad
    opposite = torch.zeros(4, 8, dtype=dtype)
    opposite[0, 0], opposite[1, 1] = float("inf"), -float("inf")  # their sum is a NaN: still refused
    assert not all_finite(opposite)
