"""scripts/gpu_run.sh's modes that run another tree's code (AB_TREE, AB_OLD) must import that tree.

`python3 -m` puts the working directory (the checkout) first on sys.path, ahead of PYTHONPATH, so a
tree named only on PYTHONPATH was never imported: every tree A/B from 2026-11-28 to 2026-12-06 ran the
checkout's code on both sides. `python3 -P` leaves the working directory out."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_run.sh"


def test_every_run_of_a_named_tree_leaves_the_checkout_off_sys_path():
    tree_runs = [line for line in SCRIPT.read_text().splitlines()
                 if re.search(r"PYTHONPATH=/tmp/site:(\$1|\$PWD/\$root|\$root)\b", line)]
    assert tree_runs, "the tree modes moved: update this test"
    for line in tree_runs:
        # a run in the tree's own directory needs no -P (step-cost-ab cds into it)
        assert "python3 -P " in line or 'cd "$root"' in line or "chain_rows" in line, line
    chain_rows = re.search(r"chain_rows\(\) \{.*?\n\}", SCRIPT.read_text(), re.S).group(0)
    assert "python3 -P -m specserve.bench.model_drafters" in chain_rows


def test_dash_p_imports_the_tree_on_pythonpath(tmp_path):
    """What the script relies on: with -P a package on PYTHONPATH wins over one in the working directory."""
    for where in ("checkout", "tree"):
        package = tmp_path / where / "probe_pkg"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"WHERE = {where!r}\n")
    env = {"PYTHONPATH": str(tmp_path / "tree")}
    code = "import probe_pkg; print(probe_pkg.WHERE)"
    ran = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path / "checkout", env=env,
                         capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "tree"
    ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "checkout", env=env,
                         capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "checkout"   # without -P the working directory wins
