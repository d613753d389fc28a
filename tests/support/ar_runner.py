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
