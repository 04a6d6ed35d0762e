"""draft_argmax: a greedy draft's argmax and its draft-to-target id map in one kernel equals
torch's argmax and gather, ties to the lowest index (Triton's interpreter on the CPU; with
TRITON_INTERPRET=0 on a GPU machine, the compiled kernel)."""
from __future__ import annotations

import os

INTERPRET = os.environ.setdefault("TRITON_INTERPRET", "1") == "1"  # before the kernel is defined; 0 on a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve.speculative.model_drafters import draft_argmax  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [1000, 4096])
def test_argmax_to_target_equals_torchs_argmax_and_gather(dtype, vocab_size):
    torch.manual_seed(vocab_size)
    logits = torch.randn(5, vocab_size + 3, device=DEVICE).to(dtype)[:, :vocab_size]   # rows with a stride of their own
    logits[1, 10] = logits[1, 900] = logits[1].max() + 1     # a tie: the lower index wins, as torch.argmax's
    vocab = torch.randperm(3 * vocab_size, device=DEVICE)[:vocab_size]
    assert draft_argmax.fits(logits)
    expected = logits.argmax(dim=-1)
    assert int(expected[1]) == 10
    assert torch.equal(draft_argmax.argmax_to_target(logits, None), expected)
    assert torch.equal(draft_argmax.argmax_to_target(logits, vocab), vocab[expected])


def test_vocabularies_past_one_block_are_left_to_torch():
    assert not draft_argmax.fits(torch.zeros(1, draft_argmax.MAX_VOCAB + 1))
    assert not draft_argmax.fits(torch.zeros(4, 8).t())   # columns not contiguous
    assert draft_argmax.fits(torch.zeros(2, draft_argmax.MAX_VOCAB))
