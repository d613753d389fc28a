"""``omni``'s stage streams (``TritonStages._stream``) when the caller goes, on a fake ``pb_utils``
and a fake stage: wherever the cancellation finds the stream (while the stage's request starts,
while omni waits for its next response, or between two, the consumer closing it), the stage sees
the cancel flag and ends, and the stream's end reaches omni: no cancel flag and no recorded error
(``StageErrors``: a stage's CANCELLED, which Triton 2.51's BLS would lose) is left behind."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
from triton_omni.channel import Cancellations, StageErrors

from tests.support import fake_pb_utils

fake_pb_utils.install()
from triton_omni.triton.stages import TritonStages  # noqa: E402  (pb_utils first)

END = object()


class Stage:
    """A decoupled stage serving one request on a thread of its own, as a stub does: a response
    every 10 ms until it sees its cancel flag (then its CANCELLED recorded, the stream ended by a
    final flag alone) or its 300th response."""

    def __init__(self, directory, key: str, hold_start: threading.Event | None = None):
        self.directory, self.key, self.hold_start = directory, key, hold_start
        self.starting, self.cancelled = threading.Event(), threading.Event()
        self.responses: queue.Queue = queue.Queue()

    def exec(self, decoupled: bool):
        assert decoupled
        self.starting.set()
        if self.hold_start is not None:
            self.hold_start.wait(10)
        threading.Thread(target=self._serve, daemon=True).start()
        return iter(self.responses.get, END)

    def _serve(self) -> None:
        cancellations = Cancellations(self.directory)
        for _ in range(300):
            if cancellations.is_cancelled(self.key):
                self.cancelled.set()
                StageErrors(self.directory).record(self.key, "[CANCELLED] the request was cancelled")
                break
            self.responses.put(fake_pb_utils.InferenceResponse([fake_pb_utils.Tensor("audio", [0.0])]))
            time.sleep(0.01)
        self.responses.put(END)


def left_behind(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".cancel", ".error"))


@pytest.mark.parametrize("where", ["starting", "waiting", "between"])
def test_a_stream_left_anywhere_ends_in_its_stage_and_leaves_nothing(tmp_path, where):
    stages = TritonStages("ar", "ar_encoder", "diffusion", progress=None, cancellations=Cancellations(tmp_path),
                          restart_poll_s=0.05)
    hold = threading.Event() if where == "starting" else None
    stage = Stage(tmp_path, "k1", hold)

    async def leave() -> None:
        stream = stages._stream("k1", "speech", stage)
        if where == "between":  # the consumer takes one response, then closes the stream
            await stream.__anext__()
            await stream.aclose()
        else:
            async def read() -> None:
                async for _ in stream:
                    pass

            task = asyncio.create_task(read())
            if where == "starting":
                while not stage.starting.is_set():
                    await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(0.1)  # a few responses read: the task waits for the next
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if hold is not None:
                hold.set()  # the request's start returns after its caller left
        # omni's loop runs on (as in a server) while the stage ends and its end reaches omni
        deadline = time.monotonic() + 10
        while not stage.cancelled.is_set() or left_behind(tmp_path):
            assert time.monotonic() < deadline, (f"the stage saw the cancellation: {stage.cancelled.is_set()}; "
                                                 f"left behind: {left_behind(tmp_path)}")
            await asyncio.sleep(0.05)

    try:
        asyncio.run(leave())
    finally:
        stages.close()
