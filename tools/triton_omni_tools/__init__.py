"""The tools around the server: the launcher (``omni-triton serve``, the tests,
the benchmarks), model-repository editing, the ``omni-triton`` CLI, the
``bench`` harness and the ``perf`` runner of Triton's own tools.

Tools import the runtime (``triton_omni``), the client
(``triton_omni_client``) and the protocol; nothing imports the tools: not
the Python backend stubs, not the client.
"""

import os
from pathlib import Path

# The tools run from a source checkout and keep its caches (demo models) in
# its .cache folder; the runtime only reads $TRITON_OMNI_CACHE. Set before any
# tool builds a model or starts a server, which inherits it.
os.environ.setdefault("TRITON_OMNI_CACHE", str(Path(__file__).resolve().parents[2] / ".cache"))
