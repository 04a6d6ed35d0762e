"""The ragged verify step (runner/tree_step.py: forward_ragged): only the trees' real nodes
go through the model, packed into a token budget, and the step's logits, greedy outcome and
KV-table commit equal those of the step that runs every request's n nodes. Also the layout
it derives, the cut of a proposal to per-request node counts and the level a step of so
many nodes replays (graphs) or is priced at (the adaptive policy)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kv.pool import PADDING_SLOT
from specserve.runner.tree_step import TreeStepInputs, forward_tree, pad_node_slots, ragged_layout
from specserve.verify.tree import TreeProposal, smallest_level
from tests.spec_fixtures import make_tiny_directory, tiny_engine
from tests.test_tree_kernels import random_batch


def test_ragged_layout_packs_real_nodes_request_after_request():
    token_nodes, node_rows = ragged_layout(torch.tensor([3, 1, 2]), 4, 8)
    # request 0: nodes 0-2 (flat 0-2), request 1: its root (flat 4), request 2: two nodes (flat 8, 9)
    assert token_nodes.tolist() == [0, 1, 2, 4, 8, 9, 12, 12]   # 12 = bs * n: padding tokens
    assert node_rows.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 0, 0]]


def test_smallest_level_holds_the_nodes():
    levels = [2, 4, 8, 16]
    assert smallest_level(levels, 64, 64 + 10 * 7) == 4     # 134 nodes > 128
    assert smallest_level(levels, 64, 128) == 2
    assert smallest_level(levels, 1, 5) == 8
    assert smallest_level(levels, 4, 200) == 16             # more than the largest holds: the largest


def test_a_proposal_cut_per_request_keeps_trees():
    proposal = TreeProposal.from_lists([([1, 2, 3, 4], [-1, 0, 1, 1]), ([5, 6], [-1, 0]), ([7, 8, 9], [-1, 0, 0])])
    cut = proposal.cut([3, 1, 8])
    assert cut.num_nodes.tolist() == [3, 1, 3] and cut.num_slots == 3
    trees = cut.trees()
    assert trees.parents.tolist() == [[-1, 0, 1], [-1, -1, -1], [-1, 0, 0]]   # cut nodes are padding


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ragged")
    make_tiny_directory(path, "llama", seed=4)
    with tiny_engine(path, max_total_tokens=2048) as engine:
        yield engine.core.runner


def step_inputs(runner, proposal: TreeProposal, prefix_lens: list[int], seed: int) -> TreeStepInputs:
    """The proposal's trees over random prefixes: rows whose table entries point at random
    slots holding random K/V, and distinct slots for the nodes."""
    pool, gen = runner.pool, torch.Generator().manual_seed(seed)
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.dtype))
    rows = [pool.alloc_row() for _ in prefix_lens]
    slots = pool.slots.alloc(sum(prefix_lens) + int(proposal.num_nodes.sum()))
    start = 0
    for row, prefix in zip(rows, prefix_lens):
        pool.write_positions(row, 0, torch.tensor(slots[start:start + prefix], dtype=torch.int32))
        start += prefix
    bs, n = proposal.tokens.shape
    inputs = TreeStepInputs.allocate(bs, n, "cpu")
    inputs.fill(proposal, pad_node_slots(slots[start:], proposal.num_nodes, n), rows, prefix_lens,
                pool.scratch_row)
    return inputs


@pytest.mark.parametrize("spare", [0, 5])   # padding tokens after the real nodes
def test_a_ragged_step_equals_the_step_over_every_node(runner, spare):
    proposal = random_batch(7, 5, 6)
    proposal = proposal.cut([6, 1, 3, 1, 6])     # requests of 1 node beside whole trees
    proposal = TreeProposal(np.where(proposal.tokens > 0, proposal.tokens % 200 + 1, 0), proposal.parents,
                            proposal.num_nodes)  # tokens the tiny vocabulary holds
    prefix_lens = [9, 3, 17, 0, 5]
    inputs = step_inputs(runner, proposal, prefix_lens, seed=spare)
    pool, backend, model = runner.pool, runner.attn_backend, runner.model
    table = pool.req_to_token.clone()
    whole = forward_tree(model, backend, pool, inputs, backend.plan, prefix_lens)
    whole_table = pool.req_to_token.clone()
    pool.req_to_token.copy_(table)
    num_nodes = proposal.num_nodes.tolist()
    ragged = forward_tree(model, backend, pool, inputs, backend.plan, prefix_lens,
                          token_budget=sum(num_nodes) + spare, num_nodes_host=num_nodes)
    assert ragged.token_logits.shape[0] == sum(num_nodes) + spare
    real = torch.arange(proposal.num_slots) < torch.tensor(num_nodes).unsqueeze(1)
    torch.testing.assert_close(ragged.logits[real], whole.logits[real], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(ragged.token_logits).all()               # padding tokens included
    assert torch.equal(ragged.outcome, whole.outcome)
    assert torch.equal(pool.req_to_token, whole_table)             # the accepted paths' slots, nothing else
    assert ragged.node_logits(2, 3).shape == (2, 3, whole.logits.shape[-1])
    assert set(inputs.out_slots[~real].tolist()) == {PADDING_SLOT}


def test_steps_that_cut_some_drafts_keep_greedy_output_and_free_every_slot(tmp_path):
    """Drafting steps where every other request verifies its root alone (a ragged cut, forced
    on the policy's choice) give plain decoding's tokens, and every KV slot comes back."""
    from tests.spec_fixtures import ngram_args, plain_greedy_outputs, price_steps, wait_until_all_kv_is_free
    from tests.test_step_kv_writes import GREEDY, PROMPTS
    make_tiny_directory(tmp_path, "llama", seed=3)
    expected = plain_greedy_outputs(tmp_path, PROMPTS, GREEDY)
    with tiny_engine(tmp_path, max_total_tokens=4096, **ngram_args(8, adaptive=True)) as engine:
        price_steps(engine, 0.010, 0.0001)
        adaptive, cuts = engine.core.adaptive, []
        choose_nodes = adaptive.choose_nodes

        def cutting(rids, num_nodes, keys=None):
            nodes = [1 if i % 2 else n for i, n in enumerate(choose_nodes(rids, num_nodes, keys))]
            cuts.append(nodes)
            return nodes
        adaptive.choose_nodes = cutting
        runner, verified = engine.core.runner, []
        run_trees = runner.run_trees

        def spying(reqs, proposal, *args, **kwargs):
            verified.append(proposal.num_nodes.tolist())
            return run_trees(reqs, proposal, *args, **kwargs)
        runner.run_trees = spying
        for _ in range(2):   # the second pass drafts from the first's outputs
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == expected
        drafted = [nodes for nodes in verified if len(nodes) > 1 and max(nodes) > 1]
        assert drafted and all(set(nodes[1::2]) == {1} for nodes in drafted)   # the cuts reached the steps
        wait_until_all_kv_is_free(engine)
