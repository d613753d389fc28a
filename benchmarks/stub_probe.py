"""Run a throwaway Python model's ``initialize`` inside a real Triton stub
and return what it measured.

``pb_utils`` exists only inside a stub, so the microbenchmarks of what the
stub's own calls cost (``stub_tensors.py``, ``stub_metrics.py``) start a
server with one model whose ``initialize`` times things, writes a JSON
file named by its ``out`` parameter, and returns. The server is ready once
``initialize`` has run, and is then stopped.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_INT32 dims: [1] }} ]
output [ {{ name: "y" data_type: TYPE_INT32 dims: [1] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{parameters}
"""

# Every probe model answers like this; only its initialize matters.
EXECUTE = '''
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", np.ones(1, np.int32))])
                for _ in requests]
'''


def run_in_stub(name: str, model_source: str, params: dict[str, object]) -> dict:
    """``model_source``: a model.py whose ``initialize`` writes its figures as
    JSON to ``args``' parameter ``out``; ``params``: its other parameters."""
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        root, out = Path(tmp), Path(tmp) / "figures.json"
        values = {**{key: str(value) for key, value in params.items()}, "out": str(out)}
        parameters = "\n".join(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'
                               for key, value in values.items())
        model_dir = root / "repo" / name
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(CONFIG.format(name=name, parameters=parameters))
        (model_dir / "1" / "model.py").write_text(model_source)
        options = ServerOptions(model_repositories=[root / "repo"], http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), log_file=root / "server.log",
                                model_control_mode="explicit", load_models=[name])
        with TritonServer(options):
            pass  # initialize has run once the server is ready
        return json.loads(out.read_text())
