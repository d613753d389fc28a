"""GPU smoke run: `diffusion` with a KIND_GPU instance group of two, and
`ar_encoder` (transformers engine) on the GPU, served by a real tritonserver.

    python scripts/gpu_smoke.py        (on a machine with a GPU; see docs/gpu.md)

Prints where each instance runs, the images' shapes, and whether batched
images equal the ones computed alone.
"""

from __future__ import annotations

import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_omni.demo_models import build_all
from triton_omni_client import OmniClient
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_model


def main() -> int:
    build_all()
    repo = Path(tempfile.mkdtemp())
    default = DEFAULT_REPOSITORIES[0]
    copy_model(default, "diffusion", repo, instance_group=[{"kind": "KIND_GPU", "count": 2, "gpus": [0]}])
    copy_model(default, "ar_encoder", repo, parameters={"engine": "transformers"},
               instance_group=[{"kind": "KIND_GPU", "count": 1}])
    log = repo / "tritonserver.log"
    options = ServerOptions(model_repositories=[repo], http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), log_file=log)
    started = time.monotonic()
    with TritonServer(options) as server:
        print(f"server ready in {time.monotonic() - started:.1f} s")
        for line in log.read_text().splitlines():
            if "runner ready" in line:
                print(" ", line.split(": ", 1)[1])
        client = OmniClient(server.grpc_url)
        embeds = client.encode("a watercolor lighthouse")
        print(f"ar_encoder on GPU: embeddings {embeds.shape} {embeds.dtype}")
        requests = [{"prompt": f"prompt {i}", "seed": i, "num_inference_steps": 10, "height": 256, "width": 256,
                     "guidance_scale": 5.0} for i in range(8)]
        requests.append({"prompt_embeds": embeds, "seed": 3, "num_inference_steps": 10, "height": 256,
                         "width": 256, "guidance_scale": 1.0})
        alone = [client.generate_image(**r) for r in requests]
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: OmniClient(server.grpc_url).generate_image(**r), requests))
        elapsed = time.monotonic() - started
        identical = all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
        print(f"images: {[img.shape for img in together][:2]}..., concurrent batch of {len(requests)} in "
              f"{elapsed:.2f} s, identical to alone: {identical}, distinct seeds differ: "
              f"{not np.array_equal(alone[0], alone[1])}")
        stats = [line for line in log.read_text().splitlines() if "Error" in line and "NVML" not in line]
        print("errors in server log:", len(stats))
        return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
