"""The tensor-parallel ranks beside the runner: rank 0 starts and watches the worker
processes (launcher.py), each worker runs the same runner on its shard (worker.py), and
every forward's inputs or CUDA-graph replay go from rank 0 to the workers
(step_broadcast.py, graph_steps.py)."""
