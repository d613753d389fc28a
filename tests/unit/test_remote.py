"""``RemoteStage`` against a real gRPC channel to a port nobody listens on: bounded retries, then a
typed UNAVAILABLE naming the stage and its address; a remote stage's own errors keep their status;
a config it cannot use, and a stage `serve --remote` cannot forward, are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from triton_omni.errors import RemoteError
from triton_omni.remote import RemoteConfig, RemoteStage
from triton_omni_tools.cli import main
from triton_omni_tools.launcher import free_port
from triton_omni_tools.remote import RemoteSpecError, parse
from tritonclient.utils import InferenceServerException


def test_an_unreachable_server_is_retried_then_unavailable_naming_the_stage():
    address = f"127.0.0.1:{free_port()}"
    stage = RemoteStage(RemoteConfig(address, "ar_encoder", timeout_s=5, retries=2, backoff_s=0.01), "ar_encoder")
    try:
        with pytest.raises(RemoteError) as error:
            stage.infer({"text_input": np.array([[b"a red fox"]], dtype=np.object_)}, ["prompt_embeds"])
    finally:
        stage.close()
    assert error.value.status == "UNAVAILABLE"
    assert f"remote stage ar_encoder (its server at {address}) unreachable after 3 attempts" in str(error.value)
    assert stage.counters == {"calls": 1, "retries": 2, "unreachable": 1, "cancelled": 0}


@pytest.mark.parametrize(("message", "code", "status"), [
    ("[INVALID_ARG] invalid `height`: must be a multiple of 16", "StatusCode.INTERNAL", "INVALID_ARG"),
    ("in ensemble 'text_to_image', [UNAVAILABLE] over budget", "StatusCode.INTERNAL", "UNAVAILABLE"),
    ("unexpected shape for input 'seed'", "StatusCode.INVALID_ARGUMENT", "INVALID_ARG"),
    ("too many", "StatusCode.RESOURCE_EXHAUSTED", "INTERNAL"),  # not one of the protocol's names
])
def test_a_remote_stages_own_error_keeps_its_status(message, code, status):
    error = RemoteStage._remote_error(InferenceServerException(msg=message, status=code))
    assert error.status == status and "[" + status + "]" not in str(error)


def test_a_config_it_cannot_use_is_refused_by_name():
    with pytest.raises(ValueError, match="remote_url"):
        RemoteConfig(" ", "ar_encoder")
    with pytest.raises(ValueError, match="remote_retries"):
        RemoteConfig("host:1", "ar_encoder", retries=-1)


def test_serve_refuses_a_stage_that_streams_by_name(capsys):
    assert main(["serve", "--remote", "ar=127.0.0.1:1"]) == 2
    assert "--remote 'ar=127.0.0.1:1': model 'ar' streams its answers" in capsys.readouterr().err
    assert main(["serve", "--remote", "ar_encoder"]) == 2
    assert "MODEL=HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["stages:9001", "127.0.0.1:9001", "dns:///triton-omni-stages:8001",
                                     "ipv4:127.0.0.1:9001,127.0.0.1:9002", "ipv6:[::1]:9001"])
def test_the_addresses_grpc_takes_are_taken(address):
    assert parse(f"diffusion={address}") == ("diffusion", address)


@pytest.mark.parametrize("address", ["stages", "stages:port", "stages:99999", "ipv4:localhost:9001",
                                     "ipv4:127.0.0.1", "ipv4:"])
def test_an_address_grpc_would_refuse_is_refused_at_start(address):
    """gRPC checks a target only when the first call opens the channel (and answers UNKNOWN then)."""
    with pytest.raises(RemoteSpecError, match="is not a gRPC address"):
        parse(f"diffusion={address}")
