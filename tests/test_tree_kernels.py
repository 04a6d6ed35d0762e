"""The verify step's tree kernels (verify/tree_kernels.py) compute exactly what the torch
reference does: DraftTrees.build, and commit_path(verify_greedy(...)) with its table writes
(Triton's interpreter on the CPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import random
from dataclasses import fields

import pytest
import torch

from specserve.kv.pool import PADDING_SLOT
from specserve.runner.tree_step import TreeStepInputs, commit_path, greedy_commit
from specserve.verify import tree_kernels
from specserve.verify.rules import verify_greedy
from specserve.verify.tree import DraftTrees, TreeProposal

DEVICE = torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")
VOCAB = 5          # few tokens: children often match, several at once
MAX_CONTEXT = 64


class _Pool:
    """What commit_path uses of a KVPool: the table (random contents) and its scratch row (the last one)."""

    def __init__(self, scratch_row: int, device: torch.device):
        self.scratch_row = scratch_row
        gen = torch.Generator().manual_seed(scratch_row)
        self.req_to_token = torch.randint(0, 1000, (scratch_row + 1, MAX_CONTEXT), dtype=torch.int32,
                                          generator=gen).to(device)


def test_kernels_run_where_the_tensors_are():
    # a module imported earlier without TRITON_INTERPRET would have compiled the kernels for a GPU
    interpreted = type(tree_kernels._build_trees_kernel).__name__ == "InterpretedFunction"
    assert interpreted == (DEVICE.type == "cpu")


def random_tree(rng: random.Random, n: int, shape: str) -> tuple[list[int], list[int]]:
    size = rng.randint(1, n)
    if shape == "chain":
        parents = [-1] + list(range(size - 1))
    elif shape == "bushy":     # parents among the first few nodes: wide levels
        parents = [-1] + [rng.randrange(min(i, 3)) for i in range(1, size)]
    else:
        parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return [rng.randrange(VOCAB) for _ in range(size)], parents


def random_batch(seed: int, bs: int, n: int) -> TreeProposal:
    rng = random.Random(seed)
    rows = [random_tree(rng, n, rng.choice(["chain", "bushy", "any"])) for _ in range(bs)]
    proposal = TreeProposal.from_lists(rows, n)
    # padding nodes carry garbage parents (build must normalise them) and tokens
    for b, size in enumerate(proposal.num_nodes):
        proposal.parents[b, size:] = [rng.randrange(-1, n) for _ in range(n - size)]
        proposal.tokens[b, size:] = [rng.randrange(VOCAB) for _ in range(n - size)]
    return proposal


CASES = [(seed, bs, n) for seed, (bs, n) in enumerate(
    [(1, 1), (3, 1), (1, 2), (1, 8), (2, 8), (9, 8), (4, 16), (9, 16), (5, 3), (7, 5), (2, 32)])]
CASES += [(seed, random.Random(seed).randint(1, 9), random.Random(-seed).randint(1, 16)) for seed in range(20, 30)]


def tensors(proposal: TreeProposal) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a.copy()).to(DEVICE) for a in (proposal.tokens, proposal.parents, proposal.num_nodes))


def reference_trees(proposal: TreeProposal) -> DraftTrees:
    return DraftTrees.build(*(t.cpu() for t in tensors(proposal)))


def assert_trees_equal(got: tuple[torch.Tensor, ...], expected: DraftTrees) -> None:
    names = ["parents", "depth", "ancestor_mask", "first_child", "next_sibling"]
    for name, tensor in zip(names, got):
        want = getattr(expected, name)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor.cpu(), want), name


@pytest.mark.parametrize("seed,bs,n", CASES)
def test_build_trees_matches_torch(seed, bs, n):
    proposal = random_batch(seed, bs, n)
    _, parents, num_nodes = tensors(proposal)
    assert_trees_equal(tree_kernels.build_trees(parents, num_nodes), reference_trees(proposal))


def test_build_trees_reads_strided_inputs():
    """DraftTrees.chain hands in expanded parents (stride 0) and int32 counts."""
    bs, n = 3, 6
    parents = (torch.arange(n, device=DEVICE) - 1).expand(bs, n)
    num_nodes = torch.tensor([6, 1, 4], dtype=torch.int32, device=DEVICE)
    expected = DraftTrees.build(torch.zeros(bs, n, dtype=torch.int64), parents.cpu(), num_nodes.cpu())
    assert_trees_equal(tree_kernels.build_trees(parents, num_nodes), expected)


def step_inputs(proposal: TreeProposal, seed: int) -> tuple[TreeStepInputs, int]:
    """A graph-shaped step: the proposal's requests and two padding requests after them."""
    rng = random.Random(seed)
    bs, n = proposal.tokens.shape
    total = bs + 2
    inputs = TreeStepInputs.allocate(total, n, "cpu")
    slots = [[rng.randrange(1, 4096) if i < size else PADDING_SLOT for i in range(n)] for size in proposal.num_nodes]
    rows = rng.sample(range(total + 3), bs)
    inputs.fill(proposal, sum(slots, []), rows, [rng.randrange(0, MAX_CONTEXT - n) for _ in range(bs)],
                scratch_row=total + 3)
    return inputs, total + 3


def targets_for(trees: DraftTrees, seed: int) -> torch.Tensor:
    """The target's tokens: mostly the first child's token (long paths), else random."""
    gen = torch.Generator().manual_seed(seed)
    first = trees.tokens.gather(1, trees.first_child.clamp(min=0))
    return torch.where(torch.rand(first.shape, generator=gen) < 0.7, first,
                       torch.randint(0, VOCAB, first.shape, generator=gen))


def one_hot_logits(target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(target, max(VOCAB, int(target.max()) + 1)).float()


def check_tables(inputs: TreeStepInputs, scratch_row: int, table: torch.Tensor, expected_table: torch.Tensor) -> None:
    """Every request's row as the reference left it, the other rows untouched; of the scratch
    row only where a padding request's root goes (commit_path's other scratch writes are
    skipped: never read)."""
    table, before = table.cpu(), _Pool(scratch_row, torch.device("cpu")).req_to_token
    assert torch.equal(table[:scratch_row], expected_table[:scratch_row])
    untouched = torch.ones(scratch_row + 1, dtype=torch.bool)
    untouched[inputs.req_rows] = False
    assert untouched.sum() > 0 and torch.equal(table[untouched], before[untouched])
    if bool((inputs.req_rows == scratch_row).any()):
        assert table[scratch_row, 0] == PADDING_SLOT


def check_verify_commit(inputs: TreeStepInputs, scratch_row: int, target: torch.Tensor) -> torch.Tensor:
    trees = DraftTrees.build(inputs.tokens, inputs.parents, inputs.num_nodes)
    expected_pool = _Pool(scratch_row, torch.device("cpu"))
    expected = commit_path(verify_greedy(trees, one_hot_logits(target)), inputs, expected_pool)

    pool = _Pool(scratch_row, DEVICE)
    device_inputs = TreeStepInputs.view(inputs.packed.to(DEVICE), *inputs.shape)
    device_trees = trees.to(DEVICE)
    outcome = tree_kernels.verify_commit(target.to(DEVICE), device_trees.tokens, device_trees.parents,
                                         device_trees.depth, device_trees.ancestor_mask, device_inputs.out_slots,
                                         device_inputs.req_rows, device_inputs.prefix_lens, pool.req_to_token)
    assert outcome.dtype == torch.int64 and outcome.shape == expected.shape
    assert torch.equal(outcome.cpu(), expected)
    check_tables(inputs, scratch_row, pool.req_to_token, expected_pool.req_to_token)
    return expected


@pytest.mark.parametrize("seed,bs,n", [c for c in CASES if c[2] > 1])
def test_verify_commit_matches_torch(seed, bs, n):
    inputs, scratch_row = step_inputs(random_batch(seed, bs, n), seed)
    trees = DraftTrees.build(inputs.tokens, inputs.parents, inputs.num_nodes)
    expected = check_verify_commit(inputs, scratch_row, targets_for(trees, seed))
    assert (expected[:, 0] >= 1).all()


def test_verify_commit_lowest_matching_child_wins_and_no_match():
    # request 0: root 7 with children 1, 3, 3 (nodes 1..3), node 3 has child 4; target after the
    # root is 3: nodes 2 and 3 match, 2 wins (its child 9 matches, 3's 4 would not be reached).
    # request 1: the same tree, no child matches the target 8.
    rows = [([7, 1, 3, 3, 9, 4], [-1, 0, 0, 0, 2, 3]), ([7, 1, 3, 3, 9, 4], [-1, 0, 0, 0, 2, 3])]
    inputs, scratch_row = step_inputs(TreeProposal.from_lists(rows, 8), seed=5)
    target = torch.tensor([[3, 0, 9, 4, 6, 0, 0, 0], [8, 0, 9, 4, 6, 0, 0, 0]] + [[0] * 8] * 2)
    expected = check_verify_commit(inputs, scratch_row, target)
    assert expected[0, :4].tolist() == [3, 0, 2, 4] and expected[0, 9:12].tolist() == [3, 9, 6]
    assert expected[1, :3].tolist() == [1, 0, -1] and expected[1, 9:11].tolist() == [8, -1]


def test_greedy_step_on_the_device_matches_torch():
    """What forward_tree runs: DraftTrees.build and greedy_commit on the inputs' device (on a
    GPU: through the kernels), against the torch reference on the CPU; logits with ties."""
    inputs, scratch_row = step_inputs(random_batch(11, 6, 8), 11)
    logits = torch.randint(0, 3, (*inputs.shape, VOCAB), generator=torch.Generator().manual_seed(11)).float()
    trees = DraftTrees.build(inputs.tokens, inputs.parents, inputs.num_nodes)
    expected_pool = _Pool(scratch_row, torch.device("cpu"))
    expected = greedy_commit(trees, logits, inputs, expected_pool)

    pool = _Pool(scratch_row, DEVICE)
    device_inputs = TreeStepInputs.view(inputs.packed.to(DEVICE), *inputs.shape)
    device_trees = DraftTrees.build(device_inputs.tokens, device_inputs.parents, device_inputs.num_nodes)
    for field in fields(DraftTrees):
        assert torch.equal(getattr(device_trees, field.name).cpu(), getattr(trees, field.name)), field.name
    assert torch.equal(greedy_commit(device_trees, logits.to(DEVICE), device_inputs, pool).cpu(), expected)
    check_tables(inputs, scratch_row, pool.req_to_token, expected_pool.req_to_token)


def test_a_decode_buffer_filled_per_request_matches_the_full_fill():
    """CudaGraphRunner.launch_decode writes four fields (TreeStepInputs.fill_decode) into a
    buffer of one node per request: what the graph reads equals the full `fill`, batch after
    batch of another size (rows a larger batch left become padding again); the padding rows'
    tokens are left as they were (any token: their outputs are never read)."""
    scratch, bucket = 31, 8
    lean, full = TreeStepInputs.allocate(bucket, 1, "cpu"), TreeStepInputs.allocate(bucket, 1, "cpu")
    lean.parents.fill_(-1)   # as the graph runner sets the host buffer of a decode graph up
    lean.num_nodes.fill_(1)
    rng = random.Random(5)
    for bs in (5, 2, 8, 3):
        roots = [rng.randrange(1000) for _ in range(bs)]
        slots, rows, kv_lens = ([rng.randrange(1, 500) for _ in range(bs)] for _ in range(3))
        lean.fill_decode(roots, slots, rows, kv_lens, scratch)
        full.fill(TreeProposal.root_only(roots), slots, rows, kv_lens, scratch)
        assert torch.equal(lean.tokens[:bs], full.tokens[:bs])
        for name in ("parents", "out_slots", "num_nodes", "req_rows", "prefix_lens"):
            assert torch.equal(getattr(lean, name), getattr(full, name)), (bs, name)
        assert set(lean.out_slots[bs:, 0].tolist()) <= {PADDING_SLOT}
        tokens = lean.tokens.clone()
        lean.fill_decode(None, slots, rows, kv_lens, scratch)   # roots on the device: tokens untouched
        assert torch.equal(lean.tokens, tokens)
