"""`python -m specserve.bench_offline`: see specserve/bench/offline.py."""
from specserve.bench.offline import main

if __name__ == "__main__":
    main()
