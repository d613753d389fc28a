"""Speech out: the Qwen-Omni models' thinker -> talker -> codec decoder (issue 74).

Today: the tiny demo of Qwen3-Omni (``demos.py``), built locally with random
weights at a tiny configuration, whose own ``generate`` makes the text and the
waveform every served route will be held to. The stages that serve it come
next (see ``benchmarks/records/research/qwen-omni-speech.md``).
"""
