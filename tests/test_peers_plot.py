"""peers_plot: the ratio picture is drawn from measured cells only, and its absence (no
matplotlib, nothing measured on both sides) is a False, not an error."""
from __future__ import annotations

import sys

from specserve.bench.peers_plot import plot_ratios


def label(workload: str, turn: int) -> str:
    return f"{workload} t{turn}"


def test_nothing_measured_on_both_sides_draws_nothing(tmp_path):
    path = tmp_path / "ratio.png"
    assert plot_ratios([(("m", "code-types", 1, 8), None)], label, str(path)) is False
    assert not path.exists()


def test_without_matplotlib_the_report_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ImportError
    path = tmp_path / "ratio.png"
    assert plot_ratios([(("m", "code-types", 1, 8), 0.9)], label, str(path)) is False
    assert not path.exists()


def test_a_png_is_written_where_matplotlib_exists(tmp_path):
    path = tmp_path / "ratio.png"
    drawn = plot_ratios([(("m", "a", 1, 1), 0.5), (("m", "b", 1, 8), 2.0), (("n", "a", 2, 64), 1.1)],
                        label, str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert drawn is False
    else:
        assert drawn is True and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
