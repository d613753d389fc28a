"""Speech out: the Qwen-Omni models' thinker -> talker -> codec decoder (issue 74).

The thinker is ``ar``'s; this package is the ``speech`` stage after it: the talker's step batch
(``talker.py``, on a GPU ``talker_graphs.py`` and ``predictor_graphs.py``), ``code2wav`` decoded as
frames arrive (``codec.py``), the runner that chains them (``runner.py``), and the tiny demos
(``demos.py``) whose own ``generate`` every served route is held to.
"""
