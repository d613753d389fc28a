"""``benchmarks/families.py`` end to end on CPU with the tiny pipelines: each
family through Triton against diffusers' own pipeline, the same embeddings
and seeds. The report's shape is checked, and that the served image at
concurrency 1 is the pipeline's; never a ratio (docs/benchmarks.md quotes the
GPU figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Z-Image's run covers embeddings as a list, --end-to-end (text_to_image against the pipeline
# called with the prompt) and a server with exact_batching: pipeline; FLUX.1's, embeddings as one
# tensor (as Qwen-Image's and FLUX.2's), the pooled embedding, --aa, --shared-memory and the
# embeddings in bf16 (the server's embeds_dtype; both sides get bf16's values), and Triton's batching
# window (--gather-us), under which the requests sent together share every step.
@pytest.mark.parametrize("family, options", [("z-image", ["--end-to-end", "--exact-batching", "pipeline"]),
                                             ("flux1-dev", ["--aa", "--shared-memory", "--embeds-dtype", "bfloat16",
                                                            "--gather-us", "200000"])])
def test_the_family_is_measured_against_its_pipeline(tmp_path, family, options):
    out_file = tmp_path / "families.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "families.py"), "--family", family,
                             "--rounds", "1", "--concurrency", "1,2", "--json", str(out_file), *options],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "throughput t/d" in result.stdout
    report = json.loads(out_file.read_text())
    assert [p["concurrency"] for p in report["points"]] == [1, 2]
    for point in report["points"]:
        assert point["direct"]["images_per_s"] > 0 and point["triton"]["images_per_s"] > 0
    # alone, the served image is the pipeline's (end to end: the encoder's float32 low bits, one level)
    end_to_end = "--end-to-end" in options
    assert report["points"][0]["first_image_max_diff"] <= (1 if end_to_end else 0)
    assert report["end_to_end"] == end_to_end
    if "--aa" in options:
        assert all(point["aa_latency_ratio"] > 0 for point in report["points"]) and "A/A" in result.stdout
    assert report["shared_memory"] == ("--shared-memory" in options)
    assert report["kernels"].get("embeds_dtype") == ("bfloat16" if "--embeds-dtype" in options else None)
    for point in report["points"]:
        triton = point["triton"]
        assert triton["in_server_s"] > 0 and triton["before_model_s"] >= 0
        assert triton["in_server_s"] + triton["before_model_s"] <= triton["latency_s"]
        assert triton["compiles"] == triton["compile_s"] == 0  # read from /metrics; nothing compiled here
    if "--gather-us" in options:
        assert report["gather_us"] == 200000 and "batching window 200000" in result.stdout
        together = report["points"][1]["triton"]
        assert (together["steps_per_round"], together["requests_per_step"]) == (2, 2), together
