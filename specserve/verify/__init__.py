"""Verification, one floor below the runner, the drafters and the sampler: draft trees and
their device form (tree.py), the greedy and exact-sampling acceptance rules (rules.py), the
logit filters and the counter-based random numbers the rules draw (filters.py, random.py, its
hash's constants in splitmix.py), and the Triton kernels that run them on a GPU (tree_kernels.py,
random_kernels.py)."""
