"""benchmarks/speech.py's stall: how long a player that starts at the first audio chunk waits for
audio after it (the stutter a listener hears in streamed speech)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RATE = 24000


@pytest.fixture
def speech(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("speech")


def test_chunks_that_come_before_the_audio_plays_out_never_stall(speech):
    # 80 ms of audio at 0.1 s, 160 ms at 0.15 s (before 0.18 s), 0.5 s at 0.3 s (before 0.34 s)
    assert speech.stall([(0.1, RATE * 8 // 100), (0.15, RATE * 16 // 100), (0.3, RATE // 2)]) == 0.0
    assert speech.stall([]) == 0.0


def test_each_chunk_after_the_audio_before_it_stalls_by_the_gap(speech):
    # 80 ms at 0.1 s plays out at 0.18 s: the next at 0.3 s stalls 0.12 s; its 40 ms play out at
    # 0.34 s, and the next at 0.5 s stalls 0.16 s more
    assert speech.stall([(0.1, RATE * 8 // 100), (0.3, RATE * 4 // 100), (0.5, RATE)]) == pytest.approx(0.28)
