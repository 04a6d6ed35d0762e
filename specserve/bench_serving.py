"""`python -m specserve.bench_serving [SGLang's bench_serving flags]`: see specserve/bench/serving.py."""
from specserve.bench.serving import main
from specserve.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
