"""`make test`'s runner: files that load a model run alone (the short ones a few to a process),
the rest together, and the totals end in the closing line CI reads."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_suite  # noqa: E402  (a script beside this file, not a package module)


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_files_that_load_a_model_run_alone(tmp_path):
    light = [write(tmp_path / f"test_l{i}.py", "def test_x():\n    assert True\n") for i in range(2)]
    heavy = write(tmp_path / "test_h.py", "def test_x(engine_factory):\n    engine_factory()\n")
    kernel = write(tmp_path / "test_gemv.py", "def test_x():\n    assert True\n")
    assert run_suite.groups([*light, heavy, kernel]) == [[kernel], light, [heavy]]


def test_short_files_that_load_a_model_share_processes_longest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(run_suite, "SECONDS", {"test_long.py": 500, "test_a.py": 70, "test_b.py": 60,
                                               "test_c.py": 50, "test_d.py": 40})
    monkeypatch.setattr(run_suite, "SHARED_BELOW", 80)
    monkeypatch.setattr(run_suite, "SHARED_PROCESS", 150)
    heavy = {name: write(tmp_path / name, "def test_x(engine_factory):\n    engine_factory()\n")
             for name in ("test_long.py", "test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_e.py")}
    groups = run_suite.groups(sorted(heavy.values()))
    # first-fit decreasing: a (70) + b (60), then c (50) and d (40) need another, e (unknown: 20) fills the first
    assert groups == [[heavy["test_long.py"]], [heavy["test_a.py"], heavy["test_b.py"], heavy["test_e.py"]],
                      [heavy["test_c.py"], heavy["test_d.py"]]]
    assert [run_suite.expected_seconds(g) for g in groups] == [500, 150, 90]


def test_a_group_reports_its_counts_and_a_broken_file_fails_alone(tmp_path):
    good = write(tmp_path / "test_good.py", "def test_a():\n    assert True\n\ndef test_b():\n    assert 1 == 2\n")
    broken = write(tmp_path / "test_broken.py", "import no_such_module_anywhere\n")
    counts, summary, status, _ = run_suite.run_group([good, broken], [])
    assert status == 1 and counts["passed"] == 1 and counts["failed"] == 1 and counts["error"] == 1, summary


def test_the_closing_line_counts_errors_as_failures(tmp_path, capsys, monkeypatch):
    failing = write(tmp_path / "test_f.py", "def test_a():\n    assert False\n\ndef test_b():\n    pass\n")
    monkeypatch.setattr(run_suite, "ROOT", str(tmp_path))
    assert run_suite.main([failing]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "total: 1 passed, 1 failed"


def test_two_at_a_time_longest_first_each_on_its_share_of_the_cores(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_suite, "ROOT", str(tmp_path))
    monkeypatch.setattr(run_suite, "SECONDS", {**run_suite.SECONDS, "test_long.py": 1000})
    short = write(tmp_path / "test_short.py", "def test_a(engine_factory=None):\n    pass\n")
    long = write(tmp_path / "test_long.py", "def test_a(engine_factory=None):\n    pass\n")
    write(tmp_path / "conftest.py", open(os.path.join(os.path.dirname(__file__), "conftest.py")).read())
    light = write(tmp_path / "test_threads.py", "def test_t():\n    import torch\n    assert torch.get_num_threads() == 2\n")
    longest_first = sorted(run_suite.groups([short, long, light]), key=run_suite.expected_seconds, reverse=True)
    assert longest_first[0] == [long]
    monkeypatch.setattr(run_suite.os, "cpu_count", lambda: 4)   # two processes of two threads
    assert run_suite.main(["--jobs", "2", short, long, light]) == 0
    # a group's slowest tests are listed under it only past pytest's 5 ms: on a busy machine, some
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("    ")]
    assert len(lines) == 5 and "(2 at a time)" in lines[3], lines
    assert lines[-1] == "total: 3 passed, 0 failed"
