"""Speech out: the Qwen-Omni models' thinker -> talker -> codec decoder (issue 74).

Today: the tiny demos of Qwen3-Omni and Qwen2.5-Omni (``demos.py``), built
locally with random weights at tiny configurations, whose own ``generate``
makes the text and the waveform every served route will be held to. The stages that serve it come
next (see ``benchmarks/records/research/qwen-omni-speech.md``).
"""
