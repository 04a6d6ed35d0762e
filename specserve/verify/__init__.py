"""Verification, one floor below the runner and the drafters: draft trees and their device
form (tree.py), the greedy and exact-sampling acceptance rules (rules.py) and the Triton
kernels that run them on a GPU (tree_kernels.py)."""
