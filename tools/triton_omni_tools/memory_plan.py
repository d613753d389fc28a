"""The whole GPU memory plan, checked by the launcher before the server starts.

Each model's ``gpu_memory_utilization`` parameter is its share of a GPU
(``triton_omni.gpu_memory``). Where its instances run follows Triton's
``instance_group``: ``KIND_GPU`` (and ``KIND_AUTO``) instances on their
``gpus`` (all GPUs when unset), ``count`` of them on each; ``KIND_MODEL`` (how the vLLM models are
placed, as in Triton's vLLM backend) on the GPUs of its ``gpus`` model parameter (an engine over
several, tensor parallel, takes its share of each), else GPU 0. Instances that share one vLLM
engine core (``instances_per_engine``) take one share between them. The plan fits when, on every
GPU, the shares of the models loaded there add up to at most
``MAX_TOTAL_SHARE``: the rest is for the CUDA contexts of the stubs and the
engine processes, which no share counts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from triton_omni.gpu_memory import parse_gpus

from triton_omni_tools.repository import load_config

MAX_TOTAL_SHARE = 0.95


class MemoryPlanError(RuntimeError):
    pass


@dataclass(frozen=True)
class Share:
    model: str
    gpu: int
    instances: int  # that hold a share: engines, where instances share one
    share: float  # of one instance

    @property
    def total(self) -> float:
        return self.instances * self.share


def configured_share(config) -> float | None:
    """A model config's ``gpu_memory_utilization`` parameter, if set."""
    raw = config.parameters["gpu_memory_utilization"].string_value.strip() \
        if "gpu_memory_utilization" in config.parameters else ""
    return float(raw) if raw else None


def model_gpus(config) -> list[int]:
    """The GPUs of a ``KIND_MODEL`` instance: its ``gpus`` parameter, else GPU 0."""
    raw = config.parameters["gpus"].string_value.strip() if "gpus" in config.parameters else ""
    return parse_gpus(raw) if raw else [0]


def model_shares(config_path: Path, num_gpus: int) -> list[Share]:
    """The shares one model's config asks for, per GPU."""
    config = load_config(config_path)
    share = configured_share(config)
    if share is None:
        return []
    name = config.name or config_path.parent.name
    groups = config.instance_group or [None]
    per_gpu: dict[int, int] = defaultdict(int)
    for group in groups:
        kind = "KIND_MODEL" if group is None else _kind_name(group.kind)
        count = 1 if group is None or group.count == 0 else group.count
        if kind in ("KIND_GPU", "KIND_AUTO"):  # Triton makes KIND_AUTO a KIND_GPU group where GPUs exist
            for gpu in (list(group.gpus) or range(num_gpus)):
                per_gpu[gpu] += count
        elif kind == "KIND_MODEL":
            for gpu in model_gpus(config):
                per_gpu[gpu] += 1
    per_engine = int(config.parameters["instances_per_engine"].string_value.strip() or 1) \
        if "instances_per_engine" in config.parameters else 1
    return [Share(name, gpu, -(-n // per_engine), share) for gpu, n in sorted(per_gpu.items())]


def _kind_name(kind: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.ModelInstanceGroup.Kind.Name(kind)


def plan(repositories: list[Path], models: list[str] | None, num_gpus: int) -> list[Share]:
    """Every share of the models that will load (``models``: all when None)."""
    shares = []
    for repository in repositories:
        for config_path in sorted(Path(repository).glob("*/config.pbtxt")):
            if models is None or config_path.parent.name in models:
                shares += model_shares(config_path, num_gpus)
    return shares


def _by_gpu(shares: list[Share]) -> list[tuple[int, list[Share]]]:
    by_gpu: dict[int, list[Share]] = defaultdict(list)
    for share in shares:
        by_gpu[share.gpu].append(share)
    return sorted(by_gpu.items())


def check(shares: list[Share]) -> None:
    """Raise ``MemoryPlanError`` naming the models and numbers of each GPU whose plan does not fit."""
    problems = []
    for gpu, items in _by_gpu(shares):
        total = sum(s.total for s in items)
        if total > MAX_TOTAL_SHARE + 1e-9:
            parts = " + ".join(f"{s.model} {s.share:g}" + (f" x {s.instances}" if s.instances > 1 else "")
                               for s in items)
            problems.append(f"GPU {gpu}: {parts} = {total:.2f} > {MAX_TOTAL_SHARE}")
    if problems:
        raise MemoryPlanError(
            "the GPU memory plan does not fit (gpu_memory_utilization of the models on each GPU): "
            + "; ".join(problems) + ". Lower the shares in the models' config.pbtxt "
            "(docs/operations.md, 'GPU memory plan').")


def describe(shares: list[Share]) -> str:
    """One line per GPU, for the launcher's start-up message."""
    return "\n".join(f"GPU {gpu} memory plan: " + ", ".join(f"{s.model} {s.total:g}" for s in items)
                     + f" (total {sum(s.total for s in items):.2f})" for gpu, items in _by_gpu(shares))
