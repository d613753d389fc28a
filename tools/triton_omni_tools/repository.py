"""Copies of model repositories with configs changed: the one config editor.

The tests' variants (``ar_transformers``, a small-budget ``omni``), the bench
presets, the stub-gap diagnosis and the GPU smoke test all start from the
configs in ``model_repository/`` and ``ensemble/`` and change a few fields.
The configs are parsed as Triton's ``ModelConfig`` protobuf, changed as
structured data and written back, so an edit can neither miss its target
nor corrupt a neighbour.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from triton_omni_protocol import diffusion_outputs
from tritonclient.grpc import model_config_pb2

ParameterValue = str | dict[str, Any]


def load_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def edit_config(path: Path, *, parameters: dict[str, ParameterValue] | None = None,
                max_batch_size: int | None = None, max_queue_delay_us: int | None = None,
                preferred_batch_size: list[int] | None = None,
                instance_group: list[dict[str, Any]] | None = None, decoupled: bool | None = None,
                media: str | None = None, backend: str | None = None) -> None:
    """Change ``path`` in place.

    ``parameters``: a string sets the model parameter; a dict is merged into
    the JSON object the parameter holds (``{"limits": {"max_size": 1024}}``).
    ``instance_group``: Triton's JSON form, e.g. ``[{"kind": "KIND_GPU", "count": 2, "gpus": [0]}]``.
    ``media``: ``"video"`` makes an ensemble that ends in the diffusion stage's ``image`` end in its
    ``video`` and ``fps`` (a video family's outputs) instead.
    """
    config = load_config(path)
    if backend is not None:
        config.backend = backend
    for key, value in (parameters or {}).items():
        if isinstance(value, dict):
            current = config.parameters[key].string_value
            value = json.dumps((json.loads(current) if current.strip() else {}) | value)
        config.parameters[key].string_value = value
    if max_batch_size is not None:
        config.max_batch_size = max_batch_size
    if max_queue_delay_us is not None:
        config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    if preferred_batch_size is not None:
        config.dynamic_batching.preferred_batch_size[:] = preferred_batch_size
    if decoupled is not None:
        config.model_transaction_policy.decoupled = decoupled
    if instance_group is not None:
        del config.instance_group[:]
        for group in instance_group:
            json_format.ParseDict(group, config.instance_group.add())
    if media == "video":
        _ends_in_video(config)
    elif media is not None:
        raise ValueError(f"media must be 'video', got {media!r}")
    path.write_text(text_format.MessageToString(config))


def _ends_in_video(config: model_config_pb2.ModelConfig) -> None:
    """The ensemble's ``image`` output (the diffusion stage's) replaced by ``video`` and ``fps``, as
    the protocol declares them: Triton fails an ensemble request whose outputs are not all produced,
    and a video model produces no ``image``."""
    if not any(output.name == "image" for output in config.output):
        return  # no image to replace (or replaced already)
    specs = {spec.name: spec for spec in diffusion_outputs()}
    kept = [output for output in config.output if output.name != "image"]
    del config.output[:]
    config.output.extend(kept)
    for name in ("video", "fps"):
        output = config.output.add(name=name, data_type=model_config_pb2.DataType.Value(specs[name].data_type))
        output.dims.extend(specs[name].dims)
    for step in config.ensemble_scheduling.step:
        if step.output_map.get("image") == "image":
            del step.output_map["image"]
            step.output_map.update({"video": "video", "fps": "fps"})


def copy_model(source_repository: Path, model: str, dest_repository: Path, name: str | None = None,
               **edits: Any) -> Path:
    """``model`` copied into ``dest_repository`` (as ``name``), its config edited; the config's
    ``name`` field, when set, follows the new name."""
    target = dest_repository / (name or model)
    shutil.copytree(source_repository / model, target)
    if name and name != model:
        config = load_config(target / "config.pbtxt")
        if config.name:
            config.name = name
            (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    edit_config(target / "config.pbtxt", **edits)
    return target


def merge_edits(first: dict[str, dict[str, Any]], then: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Two sets of ``copy_repositories`` edits as one: ``then`` wins a field both set,
    and model parameters merge key by key."""
    merged = {model: dict(changes) for model, changes in first.items()}
    for model, changes in then.items():
        target = merged.setdefault(model, {})
        for field_name, value in changes.items():
            if field_name == "parameters":
                target["parameters"] = target.get("parameters", {}) | value
            else:
                target[field_name] = value
    return merged


def copy_repositories(sources: list[Path], dest: Path, edits: dict[str, dict[str, Any]]) -> list[Path]:
    """Whole repositories copied under ``dest``, with ``edits[model]`` applied to each model named there."""
    copies = []
    for source in sources:
        target = dest / source.name
        shutil.copytree(source, target)
        for model, changes in edits.items():
            if (target / model / "config.pbtxt").exists():
                edit_config(target / model / "config.pbtxt", **changes)
        copies.append(target)
    return copies
