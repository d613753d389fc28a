"""The stub's library path holds libpython and the wheel's libraries, and
nothing else of the interpreter's LIBDIR (a system cuDNN there slowed SD
10% in Triton: docs/benchmarks.md)."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
from triton_omni_tools.launcher import (
    ADMIN_HEADER,
    RESTRICTED_APIS,
    ServerOptions,
    TritonServer,
    _ephemeral_ports,
    access_summary,
    build_backend_dir,
    find_server,
    free_port,
    libpython_dir,
    server_env,
    startup_report,
)


def test_libpython_dir_links_only_libpython():
    folder = libpython_dir()
    libdir = Path(sysconfig.get_config_var("LIBDIR"))
    assert folder != libdir
    entries = list(folder.iterdir())
    assert entries, "no libpython link"
    for entry in entries:
        assert entry.name.startswith("libpython") and ".so" in entry.name
        assert entry.resolve().exists()
        assert entry.resolve().parent == libdir.resolve()


def test_stub_library_path_leaves_out_libdir():
    inherited = set(os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep))
    added = [p for p in server_env(find_server("embedded"))["LD_LIBRARY_PATH"].split(os.pathsep) if p not in inherited]
    assert str(libpython_dir()) in added
    assert sysconfig.get_config_var("LIBDIR") not in added


def test_restricted_by_default_on_loopback_and_said_at_startup(monkeypatch):
    monkeypatch.delenv("TRITON_OMNI_ADMIN_KEY", raising=False)
    options = ServerOptions()
    server = TritonServer(options)
    command = server.command(find_server("embedded"), Path("/backends"))
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in command
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={server.admin_key}"
    assert f"--http-restricted-api={restricted}" in command
    assert f"--grpc-restricted-protocol={restricted}" in command
    assert len(server.admin_key) == 32 and server.admin_key != TritonServer(options).admin_key  # random: closed
    summary = access_summary(options)
    assert "bound to 127.0.0.1 (loopback only" in summary and "closed" in summary
    assert all(api in summary for api in RESTRICTED_APIS)

    monkeypatch.setenv("TRITON_OMNI_ADMIN_KEY", "s3cret")
    assert TritonServer(ServerOptions(bind="0.0.0.0")).admin_key == "s3cret"
    assert "loopback" not in access_summary(ServerOptions(bind="0.0.0.0"))
    assert "placement: diffusion=0,1 ar=tp:0,1" in access_summary(ServerOptions(placement=["diffusion=0,1",
                                                                                          "ar=tp:0,1"]))


def test_each_server_names_its_own_shared_memory():
    """Two servers on one machine with the Python backend's default region
    names crash or hang; the bench starts servers beside the test suite's."""
    first, second = TritonServer(ServerOptions()), TritonServer(ServerOptions())
    prefixes = []
    for server in (first, second):
        command = server.command(find_server("embedded"), Path("/backends"))
        [flag] = [arg for arg in command if arg.startswith("--backend-config=python,shm-region-prefix-name=")]
        prefixes.append(flag.rsplit("=", 1)[1])
    assert prefixes[0] != prefixes[1] and all(p.startswith("triton_omni_") for p in prefixes)
    for server in (first, second):
        shutil.rmtree(server.run_dir)


def test_free_ports_are_distinct_and_outside_what_the_kernel_hands_out():
    """A port chosen for a server must not be one that a port-0 socket opened meanwhile
    (a vLLM engine's, while the server loads its models) can get."""
    import socket

    low, high = _ephemeral_ports()
    ports = [free_port() for _ in range(30)]
    assert len(set(ports)) == len(ports)
    assert all(port < low for port in ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        assert low <= taken.getsockname()[1] <= high
    for port in ports[:3]:  # still free to bind
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_start_that_fails_names_the_model_and_why(tmp_path):
    """A CI run shows only the exception: it names the model that failed and Triton's reason."""
    broken = tmp_path / "repository" / "broken_model"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('backend: "no_such_backend"\nmax_batch_size: 0\n')
    options = ServerOptions(model_repositories=[tmp_path / "repository"], http_port=free_port(),
                            grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match=r"during startup; see .*server\.log\nfailed to load broken_model: "
                                           r"Invalid argument: unable to find backend library for backend "
                                           r"'no_such_backend'"):
        TritonServer(options).start()


def test_a_start_that_times_out_names_the_models_still_loading():
    log = "\n".join([
        'I1129 12:51:55.713584 24636 model_lifecycle.cc:472] "loading: ar:1"',
        'I1129 12:51:55.715972 24636 model_lifecycle.cc:472] "loading: ar_encoder:1"',
        'I1129 12:51:55.716024 24636 model_lifecycle.cc:472] "loading: diffusion:1"',
        'I1129 12:53:18.353672 24636 model_lifecycle.cc:839] "successfully loaded \'ar_encoder\'"',
    ])
    assert startup_report(log) == "still loading: ar, diffusion"
    assert startup_report("") == "no model failed or was still loading"


def test_the_backend_directory_is_built_once_and_never_removed_under_a_running_server():
    """Every start used to remove and rebuild it: a server started beside a running one took the
    running one's stub and model.py links away while its instances were still starting."""
    install = find_server()
    folder = build_backend_dir(install)
    probe = folder / "python" / ".probe"  # stands in for a running server's use of the folder
    probe.touch()
    try:
        assert build_backend_dir(install) == folder and probe.exists()
        assert (folder / "python" / "triton_python_backend_stub").exists()
        assert (folder / "omni_diffusion" / "model.py").resolve().is_file()
    finally:
        probe.unlink()
