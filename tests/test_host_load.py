"""bench/host_load.py: the busy-loop processes run for the block and are gone after it."""
import pytest

from specserve.bench.host_load import busy_host


def test_busy_processes_run_for_the_block_and_are_killed_after_it():
    with busy_host(2) as processes:
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)


def test_no_load_starts_nothing_and_a_negative_one_is_refused():
    with busy_host(0) as processes:
        assert processes == []
    with pytest.raises(ValueError, match="host load"):
        with busy_host(-1):
            pass
