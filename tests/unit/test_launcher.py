"""The stub's library path holds libpython and the wheel's libraries, and
nothing else of the interpreter's LIBDIR (a system cuDNN there slowed SD
10% in Triton: docs/benchmarks.md)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from triton_omni_tools.launcher import find_server, libpython_dir, server_env


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
