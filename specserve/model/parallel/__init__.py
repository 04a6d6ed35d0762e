"""Tensor parallelism inside the model: the process group and its collectives
(parallel_state.py), which part of the weights each rank holds (sharding.py), the
vocabulary-parallel embedding and rank 0's whole copies of vocabulary weights a drafter borrows."""
