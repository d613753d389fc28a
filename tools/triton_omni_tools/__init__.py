"""The tools around the server: the launcher (``omni-triton serve``, the tests,
the benchmarks), model-repository editing, the ``omni-triton`` CLI, the
``bench`` harness and the ``perf`` runner of Triton's own tools.

Tools import the runtime (``triton_omni``), the client
(``triton_omni_client``) and the protocol; nothing imports the tools: not
the Python backend stubs, not the client.
"""
