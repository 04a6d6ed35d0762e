"""`python -m specserve.launch_server --model-path M --port 30000 [ServerArgs flags]`."""
from specserve.server.launch import main

if __name__ == "__main__":
    main()
