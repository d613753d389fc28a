"""The import directions are the architecture (ARCHITECTURE.md), and the
configs on disk agree with the wire contract in ``triton_omni_protocol``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.grpc.model_config_pb2 as model_config
from google.protobuf import text_format
from triton_omni_protocol import (
    AR_ENCODE_INPUTS,
    AR_GENERATE_INPUTS,
    AR_GENERATE_OUTPUTS,
    DIFFUSION_OPTIONS,
    OMNI_INPUTS,
    OMNI_OUTPUTS,
    RETURN_FLAGS,
    ar_encode_outputs,
    diffusion_inputs,
    diffusion_outputs,
    scalar_inputs,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "protocol": ROOT / "protocol" / "triton_omni_protocol",
    "runtime": ROOT / "backends",
    "client": ROOT / "clients" / "triton_omni_client",
    "gateway": ROOT / "gateway" / "triton_omni_gateway",
    "tools": ROOT / "tools" / "triton_omni_tools",
}
HEAVY = ("torch", "diffusers", "transformers", "vllm")


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Top-level names each .py file under ``folder`` imports (anywhere in the file)."""
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {path: sorted(n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden))
            for path, names in imported_modules(PACKAGES[package]).items()
            if any(n.split(".")[0] in forbidden or n.startswith(forbidden) for n in names)}


def test_the_runtime_never_imports_the_client_or_the_tools():
    assert offenders("runtime", ("triton_omni_client", "triton_omni_gateway", "triton_omni_tools")) == {}


def test_the_client_imports_neither_the_runtime_nor_the_tools_nor_ml_libraries():
    assert offenders("client", ("triton_omni_tools", "triton_omni_gateway", "triton_omni.", *HEAVY)) == {}
    assert not any("triton_omni" in names for names in imported_modules(PACKAGES["client"]).values())


def test_the_gateway_imports_neither_the_runtime_nor_the_tools_nor_model_code():
    """The tokenizer (transformers) is the one library of the models it loads: for chat templates."""
    assert offenders("gateway", ("triton_omni_tools", "triton_omni.", "torch", "diffusers", "vllm")) == {}
    assert not any("triton_omni" in names for names in imported_modules(PACKAGES["gateway"]).values())


def test_importing_the_gateway_loads_no_ml_library():
    code = ("import sys, triton_omni_gateway.app, triton_omni_gateway.__main__; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_omni_scheduler_loads_neither_transformers_nor_diffusers():
    """Its stub routes requests: the LLM and DiT libraries would only slow its start and fill its memory."""
    code = ("import importlib.util, sys; from tests.support.fake_pb_utils import install; install(); "
            "spec = importlib.util.spec_from_file_location('model', 'backends/omni_scheduler/model.py'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print([m for m in ('transformers', 'diffusers', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_the_protocol_needs_only_the_standard_library_and_numpy():
    allowed = set(sys.stdlib_module_names) | {"numpy", "triton_omni_protocol", "__future__"}
    used = {n.split(".")[0] for names in imported_modules(PACKAGES["protocol"]).values() for n in names}
    assert used <= allowed, used - allowed


def test_importing_the_client_loads_no_ml_library():
    code = ("import sys, triton_omni_client, triton_omni_client.client, triton_omni_protocol; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- configs against the protocol -----------------------------------------------------------


def load_config(path: Path):
    return text_format.Parse(path.read_text(), model_config.ModelConfig())


def type_name(value: int) -> str:
    return model_config.DataType.Name(value)


CONTRACTS = {  # model -> (inputs, outputs) of the protocol
    "ar": (AR_GENERATE_INPUTS, AR_GENERATE_OUTPUTS),
    "ar_encoder": (AR_ENCODE_INPUTS, ar_encode_outputs("float32")),
    "diffusion": (diffusion_inputs(), diffusion_outputs()),
    "omni": (OMNI_INPUTS, OMNI_OUTPUTS),
}


@pytest.mark.parametrize("model", sorted(CONTRACTS))
def test_repository_configs_only_declare_what_the_protocol_says(model):
    """The configs stay tiny (auto-complete fills them from the protocol);
    whatever they do declare must agree with it."""
    config = load_config(ROOT / "model_repository" / model / "config.pbtxt")
    inputs, outputs = ({s.name: s for s in specs} for specs in CONTRACTS[model])
    for declared, specs in ((config.input, inputs), (config.output, outputs)):
        for tensor in declared:
            spec = specs[tensor.name]
            assert (type_name(tensor.data_type), list(tensor.dims)) == (spec.data_type, list(spec.dims))


# The product, which reads a family's capabilities instead of naming it or probing its pipeline
# (ARCHITECTURE.md); the family modules are where families are named.
RUNTIME, TOOLS = ROOT / "backends" / "triton_omni", ROOT / "tools" / "triton_omni_tools"
PRODUCT = [ROOT / "backends", ROOT / "tools", ROOT / "gateway", ROOT / "clients", ROOT / "protocol"]
FAMILY_MODULES = RUNTIME / "families"
FAMILY_WORDS = ("qwen_image", "qwenimage", "z_image", "zimage", "stable_diffusion", "stablediffusion", "unet",
                "sdxl", "flux")
FAMILY_TOKENS = ("wan",)  # names short enough to be part of other words: matched as a whole token ("wan2", "_wan")
# What may name a family or probe an object outside the family modules, each with its reason:
# (path from the root, the word or probe found) -> why. Anything else found fails the test.
ALLOWED = {
    ("backends/triton_omni/demo_models.py", "UNET_TINY"): "the SD demo's UNet shapes, which its builder reads",
    ("backends/triton_omni/demo_models.py", "UNET_SD15"): "the SD demo's UNet shapes, which its builder reads",
    ("backends/triton_omni/lora.py", "hasattr("): "a PEFT state dict's keys against an LLM's module tree, no pipeline",
    ("clients/triton_omni_client/client.py", "hasattr("): "tritonclient's two exception types, no pipeline",
    ("tools/triton_omni_tools/bench/presets.py", "*"): "the benchmark presets name the realistic demos they load",
    ("tools/triton_omni_tools/bench/report.py", "*"): "a report's row labels",
    ("tools/triton_omni_tools/cli.py", "*"): "help texts naming the demo families a user can choose",
}


PROBES = ("hasattr(", "getattr(pipeline", "isinstance(pipeline")


def code_words(path: Path) -> list[tuple[int, str]]:
    """Every identifier, attribute and string constant of a module's code (docstrings left out), and
    every probe: a call of ``hasattr``, a ``getattr`` on something named a pipeline, an
    ``isinstance`` against a pipeline class; each with its line."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append((node.lineno, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            probed = ast.unparse(node.args[0]).lower()
            if node.func.id == "hasattr":
                words.append((node.lineno, "hasattr("))
            elif node.func.id == "getattr" and ("pipeline" in probed or probed.endswith("pipe")):
                words.append((node.lineno, "getattr(pipeline"))
            elif node.func.id == "isinstance" and len(node.args) > 1 and \
                    "pipeline" in ast.unparse(node.args[1]).lower().replace("pipelinetextengine", ""):
                words.append((node.lineno, "isinstance(pipeline"))
    return words


def test_no_family_is_named_or_probed_outside_the_family_modules():
    """The runner, the step engine, ar_encoder, the adapters, the launcher, the gateway and the client
    read a family's capabilities (triton_omni.families); a family is named, and its pipeline probed
    (``hasattr``, ``getattr``, ``isinstance``), only in its own module, or where ``ALLOWED`` says why."""
    found = []
    for root in PRODUCT:
        for path in sorted(root.rglob("*.py")):
            if FAMILY_MODULES in path.parents:
                continue
            where = str(path.relative_to(ROOT))
            for line, word in code_words(path):
                lowered = word.lower().replace("-", "_")
                probe = word in PROBES
                named = any(name in lowered for name in FAMILY_WORDS) or \
                    any(name in re.split(r"[^a-z]+", lowered) for name in FAMILY_TOKENS)
                if (probe or named) and (where, word) not in ALLOWED and (where, "*") not in ALLOWED:
                    found.append(f"{where}:{line}: {word[:60]}")
    assert not found, "\n".join(found)


def test_the_ensemble_is_wired_from_the_protocol():
    config = load_config(ROOT / "ensemble" / "text_to_image" / "config.pbtxt")
    diffusion = {s.name: s for s in diffusion_inputs()}
    own = {"text_input": AR_ENCODE_INPUTS[0], **{k: v for k, v in diffusion.items() if "embeds" not in k}}
    for tensor in config.input:
        spec = own[tensor.name]
        assert (type_name(tensor.data_type), list(tensor.dims)) == (spec.data_type, list(spec.dims)), tensor.name
        assert tensor.optional == spec.optional, tensor.name  # an absent negative prompt reaches ar_encoder absent
    (image,) = config.output
    assert (type_name(image.data_type), list(image.dims)) == ("TYPE_UINT8", list(diffusion_outputs()[0].dims))
    for step in config.ensemble_scheduling.step:
        inputs, outputs = CONTRACTS[step.model_name]
        assert set(step.input_map) <= {s.name for s in inputs}, step.model_name
        assert set(step.output_map) <= {s.name for s in outputs}, step.model_name


def test_every_diffusion_option_is_an_optional_input_of_the_ensemble_passed_to_diffusion():
    """The protocol's one table of diffusion options: `text_to_image` takes each, optional, as
    `diffusion` declares it, and hands it to `diffusion` under its name (the negative prompt's text
    to `ar_encoder`, which encodes it for `diffusion`)."""
    config = load_config(ROOT / "ensemble" / "text_to_image" / "config.pbtxt")
    inputs = {tensor.name: tensor for tensor in config.input}
    steps = {step.model_name: step for step in config.ensemble_scheduling.step}
    for spec in DIFFUSION_OPTIONS:
        assert spec.name in inputs and inputs[spec.name].optional, spec.name
        stage = "ar_encoder" if spec.name == "negative_prompt" else "diffusion"
        assert steps[stage].input_map.get(spec.name) == spec.name, spec.name


def test_the_gateways_request_bodies_take_every_diffusion_option():
    """OpenAI's bodies carry the table's options as extensions under the same names (``/v1/videos``'
    values are read off the table by name), but what the API shapes its own way: ``size`` for the
    height and width, and the image endpoints make no video (a frame count, a length, the scale of
    a video model's second expert)."""
    from triton_omni_gateway.requests import ImageRequest, VideoRequest

    names = {spec.name for spec in DIFFUSION_OPTIONS} - {"height", "width"}
    assert "size" in VideoRequest.model_fields and "size" in ImageRequest.model_fields
    assert names <= set(VideoRequest.model_fields), names - set(VideoRequest.model_fields)
    image_names = names - {"num_frames", "seconds", "guidance_scale_2"}
    assert image_names <= set(ImageRequest.model_fields), image_names - set(ImageRequest.model_fields)


def test_the_clis_flags_are_the_diffusion_options():
    """`generate-video` has a flag for every option of the table (its dest the option's name, its
    help the table's), `generate-image` for every one but a video's: `lora` and `lora_scale` as one
    `--lora NAME[:SCALE]`."""
    import argparse

    from triton_omni_protocol import VIDEO_OPTIONS
    from triton_omni_tools.cli import _add_image_options

    for video in (True, False):
        parser = argparse.ArgumentParser()
        _add_image_options(parser, video=video)
        flags = {action.dest: action for action in parser._actions}
        for spec in DIFFUSION_OPTIONS:
            if spec.name in ("lora", "lora_scale"):
                continue
            if spec.name in VIDEO_OPTIONS and not video:
                assert spec.name not in flags, spec.name
                continue
            assert flags[spec.name].type is spec.python_type and flags[spec.name].help == spec.doc, spec.name
        assert "lora" in flags


def test_one_type_per_scalar_input_name_across_models():
    seen = {}
    for spec in [*AR_GENERATE_INPUTS, *diffusion_inputs(), *OMNI_INPUTS]:
        if spec.name in scalar_inputs():
            assert seen.setdefault(spec.name, spec.data_type) == spec.data_type, spec.name


def test_the_runtime_return_flags_are_the_protocol_s():
    from triton_omni.ar import ReturnOptions

    assert tuple(ReturnOptions.__dataclass_fields__) == RETURN_FLAGS
