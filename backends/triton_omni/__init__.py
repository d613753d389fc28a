"""triton-omni runtime: what the Python backend stubs import.

Plain Python, free of Triton: request types and their validation, the AR and
diffusion runners, the ``omni`` routing logic, the demo models. The
Python-based Triton backends in ``backends/omni_*/model.py`` are thin
adapters over it; the only package here that touches
``triton_python_backend_utils`` is ``triton_omni.triton``, imported only
inside the stub. The runtime imports the protocol (``triton_omni_protocol``)
and never the client or the tools (ARCHITECTURE.md).
"""
