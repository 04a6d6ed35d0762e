"""CUDA-only checks of the verification math: the same random numbers on the GPU as on the
CPU, and no host sync. Run on a GPU machine by scripts/gpu_run.sh; the CPU suite ignores
this folder."""
from __future__ import annotations

import random

import torch

from specserve.verify import random as srandom
from specserve.verify.rules import apply_penalties_to_tree, verify_greedy, verify_sampling
from specserve.verify.tree import DraftTrees
from tests.test_verify import random_trees


def test_random_numbers_same_on_cuda() -> None:
    seeds, positions = torch.arange(64) * 1_000_003 - 5, torch.arange(64) * 3
    cpu = srandom.uniform(seeds, positions, 2, (1000,), dtype=torch.float64)
    cuda = srandom.uniform(seeds.cuda(), positions.cuda(), 2, (1000,), dtype=torch.float64)
    assert torch.equal(cpu, cuda.cpu())


def test_coupled_tokens_same_on_cuda() -> None:
    """The token a seed gives at a position (the plain sampler's, the coupled verifier's) is
    the same on the GPU as on the CPU, over a vocabulary of many race blocks."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 3, 50_000, generator=gen) * 3, -1)
    seeds, positions = torch.arange(64) * 7_919, torch.arange(192).view(64, 3) + 11
    cpu = srandom.exponential_race(probs, seeds, positions)
    cuda = srandom.exponential_race(probs.cuda(), seeds.cuda(), positions.cuda())
    # block masses are float32 sums, whose rounding may differ by device: a near-tie may go
    # the other way, nothing more
    assert (cpu == cuda.cpu()).float().mean() >= 0.98


def test_no_host_sync_on_cuda() -> None:
    rng = random.Random(9)
    bs, n, vocab = 16, 8, 1000
    lists = random_trees(rng, bs, n, vocab)
    tokens, parents, num_nodes = (t.cuda() for t in (lists.tokens, lists.parents, lists.num_nodes))
    logits = torch.randn(bs, n, vocab, device="cuda")
    q = torch.softmax(torch.randn(bs, n, vocab, device="cuda"), -1)
    ones, zeros = torch.ones(bs, device="cuda"), torch.zeros(bs, device="cuda")
    ks, seeds = torch.full((bs,), 5, device="cuda"), torch.arange(bs, device="cuda")
    counts, prompt = torch.zeros(bs, vocab, dtype=torch.long, device="cuda"), torch.zeros(bs, vocab, dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trees = DraftTrees.build(tokens, parents, num_nodes)
        trees.positions(seeds)
        verify_greedy(trees, logits)
        penalised = apply_penalties_to_tree(logits, trees, counts, prompt, ones, zeros, zeros)
        verify_sampling(trees, penalised, ones, ks, ones * 0.9, zeros, seeds, seeds)
        verify_sampling(trees, penalised, ones, ks, ones * 0.9, zeros, seeds, seeds, rule="rejection")
        verify_sampling(trees, logits, ones, ks, ones, zeros, seeds, seeds, q, rule="rejection")
    finally:
        torch.cuda.set_sync_debug_mode("default")
