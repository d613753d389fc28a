"""After a mixed run, /metrics serves every custom metric documented in docs/metrics.md, with counts."""

from __future__ import annotations

import re
import urllib.request

import pytest
from triton_omni_client import OmniClient, OmniError

from tests.support.server import documented_metrics, text_to_image

# Served at zero until something fails (the reliability suite counts them), labelled by model only.
ONLY_ON_FAILURE = {"omni_stage_restarts_total"}
# Served at zero on a CPU server: CUDA graphs exist on GPUs only (tests/gpu counts them there).
ONLY_ON_GPU = {"omni_diffusion_graph_captures_total"}
# Served at zero by a model without `compile` (tests/unit/test_compile.py counts compilations).
ONLY_WHEN_COMPILED = {"omni_diffusion_compiles_total", "omni_diffusion_compile_seconds_total"}
# Served at zero by the SD demo: step caching is for the DiT families (test_model_families counts them).
ONLY_WITH_A_STEP_CACHE = {"omni_diffusion_cached_steps_total", "omni_diffusion_skipped_step_ratio"}
# Served once a request names an adapter, a series per adapter (test_lora.py and test_ar_lora.py count them).
ONLY_WITH_ADAPTERS = {"omni_diffusion_lora_requests_total", "omni_diffusion_lora_loads_total",
                      "omni_diffusion_lora_evictions_total", "omni_ar_lora_requests_total",
                      "omni_ar_lora_loads_total", "omni_ar_lora_evictions_total"}
# the speech stage's, served by a speech demo's server (test_speech.py checks them there)
ONLY_WITH_SPEECH = {name for name in documented_metrics() if name.startswith("omni_speech_")}


def test_every_custom_metric_is_served_with_counts_after_a_mixed_run(server):
    client = OmniClient(server.grpc_url)
    list(client.generate("hello", modalities=["text", "image"], max_tokens=4, num_inference_steps=2))
    text_to_image(server.http_url, "http", "a fox", num_inference_steps=2)
    with pytest.raises(OmniError):  # refused by admission, for omni_rejected_requests_total
        list(client.generate("a fox", modalities=["image"], model="omni_small_budget", num_inference_steps=2))

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    metrics = documented_metrics()
    assert len(metrics) >= 15
    for name, kind in metrics.items():
        sample = name + ("_count" if kind == "histogram" else "")
        values = [float(v) for v in re.findall(rf"^{sample}{{[^}}]*}} (\S+)$", text, flags=re.M)]
        if name in ONLY_WITH_ADAPTERS | ONLY_WITH_SPEECH:
            continue
        assert values, f"{name} is not served"
        if name in ONLY_ON_FAILURE:
            assert re.search(rf'^{sample}{{model="[^"]+"}}', text, flags=re.M), f"{name} lacks its model label"
            continue
        if kind != "gauge" and name not in ONLY_ON_GPU | ONLY_WITH_A_STEP_CACHE | ONLY_WHEN_COMPILED:
            assert sum(values) > 0, f"{name} has no counts"
        assert re.search(rf'^{sample}{{[^}}]*model="[^"]+"[^}}]*version="1"', text, flags=re.M), \
            f"{name} lacks its model/version labels"
        if name.startswith(("omni_ar_", "omni_diffusion_")):  # a stage's: where it ran
            assert re.search(rf'^{sample}{{[^}}]*device="cpu"', text, flags=re.M), f"{name} lacks its device label"
