# triton-omni: `make serve` serves the demo models, `make test` runs the tests.
# Both install what they need into .venv first (fast when nothing changed).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.triton-omni-installed

.PHONY: install serve test test-unit test-reliability lint demo-models clean bench-pipelines bench-single-image loadtest perf

install: $(STAMP)

$(STAMP): scripts/install.sh scripts/install_perf.sh requirements/cpu.lock requirements/gpu.txt pyproject.toml
	PYTHON=$(PYTHON) scripts/install.sh $(VENV)
	@touch $@

serve: install
	$(BIN)/omni-triton serve

test: install
	$(BIN)/pytest

test-unit: install
	$(BIN)/pytest tests/unit

# The reliability suite in full: every Python model's stub killed under load,
# every bad input on both protocols (make test runs a short version).
test-reliability: install
	TRITON_OMNI_RELIABILITY=long $(BIN)/pytest tests/reliability -s

lint: install
	$(BIN)/ruff check .

# Per-hop overhead of the text_to_image ensemble and the omni BLS against
# calling the stages directly (docs/pipelines.md).
bench-pipelines: install
	$(BIN)/python benchmarks/pipeline_overhead.py --json .cache/pipeline-overhead.json

# One generate-image at the demo defaults through Triton against the runner
# called directly, unpadded (docs/benchmarks.md).
bench-single-image: install
	$(BIN)/python benchmarks/single_image.py --requests 10 --json .cache/single-image.json

# Locust, headless, both users against the embedded server; CSVs in .cache/loadtest/.
loadtest: install
	$(BIN)/python loadtest/run.py

# Triton's perf_analyzer against ar_encoder, diffusion, text_to_image and ar,
# genai-perf against ar in both input formats; reports in .cache/perf/.
perf: install
	scripts/install_perf.sh $(VENV) --genai-perf
	$(BIN)/omni-triton perf --out .cache/perf --concurrency 4 --request-count 40

demo-models: install
	$(BIN)/omni-triton build-demo-models

clean:
	rm -rf .cache .pytest_cache
