"""Restricted by default: inference, health and metadata are open; the
model-repository, shared-memory, trace and logging APIs answer only with the
admin header; the server listens on loopback unless told otherwise."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from triton_omni_tools.launcher import ADMIN_HEADER
from tritonclient.utils import InferenceServerException


def http(server, path: str, headers: dict[str, str] | None = None, body: bytes | None = b"") -> int:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_admin_apis_need_the_key_and_inference_does_not(server):
    assert http(server, "/v2/repository/index") >= 400
    assert http(server, "/v2/repository/index", {ADMIN_HEADER: server.admin_key}) == 200
    assert http(server, "/v2/logging", body=None) >= 400
    assert http(server, "/v2/health/ready", body=None) == 200
    assert http(server, "/v2/models/ar_encoder", body=None) == 200  # metadata stays open
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        # Triton reads a restricted gRPC protocol's header with this prefix
        grpc_header = f"triton-grpc-protocol-{ADMIN_HEADER}"
        assert client.get_model_repository_index(headers={grpc_header: server.admin_key}) is not None
        assert client.is_server_ready()


def test_the_stubs_shared_memory_carries_this_servers_own_prefix(server):
    """So that a second server on the machine (a bench beside the tests) cannot collide with it."""
    assert any(entry.name.startswith(server.shm_prefix) for entry in Path("/dev/shm").iterdir())
