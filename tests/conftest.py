"""Shared fixtures: the real SmolLM2 model (our loader and transformers' reference) and
engines over it, created once per test session because loading costs seconds."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


# ---- models (core engine tests) ----
@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from specserve.model.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path):
    from specserve.model.loader import load_checkpoint
    return load_checkpoint(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    import transformers
    directory, name = os.path.split(smollm2_path)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """A plain fp32 engine over SmolLM2 with a roomy cache."""
    from specserve.engine.engine import Engine
    engine = Engine(model_path=smollm2_path, dtype="float32", device="cpu", max_total_tokens=16384, log_level="warning")
    yield engine
    engine.shutdown()
