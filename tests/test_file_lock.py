"""file_lock.exclusive: a second process waits while the first holds the lock."""
import multiprocessing
import os
import time

from specserve.bench.file_lock import exclusive


def _hold(path: str, log: str, holding) -> None:
    with exclusive(path):
        holding.set()
        with open(log, "a") as f:
            f.write("first-start\n")
        time.sleep(0.5)
        with open(log, "a") as f:
            f.write("first-end\n")


def test_a_second_holder_waits_for_the_first(tmp_path):
    path, log = str(tmp_path / "model_dir"), str(tmp_path / "log")
    holding = multiprocessing.get_context("fork").Event()
    first = multiprocessing.get_context("fork").Process(target=_hold, args=(path, log, holding))
    first.start()
    try:
        assert holding.wait(10)
        with exclusive(path):
            with open(log, "a") as f:
                f.write("second\n")
    finally:
        first.join(10)
    assert open(log).read().split() == ["first-start", "first-end", "second"]
    assert os.path.exists(path + ".lock") and not os.path.exists(path)   # the lock file only
