"""triton-omni runner library.

Plain Python, free of Triton: request types and their validation, the AR and
diffusion runners, the demo models and the server launcher. The Python-based
Triton backends in ``backends/omni_*/model.py`` are thin adapters over it; the
only package here that touches ``triton_python_backend_utils`` is
``triton_omni.triton`` and it is imported only inside the Python backend stub.
"""
