"""A reply as the thinker writes it, from ``omni`` to ``speech`` (``ReplyWriter``, ``ReplyReader``):
token ids a line at a time and, for a talker that reads them, the thinker's states beside them,
read in whole rows, all of them there once the reply's end is."""

from __future__ import annotations

import os

import numpy as np
from triton_omni.channel import ReplyReader, ReplyWriter

WIDTH = 5


def test_ids_and_states_arrive_whole_and_in_order(tmp_path):
    writer = ReplyWriter(tmp_path, states=True)
    reader = ReplyReader(writer.name, tmp_path, states_width=WIDTH)
    rows = np.arange(4 * WIDTH, dtype=np.float32).reshape(4, WIDTH)
    writer.add([1, 2], rows[:3])
    assert reader.read() == [1, 2]
    np.testing.assert_array_equal(reader.read_states(), rows[:3])
    # half a row on disk (a write the reader overtakes): held back until the row is whole
    os.write(os.open(writer.states_path, os.O_WRONLY | os.O_APPEND), rows[3, :2].tobytes())
    assert reader.read_states().shape == (0, WIDTH)
    os.write(os.open(writer.states_path, os.O_WRONLY | os.O_APPEND), rows[3, 2:].tobytes())
    writer.add([3])
    writer.end()
    assert reader.read() == [3] and reader.state == "end"
    np.testing.assert_array_equal(reader.read_states(), rows[3:])
    reader.close()
    writer.remove()
    assert not writer.path.exists() and not writer.states_path.exists()


def test_a_reply_without_states_reads_ids_only(tmp_path):
    writer = ReplyWriter(tmp_path)
    reader = ReplyReader(writer.name, tmp_path)
    writer.add([7, 8], np.zeros((2, WIDTH), dtype=np.float32))  # no states file: the states go nowhere
    writer.remove()
    assert reader.read() == [7, 8] and reader.state == "abort"
    assert not writer.states_path.exists()
    reader.close()
