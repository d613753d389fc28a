"""Helpers for tests that drive an ``ArRunner`` in the test's process."""

from __future__ import annotations

import uuid


def responses(runner, request) -> list:
    """``request`` (a ``GenerateRequest``) checked by ``runner`` and run to its end: its responses in order."""
    runner.check(request)
    found = []

    async def run():
        async for response in runner.generate(request, uuid.uuid4().hex):
            found.append(response)

    runner.loop.run(run(), timeout=120)
    return found


def spoken(speech, inputs: dict) -> tuple:
    """``inputs`` (the speech stage's, by name) spoken to the end by ``speech`` (a ``SpeechRunner``):
    its samples and its codec frames [codebooks, frames], as NumPy arrays."""
    import numpy as np

    chunks = []
    speech.loop.run(speech.speak(speech.parse(inputs), chunks.append), timeout=120)
    return np.concatenate([c.samples for c in chunks]), np.concatenate([c.codes for c in chunks], axis=1)
