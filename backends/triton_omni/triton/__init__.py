"""Adapters between Triton's Python backend and the runner library.

Only this package imports ``triton_python_backend_utils``; it is imported by
the ``model.py`` files inside the Python backend stub (and by unit tests that
fake ``pb_utils``). One tensor<->value mapping, one error mapping, one
response thread, one metrics helper, shared by every stage.
"""

import faulthandler
import locale
import logging
import os
import signal
import sys

# The stub embeds Python without PEP 538 C-locale coercion, so text files
# (torch's kernel templates, tokenizer files) would be read as ASCII.
if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

# The launcher starts tritonserver with SIGCHLD ignored, so that the kernel reaps a
# killed stub; ignored dispositions survive exec, so the stub inherits it. Python's
# subprocess and multiprocessing (vLLM's engine core) need the default back.
if signal.getsignal(signal.SIGCHLD) is signal.SIG_IGN:
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # imported off the main thread: the disposition is the process's all the same
        import ctypes

        ctypes.CDLL(None).signal(signal.SIGCHLD, signal.SIG_DFL)

# A stub whose model's load hangs is asked for its threads' stacks (the launcher's STACKS_SIGNAL):
# they go to its stderr, the server's log, and the stub goes on.
faulthandler.register(signal.SIGUSR1, all_threads=True)

# Every stage logs the same way; TRITON_OMNI_LOG_LEVEL=DEBUG adds, e.g.,
# the diffusion backend's per-batch timing.
logging.basicConfig(level=os.environ.get("TRITON_OMNI_LOG_LEVEL", "INFO"),
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")

# Every call into the server (a response's send, is_cancelled, a BLS call,
# and the stub's own receiving of requests) releases the GIL while it waits
# and must get it back afterwards. While another thread computes (the vLLM
# output handler under load, a denoising loop), that takes until the busy
# thread yields, every switch interval: 5 ms by default, which throttles a
# stub's sends to a few hundred a second. A shorter interval costs the busy
# thread a little. TRITON_OMNI_GIL_SWITCH_S overrides it.
GIL_SWITCH_S = float(os.environ.get("TRITON_OMNI_GIL_SWITCH_S", "0.0002"))
sys.setswitchinterval(GIL_SWITCH_S)
