"""What one streamed ``ar`` response costs to build, inside a real Triton stub.

Under load the ``ar`` stub's GIL bounds it (docs/benchmarks.md, "Seventh
pass"), and every streamed response is built on it: a ``text_output`` and,
when asked, a ``num_output_tokens``. A throwaway model's ``initialize``
times each way of building those tensors (``stub_probe.py``). Printed:
microseconds per call, the best of three repeats, and the ratio of the
token count built through torch and DLPack (the old path) to the NumPy one
(``python_tensor``, today's).

    .venv/bin/python benchmarks/stub_tensors.py [--calls 5000]
"""

from __future__ import annotations

import argparse

from stub_probe import EXECUTE, run_in_stub

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
''' + EXECUTE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per repeat of each variant")
    args = parser.parse_args()
    figures = run_in_stub("stub_tensors", MODEL, {"calls": args.calls})
    for name, us in figures.items():
        print(f"{name:<48} {us:7.1f} us")
    before = figures["num_output_tokens, torch + DLPack (before)"]
    now = figures["num_output_tokens, NumPy (python_tensor, now)"]
    print(f"token count, before / now: {before / now:.2f}x")


if __name__ == "__main__":
    main()
