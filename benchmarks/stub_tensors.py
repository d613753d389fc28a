"""What one streamed ``ar`` response costs to build, inside a real Triton stub.

Under load the ``ar`` stub's GIL bounds it (docs/benchmarks.md, "Seventh
pass"), and every streamed response is built on it: a ``text_output`` and,
when asked, a ``num_output_tokens``. ``pb_utils`` exists only inside a
stub, so this starts a server with one throwaway Python model whose
``initialize`` times each way of building those tensors, writes the figures
to a file, and exits. Printed: microseconds per call, the best of three
repeats, and the ratio of the token count built through torch and DLPack
(the old path) to the NumPy one (``python_tensor``, today's).

    .venv/bin/python benchmarks/stub_tensors.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_omni_tools.launcher import ServerOptions, TritonServer

CONFIG = """
name: "stub_tensors"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_INT32 dims: [1] } ]
output [ { name: "y" data_type: TYPE_INT32 dims: [1] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "calls" value { string_value: "%d" } }
parameters { key: "out" value { string_value: "%s" } }
"""

MODEL = '''
import json
import timeit

import torch
import triton_python_backend_utils as pb_utils
from triton_omni.triton.tensors import numeric_tensor, python_tensor, string_tensor
import numpy as np

VARIANTS = {
    "text_output (string_tensor)": lambda: string_tensor("text_output", ["hello"]),
    "num_output_tokens, torch + DLPack (before)":
        lambda: numeric_tensor("num_output_tokens", torch.tensor([1], dtype=torch.uint32), torch.uint32),
    "num_output_tokens, NumPy (python_tensor, now)": lambda: python_tensor("num_output_tokens", [1], np.uint32),
    "a response of both (now)": lambda: pb_utils.InferenceResponse(output_tensors=[
        string_tensor("text_output", ["hello"]), python_tensor("num_output_tokens", [1], np.uint32)]),
}


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        calls = int(params["calls"])
        figures = {name: 1e6 * min(timeit.repeat(fn, number=calls, repeat=3)) / calls
                   for name, fn in VARIANTS.items()}
        with open(params["out"], "w") as f:
            json.dump(figures, f)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", np.ones(1, np.int32))])
                for _ in requests]
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per repeat of each variant")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stub-tensors-") as tmp:
        root, out = Path(tmp), Path(tmp) / "figures.json"
        (root / "repo" / "stub_tensors" / "1").mkdir(parents=True)
        (root / "repo" / "stub_tensors" / "config.pbtxt").write_text(CONFIG % (args.calls, out))
        (root / "repo" / "stub_tensors" / "1" / "model.py").write_text(MODEL)
        options = ServerOptions(model_repositories=[root / "repo"], http_port=18400, grpc_port=18401,
                                metrics_port=18402, log_file=root / "server.log", model_control_mode="explicit",
                                load_models=["stub_tensors"])
        with TritonServer(options):
            pass  # initialize has run once the server is ready
        figures = json.loads(out.read_text())
    for name, us in figures.items():
        print(f"{name:<48} {us:7.1f} us")
    before = figures["num_output_tokens, torch + DLPack (before)"]
    now = figures["num_output_tokens, NumPy (python_tensor, now)"]
    print(f"token count, before / now: {before / now:.2f}x")


if __name__ == "__main__":
    main()
