"""The Docker build context carries everything the image's `pip install` and
`CMD` need: the project built from only what the Dockerfile copies, installed
without dependencies into a fresh virtualenv, starts its entry point.

No Docker daemon or NGC base image is needed: the COPY lines are read and
replayed into a temporary folder, which is what `docker build` would see."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copied_paths(dockerfile: Path) -> list[tuple[str, str]]:
    """(source, destination) of each COPY line, relative to the build context and WORKDIR."""
    pairs = []
    for line in dockerfile.read_text().splitlines():
        if line.split()[:1] != ["COPY"]:
            continue
        words = shlex.split(line, comments=True)
        if words:
            *sources, dest = [w for w in words[1:] if not w.startswith("--")]
            pairs += [(source, dest) for source in sources]
    return pairs


def replay_copies(dest_root: Path) -> None:
    for source, dest in copied_paths(ROOT / "Dockerfile"):
        src = ROOT / source
        target = dest_root / (dest.rstrip("/") if dest not in ("./", ".") else "") / \
            (src.name if dest.endswith("/") or dest in ("./", ".") else "")
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def test_the_image_build_context_installs_and_starts_the_entry_point(tmp_path):
    context = tmp_path / "context"
    replay_copies(context)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(context)], check=True, capture_output=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [wheel] = wheels.glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    done = subprocess.run([str(venv / "bin" / "omni-triton"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout
    served = subprocess.run([str(venv / "bin" / "omni-triton"), "serve", "--help"], capture_output=True, text=True)
    assert served.returncode == 0 and "--no-restart" in served.stdout and "--openai-port" in served.stdout, \
        served.stderr


def test_the_dockerfile_copies_every_package_root_of_the_project():
    """pyproject's package folders are what `pip install` builds from."""
    import tomllib

    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    copied = {source for source, _ in copied_paths(ROOT / "Dockerfile")}
    assert set(roots) <= copied, set(roots) - copied
