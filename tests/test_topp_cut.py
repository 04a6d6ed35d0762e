"""lab/topp_cut.py's sort-free top-k / top-p cut keeps exactly the tokens of its definition through
a stable sort (integer masses, ties by lowest id): rows with top-p, top-k, both, neither, ties
at the cut, a row where one token holds nearly all the mass (Triton's interpreter on the CPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import torch

from lab.topp_cut import radix_keep, sorted_keep

DEVICE = torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")


def test_the_radix_cut_keeps_the_sorted_definitions_tokens():
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(8, vocab, generator=gen) * 2.5
    logits[5, :40] = 12.0                     # 40 tied tokens, the row's largest: the cut falls among them
    logits[6, 7] = 30.0                       # one token holds nearly all the mass
    logits[7] = torch.round(logits[7])        # many ties throughout
    probs = torch.softmax(logits, -1)
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.99, 0.7])
    top_ks = torch.tensor([0, 10, 0, 50, 0, 17, 0, 100])
    expected = sorted_keep(probs, top_ks, top_ps)
    got = radix_keep(probs.to(DEVICE), top_ks.to(DEVICE), top_ps.to(DEVICE), block=64).cpu()
    assert torch.equal(got, expected), (got.sum(-1), expected.sum(-1))
    counts = expected.sum(-1).tolist()
    assert counts[1] == 10 and counts[4] == vocab and counts[6] == 1, counts
    assert expected[5].nonzero().flatten().tolist() == list(range(counts[5])) and 1 < counts[5] < 17, counts   # ties by id
