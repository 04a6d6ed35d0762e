"""The serving processes exempt their start-up objects from full garbage collections."""
from __future__ import annotations

import gc
import weakref

from specserve.engine.engine_process import EngineProcess
from specserve.gc_pauses import freeze_long_lived_objects, long_lived_objects_frozen
from tests.spec_fixtures import make_tiny_directory
from tests.test_engine_process import process_args


class _Node:
    pass


def test_frozen_objects_are_not_collected_until_unfrozen():
    node = _Node()
    node.self = node            # a reference cycle: only the cyclic collector frees it
    alive = weakref.ref(node)
    try:
        assert freeze_long_lived_objects() > 0
        del node
        gc.collect()
        assert alive() is not None   # exempt: a full collection no longer walks it
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None


def test_a_benchmark_freezes_while_one_engine_serves_and_gives_it_back_afterwards():
    node = _Node()
    node.self = node
    alive = weakref.ref(node)
    with long_lived_objects_frozen() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None   # what the block's engine held is freed once dropped


def test_the_engine_process_freezes_after_start_up(tmp_path):
    make_tiny_directory(tmp_path, vocab_size=512)
    with EngineProcess(process_args(tmp_path, skip_server_warmup=True)) as engine:
        assert engine.get_server_info()["gc_frozen_objects"] > 10_000
    assert gc.get_freeze_count() == 0      # this process (tests build and drop engines) never freezes
