"""`python -m specserve.bench_serving [SGLang's bench_serving flags]`."""
from specserve.bench.serving import main

if __name__ == "__main__":
    main()
