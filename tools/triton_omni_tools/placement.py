"""Placement: which GPUs each stage uses, written as Triton configuration.

One spec per stage, ``STAGE=GPUS[xN]`` (``omni-triton serve --place``, the
bench's ``--gpus``):

- ``diffusion=0,1``: one instance on each of GPUs 0 and 1 (``KIND_GPU`` with
  ``gpus: [0, 1]``); ``diffusion=0,1x2``: two on each; ``diffusion=all``:
  one on every GPU;
- ``ar=tp:0,1``: one engine over GPUs 0 and 1 (``KIND_MODEL`` with the
  ``gpus`` model parameter; vLLM runs tensor parallel over them, as
  Triton's vLLM backend does with ``tensor_parallel_size``). Only the AR
  stages (backend ``omni_ar``) take ``tp:``;
- ``diffusion=cfg:0,1``: CFG parallel, one Qwen-Image instance on GPU 0
  whose negative prompts' passes run on GPU 1 (``KIND_MODEL`` with the
  ``gpus`` and ``parallel`` model parameters). Only ``diffusion`` takes it,
  with two GPUs;
- ``diffusion=sp:0,1``: sequence parallel, one Qwen-Image instance whose
  transformer runs each forward over GPUs 0 and 1 (or more), each holding a
  share of the image's tokens. Only ``diffusion`` takes it;
- ``ar=0,1``: for the AR stages too, one engine per GPU (replicas, each its
  own KV cache);
- ``ar=0x3:shared``: three instances on GPU 0 in front of one vLLM engine
  core (the ``instances_per_engine`` model parameter): each instance is a
  stub process of its own, so the per-request Python work spreads over
  three cores (``triton_omni.ar.shared_engine``). Only the AR stages take it.

A spec becomes edits of the copied repository's configs
(``repository.copy_repositories``), so what is served is plain Triton
configuration an operator can read back from ``/v2/models/NAME/config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AR_STAGES = ("ar", "ar_encoder", "ar_transformers")
_SPEC = re.compile(r"^(?P<stage>[A-Za-z0-9_.-]+)=(?:(?P<tp>tp:)|(?P<parallel>cfg:|sp:))?(?P<gpus>all|\d+(?:,\d+)*)"
                   r"(?:x(?P<count>\d+))?"
                   r"(?P<shared>:shared)?$")


class PlacementError(ValueError):
    """A placement spec that cannot be served; the message names it."""


@dataclass(frozen=True)
class StagePlacement:
    stage: str
    gpus: tuple[int, ...]
    per_gpu: int = 1  # instances on each GPU (replicas)
    tensor_parallel: bool = False  # one engine over all of ``gpus``
    shared: bool = False  # the instances on a GPU share one engine core (AR stages on vLLM)
    parallel: str = ""  # diffusion: "cfg" (negative prompts on the second GPU) or "sp" (sequence parallel)

    def edits(self) -> dict[str, Any]:
        """The config changes that serve this placement."""
        if self.parallel:
            return {"instance_group": [{"kind": "KIND_MODEL", "count": 1}],
                    "parameters": {"gpus": ",".join(str(g) for g in self.gpus), "parallel": self.parallel}}
        if self.tensor_parallel:
            return {"instance_group": [{"kind": "KIND_MODEL", "count": 1}],
                    "parameters": {"gpus": ",".join(str(g) for g in self.gpus)}}
        parameters = {"gpus": ""}
        if self.stage in AR_STAGES:
            parameters["instances_per_engine"] = str(self.per_gpu if self.shared else 1)
        return {"instance_group": [{"kind": "KIND_GPU", "count": self.per_gpu, "gpus": list(self.gpus)}],
                "parameters": parameters}

    def __str__(self) -> str:
        gpus = ",".join(str(g) for g in self.gpus)
        if self.parallel:
            return f"{self.stage}={self.parallel}:{gpus}"
        return f"{self.stage}=tp:{gpus}" if self.tensor_parallel else \
            f"{self.stage}={gpus}" + (f"x{self.per_gpu}" if self.per_gpu > 1 else "") + (":shared" * self.shared)


def parse(spec: str, num_gpus: int | None) -> StagePlacement:
    """One ``STAGE=GPUS[xN]`` spec; ``num_gpus`` (None: unknown) bounds the GPU indexes."""
    found = _SPEC.match(spec.strip())
    if not found:
        raise PlacementError(f"placement {spec!r}: expected STAGE=GPUS[xN] (diffusion=0,1 or diffusion=allx2), "
                             "STAGE=tp:GPUS for one AR engine over several GPUs (ar=tp:0,1), diffusion=cfg:0,1 "
                             "(CFG parallel), diffusion=sp:0,1 (sequence parallel) or STAGE=GPUSxN:shared for N AR "
                             "instances per GPU in front of one engine (ar=0x3:shared)")
    stage, tp = found["stage"], bool(found["tp"])
    if found["gpus"] == "all":
        if not num_gpus:
            raise PlacementError(f"placement {spec!r}: 'all' needs a GPU, and none was found")
        gpus = tuple(range(num_gpus))
    else:
        gpus = tuple(int(g) for g in found["gpus"].split(","))
    count = int(found["count"] or 1)
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"placement {spec!r}: a GPU is listed twice")
    if num_gpus is not None and max(gpus) >= num_gpus:
        have = f"{num_gpus}: 0..{num_gpus - 1}" if num_gpus else "none"
        raise PlacementError(f"placement {spec!r}: GPU {max(gpus)} does not exist (GPUs on this machine: {have})")
    if count < 1:
        raise PlacementError(f"placement {spec!r}: the instance count must be at least 1")
    if tp and stage not in AR_STAGES:
        raise PlacementError(f"placement {spec!r}: 'tp:' (one engine over several GPUs) is for the AR stages "
                             f"({', '.join(AR_STAGES)}); {stage} runs one instance per GPU: {stage}="
                             + ",".join(str(g) for g in gpus))
    if tp and found["count"]:
        raise PlacementError(f"placement {spec!r}: one engine spans the GPUs; it takes no instance count")
    parallel = (found["parallel"] or "").rstrip(":")
    if parallel == "cfg" and (stage != "diffusion" or len(gpus) != 2 or found["count"] or found["shared"]):
        raise PlacementError(f"placement {spec!r}: 'cfg:' (CFG parallel) is for diffusion, over exactly two GPUs "
                             "and one instance (diffusion=cfg:0,1)")
    if parallel == "sp" and (stage != "diffusion" or len(gpus) < 2 or found["count"] or found["shared"]):
        raise PlacementError(f"placement {spec!r}: 'sp:' (sequence parallel) is for diffusion, over two GPUs or "
                             "more and one instance (diffusion=sp:0,1)")
    shared = bool(found["shared"])
    if shared and (tp or stage not in AR_STAGES or count < 2):
        raise PlacementError(f"placement {spec!r}: ':shared' puts an AR stage's instances on a GPU in front of one "
                             f"engine ({', '.join(AR_STAGES)}, e.g. ar=0x3:shared); it needs at least two instances "
                             "and no 'tp:'")
    return StagePlacement(stage, gpus, count, tp, shared, parallel)


def parse_all(specs: list[str], num_gpus: int | None, models: set[str] | None = None) -> list[StagePlacement]:
    """Every spec, each stage at most once and (``models``: those served) known."""
    placements = [parse(spec, num_gpus) for spec in specs]
    seen: set[str] = set()
    for placement in placements:
        if placement.stage in seen:
            raise PlacementError(f"placement: {placement.stage} is placed twice")
        seen.add(placement.stage)
        if models is not None and placement.stage not in models:
            raise PlacementError(f"placement {placement}: no model {placement.stage!r} is served "
                                 f"(models: {', '.join(sorted(models))})")
    return placements


def edits(placements: list[StagePlacement]) -> dict[str, dict[str, Any]]:
    """``repository.copy_repositories``'s edits for these placements."""
    return {p.stage: p.edits() for p in placements}


def spread(num_gpus: int, stages: tuple[str, ...] = ("diffusion",)) -> list[str]:
    """The usual layout over ``num_gpus``: one replica of each of ``stages`` per GPU."""
    return [f"{stage}=" + ",".join(str(g) for g in range(num_gpus)) for stage in stages]


def place_repositories(repositories: list[Path], specs: list[str], num_gpus: int | None, dest: Path,
                       other_edits: dict[str, dict[str, Any]] | None = None) -> list[Path]:
    """Copies of ``repositories`` under ``dest`` with ``specs`` applied (and
    ``other_edits``, e.g. a demo family's); the repositories themselves when
    there is nothing to change."""
    if not specs and not other_edits:
        return list(repositories)
    from triton_omni_tools.repository import copy_repositories, merge_edits

    models = {path.parent.name for repository in repositories for path in Path(repository).glob("*/config.pbtxt")}
    placed = edits(parse_all(specs, num_gpus, models))
    return copy_repositories(list(repositories), dest, merge_edits(other_edits or {}, placed))
