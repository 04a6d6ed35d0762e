"""Tensor parallelism: one process per rank, rank 0 in the engine's process (see launcher.py)."""
