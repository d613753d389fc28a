"""The load's warm-up burst (``warmup_requests``): by default a vLLM engine on a GPU is sent as many
requests as it decodes together before the model is ready, and nothing else is; a value given is
taken as given; bad values fail the load naming the parameter. (The burst itself, on the real vLLM
engine: ``tests/integration/test_ar_engine_stream.py``.)"""

import pytest
from triton_omni.ar.runner import ArRunnerConfig, warmup_burst


@pytest.mark.parametrize(("config", "engine", "expected"), [
    (ArRunnerConfig("m", device="cuda:0"), "vllm", 64),
    (ArRunnerConfig("m", device="cpu"), "vllm", 0),
    (ArRunnerConfig("m", device="cuda:0"), "transformers", 0),
    (ArRunnerConfig("m", mode="encode", device="cuda:0"), "vllm", 0),
    (ArRunnerConfig("m", device="cpu", warmup_requests=5), "transformers", 5),
    (ArRunnerConfig("m", device="cuda:0", warmup_requests=0), "vllm", 0),
])
def test_the_burst_by_default_and_as_given(config, engine, expected):
    assert warmup_burst(config, engine, max_num_seqs=64) == expected


@pytest.mark.parametrize(("values", "named"), [
    ({"warmup_requests": -1}, "warmup_requests"),
    ({"warmup_prompt_tokens": 0}, "warmup_prompt_tokens"),
])
def test_bad_values_fail_the_load_naming_the_parameter(values, named):
    with pytest.raises(ValueError, match=named):
        ArRunnerConfig("m", **values)
