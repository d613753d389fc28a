"""The README's examples, run the way a reader runs them: the `tritonclient`
and `openai` snippets as scripts (they must print the stream and exit), and
the CLI's image commands (they must not write into the checkout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from triton_omni_tools.launcher import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_tritonclient_snippet_runs_as_a_script_and_exits(server, tmp_path):
    [snippet] = [block for block in python_blocks() if "tritonclient.grpc as grpcclient" in block]
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace("localhost:8001", server.grpc_url))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the stream printed nothing"


def test_the_openai_snippet_makes_an_image_and_streams_chat(gateway, tmp_path):
    [snippet] = [block for block in python_blocks() if "from openai import OpenAI" in block]
    script = tmp_path / "snippet.py"
    snippet = snippet.replace("http://localhost:9000", gateway).replace("/tmp/fox.png", str(tmp_path / "fox.png"))
    script.write_text(snippet)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the chat stream printed nothing"
    assert (tmp_path / "fox.png").read_bytes().startswith(b"\x89PNG")


def test_the_image_commands_write_outside_the_checkout(server, tmp_path):
    commands = [line for line in README.splitlines() if line.startswith(".venv/bin/omni-triton") and "--out" in line]
    assert commands
    for command in commands:
        out = Path(re.search(r"--out (\S+)", command).group(1))
        assert out.is_absolute() and PROJECT_ROOT not in out.parents, command
    first = commands[0].replace(".venv/bin/omni-triton", str(Path(sys.executable).parent / "omni-triton"))
    target = tmp_path / "fox.png"
    first = re.sub(r"--out \S+", f"--out {target}", first) + f" --url {server.grpc_url}"
    done = subprocess.run(first, shell=True, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert target.stat().st_size > 0
