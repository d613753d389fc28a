"""Triton 2.51 (python_backend 24.10): a BLS decoupled stream's error response after its first never reaches
the caller, final flag and all. `child` streams numbers; mode 3 ends after 10 with an error final (the parent
waits for good), mode 4 with an error response then a final flag alone (the flag arrives, the error does
not), modes 0-2 after the parent's client leaves. Run from the project root: python
benchmarks/records/research/bls_error_final/repro.py [MODE ...]; the stubs print EXP lines to the log."""
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

log = Path(".cache/bls-error-final.log")
log.parent.mkdir(exist_ok=True)
opts = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                     model_repositories=[Path(__file__).parent], log_file=log)
with TritonServer(opts) as server:
    for mode in [int(m) for m in sys.argv[1:]] or [0, 1, 2, 3, 4]:
        Path("/tmp/bls-error-final.flag").unlink(missing_ok=True)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        inp = grpcclient.InferInput("MODE", [1], "INT32")
        inp.set_data_from_numpy(np.array([mode], np.int32))
        client.async_stream_infer("parent", [inp], enable_empty_final_response=True)
        time.sleep(3)
        client.stop_stream(cancel_requests=True)
        time.sleep(3)
        print(mode, [line for line in log.read_text(errors="replace").splitlines() if "EXP" in line][-4:], flush=True)
