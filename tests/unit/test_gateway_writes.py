"""The gateway's server-sent events leave in writes: one as soon as it comes when nothing else waits,
several together when they came during the last write; a source's error reaches the response, and a
response that stops early stops its source (the Triton request is then cancelled)."""

from __future__ import annotations

import asyncio

import pytest
from triton_omni_gateway.text import in_writes


def test_a_lone_event_leaves_at_once_and_waiting_ones_leave_together():
    async def scenario():
        release = asyncio.Event()

        async def source():
            yield "a"
            await release.wait()
            for event in "bcd":
                yield event

        writes = in_writes(source())
        first = await writes.__anext__()  # out before the others exist
        release.set()
        await asyncio.sleep(0.01)  # b, c and d arrive while no write is going out
        return [first] + [w async for w in writes]

    assert asyncio.run(scenario()) == ["a", "bcd"]


def test_an_error_of_the_source_is_raised_after_the_events_before_it():
    async def source():
        yield "a"
        raise RuntimeError("stream broke")

    async def scenario():
        seen = []
        with pytest.raises(RuntimeError, match="stream broke"):
            async for write in in_writes(source()):
                seen.append(write)
        return seen

    assert asyncio.run(scenario()) == ["a"]


def test_stopping_early_stops_the_source():
    async def scenario():
        stopped = asyncio.Event()

        async def source():
            try:
                while True:
                    yield "x"
                    await asyncio.sleep(0.001)
            finally:
                stopped.set()

        writes = in_writes(source())
        await writes.__anext__()
        await writes.aclose()  # what the server does when the client goes away
        return stopped.is_set()

    assert asyncio.run(scenario())
