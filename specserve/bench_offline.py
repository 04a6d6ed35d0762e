"""`python -m specserve.bench_offline`: see specserve/bench/offline.py."""
from specserve.bench.offline import main
from specserve.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
