"""EAGLE-2's dynamic tree (--speculative-eagle-topk > 1) through the Engine: greedy output
equals plain decoding, and every tree the engine verifies is the one a plain re-implementation
builds from the head alone (each path recomputed from scratch: the head's step 0 over the
request's rows with the target's states, then the path's drafts one by one; top-k children,
k best by cumulative log-probability kept per step, the best num_draft_tokens - 1 overall).
That holds only if the batched beams attend to exactly their own ancestors. Every step after
a request's first tree verifies it and drafts the next in one fused step (fused_step.py),
which feeds the head the accepted path's states, also when the step is queued before the one
it follows is read; sampled trees are verified there by the coupled rule. The head's pool
comes back whole. Heads: the ones tests/test_eagle_drafter.py trains, and a random one.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.speculative.heads.eagle_checkpoint import save_head
from specserve.training.eagle_trainer import build_head
from specserve.training.target_features import TargetFeatureExtractor
from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
from tests.fused_fixtures import FusedSpy, wait_until_fused_state_is_free
from tests.spec_fixtures import tiny_engine
from tests.test_draft_ahead import ahead_on
from tests.test_eagle_drafter import VOCAB, eagle_args, head_dir, target, wait_until_head_kv_is_free  # noqa: F401

TREES = [(2, 3, 6), (3, 3, 10), (4, 2, 5)]      # (top-k, steps, nodes)


class CausalCache:
    """The head's attention over everything fed so far, causal: a plain reference."""

    def __init__(self):
        self.keys, self.values = [], []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys), torch.cat(self.values)            # (T, kv_heads, head_dim)
        group = q.shape[1] // k.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        total, new = keys.shape[0], q.shape[0]
        mask = torch.arange(total).view(1, -1) <= torch.arange(total - new, total).view(-1, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask)
        return out.transpose(0, 1)


def path_state(head, states: torch.Tensor, next_tokens: torch.Tensor, path: list[int]) -> torch.Tensor:
    """The head's output after its rows (step 0) and then the drafts of `path`."""
    attend, rows = CausalCache(), len(next_tokens)
    hidden = head.step(next_tokens, head.project(states), torch.arange(rows), attend)[-1:]
    for i, token in enumerate(path):
        hidden = head.step(torch.tensor([token]), hidden, torch.tensor([rows + i]), attend)
    return hidden


def reference_tree(head, states, next_tokens, topk: int, steps: int, nodes: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the draft nodes, best first, parents as node numbers (0: the root)."""
    def children(path, score):
        logp = torch.log_softmax(head.logits(path_state(head, states, next_tokens, path)).float(), -1)[0]
        values, ids = logp.topk(topk)
        return [(score + v.item(), int(head.to_target_ids(i))) for v, i in zip(values, ids)]

    candidates = []                       # (score, depth, token, parent candidate, path)
    for score, token in children([], 0.0):
        candidates.append((score, 1, token, -1, [token]))
    frontier = list(range(topk))
    for _ in range(1, steps):
        fresh = []
        for parent in frontier:
            score, depth, _, _, path = candidates[parent]
            fresh += [(s, depth + 1, t, parent, path + [t]) for s, t in children(path, score)]
        first = len(candidates)
        candidates += fresh
        frontier = [first + i for i in sorted(range(len(fresh)), key=lambda i: -fresh[i][0])[:topk]]
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][0], candidates[i][1]))[:nodes - 1]
    number = {c: n + 1 for n, c in enumerate(order)}
    return [candidates[c][2] for c in order], [number.get(candidates[c][3], 0) for c in order]


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    """An untrained EAGLE-3 head with large random weights: its scores are far from one-hot,
    so a beam that attends to the wrong ancestors changes the tree (a trained head's peaked
    choices can survive that)."""
    _, model, _, _ = target
    torch.manual_seed(1)
    head = build_head(model, "EAGLE3", torch.arange(3, VOCAB), max_positions=64)
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.requires_grad:
                parameter.normal_(std=0.5)
    path = tmp_path_factory.mktemp("random-head")
    save_head(head, str(path))
    return "EAGLE3", str(path), head, TargetFeatureExtractor(model, head.config.aux_layers, 512, 64, 64)


@pytest.mark.parametrize("topk,steps,nodes", TREES[:2])
def test_trained_heads_trees_are_the_reference_trees(target, head_dir, topk, steps, nodes):
    check_trees(target, head_dir, topk, steps, nodes, longest_accepted=3)


@pytest.mark.parametrize("topk,steps,nodes", TREES)
def test_a_random_heads_trees_are_the_reference_trees(target, random_head, topk, steps, nodes):
    check_trees(target, random_head, topk, steps, nodes, longest_accepted=1)


@pytest.mark.parametrize("topk,steps,nodes", TREES[:2])
def test_trees_of_steps_launched_ahead_are_the_reference_trees(target, head_dir, topk, steps, nodes):
    """As on a GPU: each fused tree step is queued before the step it follows is read, its
    tree derived on the device from that step's outcome (fused_step.chain_inputs)."""
    check_trees(target, head_dir, topk, steps, nodes, longest_accepted=3, ahead=True)


def test_a_tree_smaller_than_its_depth_is_verified_by_the_engine(target, random_head):
    """A tree of fewer nodes than K + 1 levels (top-k 2, 5 steps, 4 nodes) cannot feed the
    head its whole accepted path from the tree's nodes: EagleDrafter's unfused tree serves it."""
    check_trees(target, random_head, 2, 5, 4, longest_accepted=1, fused=False)


def test_fused_trees_turned_off_take_the_unfused_trees(target, random_head, monkeypatch):
    """SPECSERVE_FUSED_TREES=0 (read at import: draft_setup.FUSED_TREES), for an A/B of the two."""
    from specserve.speculative.model_drafters import draft_setup
    monkeypatch.setattr(draft_setup, "FUSED_TREES", False)
    check_trees(target, random_head, 2, 3, 6, longest_accepted=1, fused=False)


def check_trees(target, head_dir, topk: int, steps: int, nodes: int, longest_accepted: int, ahead: bool = False,
                fused: bool = True, **engine_args) -> None:
    """Greedy output equals plain decoding, the verified trees equal reference_tree's, the
    head's pool comes back whole; some step accepted longest_accepted tokens. `fused`: every
    step after a request's first drafts verified and drafted the next tree in one fused step
    (fused_step.py), launched ahead of the read (chained) where the engine does (`ahead`: on the CPU too)."""
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = head_dir
    proposals = []
    with tiny_engine(path, **eagle_args(algorithm, head_path, speculative_num_steps=steps,
                                        speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes),
                     **engine_args) as engine:
        drafter = engine.core.drafter
        assert isinstance(drafter, FusedChainDrafter) == fused
        if ahead:
            ahead_on(engine)
        chains = engine.core.draft_ahead is not None   # steps launched ahead: a GPU engine's, or `ahead`
        spy = FusedSpy(drafter) if fused else None

        def spied(propose):
            def proposing(reqs, *args):
                proposal, num_nodes = propose(reqs, *args)
                proposals.extend((r.prompt_ids + r.output_ids, proposal.tokens[i, 1:].tolist(),
                                  proposal.parents[i, 1:].tolist())
                                 for i, (r, n) in enumerate(zip(reqs, num_nodes)) if n == nodes)
                return proposal, num_nodes
            return proposing
        drafter.propose = spied(drafter.propose)
        if fused:   # a chained step's tree, on the host once the step before is read
            drafter.chained_proposal = spied(drafter.chained_proposal)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out[:4]],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out[:4]]
        assert max(n for o in outputs for n in o["meta_info"]["spec_accept_histogram"]) >= longest_accepted
        if fused:
            wait_until_fused_state_is_free(engine)
        wait_until_head_kv_is_free(engine)
    if fused:
        assert spy.engine == 0 and spy.fused == sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
        assert (spy.chained > 0) == chains, spy.chained
    assert len(proposals) >= 8
    with torch.no_grad():
        for context, tokens, parents in proposals[::2]:
            states = extractor([context]).layers if head.config.aux_layers else extractor([context]).final
            expected = reference_tree(head, states[:-1], torch.tensor(context[1:]), topk, steps, nodes)
            assert (tokens, parents) == expected, f"context of {len(context)} tokens"




@pytest.mark.parametrize("ahead", [False, True], ids=["read", "chained"])
def test_sampled_trees_are_verified_in_the_fused_step_by_the_coupled_rule(target, head_dir, monkeypatch, ahead):
    """A tree's drafts are the head's top-k, never sampled: a sampled batch's fused steps
    verify them by the coupled rule without a q, and a seed gets plain decoding's tokens,
    whether a step is queued before the one before it is read or not."""
    import specserve.speculative.model_drafters.fused_step as fused_step
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    prompts = [c.tokens[:c.prompt_len] for c in held_out[:6]]
    params = [{"temperature": 0.8, "max_new_tokens": 12 + i, "ignore_eos": True, "seed": 7 + i} for i in range(6)]
    with tiny_engine(path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    rules, verify = [], fused_step.verify_sampling

    def spy(trees, logits, *args, rule, **kwargs):
        rules.append((rule, args[-1] is not None))   # the last positional argument: draft_probs
        return verify(trees, logits, *args, rule=rule, **kwargs)
    monkeypatch.setattr(fused_step, "verify_sampling", spy)
    with tiny_engine(path, **eagle_args(algorithm, head_path, speculative_num_steps=3, speculative_eagle_topk=2,
                                        speculative_num_draft_tokens=6)) as engine:
        if ahead:
            ahead_on(engine)
        steps = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        unseeded = engine.generate(input_ids=prompts,
                                   sampling_params={"temperature": 0.8, "max_new_tokens": 12, "ignore_eos": True})
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert [len(o["output_ids"]) for o in unseeded] == [12] * 6
    assert set(rules) == {("coupled", False)}
    assert steps.engine == 0 and steps.fused > 0 and (steps.chained > 0) == ahead, vars(steps)
    assert max(n for o in outputs for n in o["meta_info"]["spec_accept_histogram"]) > 1   # drafts were accepted
