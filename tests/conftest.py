"""Shared fixtures: the real SmolLM2 model (our loader and transformers' reference) and
engines over it, created once per test session because loading costs seconds.

`make test` (tests/run_suite.py) runs each long file that loads SmolLM2 in its own process
and the short ones a few to a process; engines a test makes are freed when the test ends
(_free_engines_made_by_the_test), engines a file's module fixtures make when the file ends
(_free_engines_made_by_the_module), so a process holds one file's engines at a time."""
from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# OMP_NUM_THREADS where set: run_suite.py sets it to a process's share of the cores
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, min(4, os.cpu_count() or 1)))

# run_suite.py's kernel group (under Triton's interpreter) records what its kernel tests launch, and
# test_gpu_compile.py, last in that process, compiles those launches for an H100 instead of running the
# kernel tests again
RECORD_KERNEL_SPECS = os.environ.get("SPECSERVE_RECORD_KERNEL_SPECS") == "1"
if RECORD_KERNEL_SPECS:
    from tests import gpu_compile_check
    gpu_compile_check.start_recording()


def pytest_collection_modifyitems(items):
    """Tests marked `after_kernel_tests` run last (see RECORD_KERNEL_SPECS)."""
    items.sort(key=lambda item: item.get_closest_marker("after_kernel_tests") is not None)


def pytest_runtest_setup(item):
    if RECORD_KERNEL_SPECS:
        gpu_compile_check.test_file_started(item.path.name)


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
    """transformers' own load of the GGUF (fp32), the reference. Parsing a GGUF takes
    transformers ~20 s a process (its tokenizer most of it); what it loaded is saved once,
    under build/test-cache (bench.gguf_to_hf, the same weights bit for bit), and every test
    process after the first reads that in under a second."""
    import transformers
    from specserve.bench.gguf_to_hf import convert
    directory = convert(smollm2_path, os.path.join(ROOT, "build", "test-cache", "smollm2-float32"), "float32")
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """A plain fp32 engine over SmolLM2 with a roomy cache."""
    from specserve.engine.engine import Engine
    engine = Engine(model_path=smollm2_path, dtype="float32", device="cpu", max_total_tokens=16384, log_level="warning")
    yield engine
    engine.shutdown()


# ---- extra engines for the engine API tests (test_engine_sampling / _errors / test_kv_accounting) ----
@pytest.fixture(scope="session")
def engine_factory(smollm2_path, smollm2_checkpoint):
    """`engine_factory(**server_args)` makes an fp32 CPU engine over SmolLM2 (e.g. with a tiny KV cache)
    from the session's already-loaded checkpoint instead of parsing the GGUF again, and over the
    weights the process's first such engine built (spec_fixtures.shared_model_build: its own
    modules, the same read-only tensors; ~6 s less an engine); every engine it made is shut down
    at the end of the session."""
    import copy
    import dataclasses
    from unittest import mock

    from specserve.engine import builder
    from specserve.engine.engine import Engine
    from specserve.runner import model_runner
    from tests.spec_fixtures import shared_model_build

    def reuse_checkpoint(model_path, dtype, device="cpu"):
        assert model_path == smollm2_path and dtype == torch.float32, (model_path, dtype)
        # the builder drops state_dict from what it gets: hand it a copy; and one tokenizer per engine thread
        return dataclasses.replace(smollm2_checkpoint, state_dict=dict(smollm2_checkpoint.state_dict),
                                   tokenizer=copy.deepcopy(smollm2_checkpoint.tokenizer))

    engines = []

    def make(**server_args):
        kwargs = {"dtype": "float32", "device": "cpu", "log_level": "warning", **server_args}
        with mock.patch.object(builder, "load_checkpoint", reuse_checkpoint), \
                mock.patch.object(model_runner, "build_model", shared_model_build(model_runner.build_model)):
            engine = Engine(model_path=smollm2_path, **kwargs)
        engines.append(engine)
        return engine

    make.engines = engines   # for _free_engines_made_by_the_test and _free_engines_made_by_the_module
    _factories.append(make)
    yield make
    _factories.remove(make)
    for engine in engines:
        engine.shutdown()


_factories: list = []   # the session's engine_factory once made (a module fixture may make it first)


@pytest.fixture(scope="module", autouse=True)
def _free_engines_made_by_the_module():
    """Engines that a file's module fixtures made with engine_factory are shut down when the
    file ends, as when each file had a process of its own, so that the next file in a shared
    process does not start with them still alive. (Autouse, so set up before the file's other
    module fixtures and torn down after them.)"""
    before = len(_factories[0].engines) if _factories else 0
    yield
    if not _factories:
        return
    engines = _factories[0].engines
    made, engines[before:] = engines[before:], []
    if not made:
        return
    for engine in made:
        engine.shutdown()
    del made
    gc.collect()
    _return_free_memory()


@pytest.fixture(autouse=True)
def _free_engines_made_by_the_test(request):
    """An engine that a test makes with engine_factory (~1 GB: SmolLM2's fp32 weights and
    their packed copy) is shut down and let go when the test ends, so a file's engines do
    not pile up. Engines of module fixtures exist before this fixture runs (pytest sets up
    wider scopes first) and stay."""
    if "engine_factory" not in request.fixturenames:
        yield
        return
    engines = request.getfixturevalue("engine_factory").engines
    before = len(engines)
    yield
    made, engines[before:] = engines[before:], []
    for engine in made:
        engine.shutdown()
    del made
    gc.collect()
    _return_free_memory()


def _return_free_memory() -> None:
    """glibc keeps freed weights in its heap (tensors of a few MB come from it once larger
    blocks were freed); malloc_trim hands the free pages back, so the next engine does not
    add to the peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass
