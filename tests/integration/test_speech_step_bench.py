"""``benchmarks/speech_step.py`` on CPU with the tiny Qwen3-Omni: the talker's step batch at
two sizes, each step split into its parts, and the decoder's chunk for as many streams, one
after another and together (within 1e-4 of each other: the same samples), and the first chunks'
decode the first time and the second; and ``token2wav_batch.py`` with the tiny Qwen2.5-Omni. The
report's shape is checked, never a figure: docs/benchmarks.md quotes the GPU's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_speech_stage_step_is_split_into_its_parts(tmp_path):
    out_file = tmp_path / "speech_step.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speech_step.py"), "--rows", "1,3",
                             "--steps", "4", "--cold-codec", "--json", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_file.read_text())
    assert set(report["chunk_decode_ms"]) == {"1", "3"}
    cold = report["cold_first_chunks_ms"]
    assert set(cold) == {f"{n}x{f}" for n in (1, 3) for f in (1, 2, 4)}
    assert all(found["first"] > 0 and found["second"] > 0 for found in cold.values())
    for chunk in report["chunk_decode_ms"].values():
        assert chunk["one after another"] > 0 and chunk["together"] > 0 and chunk["transformer"] > 0
        assert chunk["max sample difference"] < 1e-4
    assert set(report["modes"]) == set(report["first_frame_ms"]) == {"eager"}  # a CPU's: CUDA graphs are a GPU's
    first = report["first_frame_ms"]["eager"]
    assert min(first[part] for part in ("talker prompt", "prefill (synchronised)", "to the first frame")) > 0
    assert set(report["first_chunk_decode_ms"]) == {"1", "2"} and min(report["first_chunk_decode_ms"].values()) > 0
    assert set(report["modes"]["eager"]) == {"1", "3"}
    for found in report["modes"]["eager"].values():
        parts = found["parts_ms (synchronised)"]
        assert found["step_ms"] > 0 and found["rtf_floor"] > 0
        assert min(parts[part] for part in ("step", "code predictor", "first code draw")) > 0


def test_a_qwen25_talkers_steps_are_measured_without_a_code_predictor(tmp_path):
    """``--model qwen2.5-omni``: the tiny Qwen2.5-Omni's talker, its steps split into the talker's
    forward and the draw (no code predictor), its real-time floor the talker's steps at 50 codes a
    second; no decoder figures (``token2wav`` is ``token2wav_batch.py``'s)."""
    out_file = tmp_path / "speech_step.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speech_step.py"), "--model", "qwen2.5-omni",
                             "--rows", "1,3", "--steps", "4", "--json", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_file.read_text())
    assert report["chunk_decode_ms"] == {} and "first_chunk_decode_ms" not in report
    assert set(report["modes"]) == {"eager"} and set(report["modes"]["eager"]) == {"1", "3"}
    for found in report["modes"]["eager"].values():
        parts = found["parts_ms (synchronised)"]
        # (each part a median over the steps of its own timings: a part's may exceed the step's)
        assert "code predictor" not in parts and parts["step"] > 0 and parts["talker forward"] > 0
        assert abs(found["rtf_floor"] - found["step_ms"] * 50 / 1000) < 1e-9
    assert report["first_frame_ms"]["eager"]["to the first frame"] > 0


def test_token2wavs_streams_are_measured_together_and_apart_with_the_vocoders_share(tmp_path):
    """``token2wav_batch.py`` on the tiny Qwen2.5-Omni: a block of codes for each stream count,
    together and one after another, the same samples either way (within float32 rounding), and of
    each way's round the vocoder's part, which is less than the round (the DiT's ODE comes first)."""
    out_file = tmp_path / "token2wav.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "token2wav_batch.py"), "--streams", "1,2",
                             "--rounds", "2", "--json", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_file.read_text())
    assert report["device"] == "cpu" and set(report["streams"]) == {"1", "2"}
    for found in report["streams"].values():
        assert found["max_abs_difference"] < 1e-4
        rounds = {"together": found["together_ms"], "one after another": found["one_after_another_ms"]}
        assert set(found["vocoder_ms"]) == set(rounds)
        assert all(0 < found["vocoder_ms"][way] < rounds[way] for way in rounds)
