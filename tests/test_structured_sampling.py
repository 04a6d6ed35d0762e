"""Sampling under a grammar with speculation follows the masked target distribution: on the
random-weight 16-token model of test_spec_sampling.py, the first four tokens sampled with
NGRAM draft trees under an EBNF grammar follow p(x_k | x_<k) restricted to the tokens the
grammar allows after x_<k> and renormalised, computed exactly by enumeration with the
grammar's rule written out by hand (not through xgrammar), and checked with a chi-square
test. A control rejects the same samples against the unmasked-then-masked distribution at
another temperature. Greedy output under the grammar equals plain decoding's."""
from __future__ import annotations

import pytest
import torch

from tests.spec_fixtures import ProposeSpy, ngram_args, tiny_engine, wait_until_all_kv_is_free
from tests.test_spec_sampling import (MAX_NEW_TOKENS, PROMPT, VOCAB, chi_square_p, exact_step_logits,
                                     model_dir)  # noqa: F401 (a fixture: the same random 16-token model)

SAMPLES = 4000
ALPHA = 1e-4
# letters a..m are token ids 3..15: pairs of (a-d then e-m) or (e-h then a-d), at least three
GRAMMAR = 'root ::= pair pair pair pair*\npair ::= [a-d] [e-m] | [e-h] [a-d]'
A_TO_D, E_TO_H, E_TO_M = range(3, 7), range(7, 11), range(7, 16)


def allowed(prefix: tuple[int, ...]) -> list[int]:
    """The grammar's rule by hand: the tokens allowed after `prefix` (a valid one)."""
    if len(prefix) % 2 == 0:
        return [*A_TO_D, *E_TO_H]
    return list(E_TO_M) if prefix[-1] in A_TO_D else list(A_TO_D)


def grammar_mask(k: int) -> torch.Tensor:
    """(V,) * k + (V,) bool: the tokens allowed as token k+1 after x1..xk (the axes); the
    rule reads only x_k and k's parity."""
    mask = torch.zeros((VOCAB,) * k + (VOCAB,), dtype=torch.bool)
    for last in range(VOCAB):
        prefix = (last,) * k   # only the length and the last token matter
        index = (slice(None),) * (k - 1) + (last,) if k else ()
        mask[index + (allowed(prefix),)] = True
    return mask


def masked_joint(step_logits: list[torch.Tensor], temperature: float) -> torch.Tensor:
    joint = torch.ones(())
    for k, logits in enumerate(step_logits):
        probs = torch.softmax(logits / temperature, dim=-1) * grammar_mask(k)
        joint = joint.unsqueeze(-1) * (probs / probs.sum(-1, keepdim=True))
    assert abs(joint.sum().item() - 1) < 1e-9
    return joint


@pytest.fixture(scope="module")
def runs(model_dir) -> dict:
    drafter = ngram_args(4, speculative_ngram_min_bfs_breadth=2, speculative_ngram_max_bfs_breadth=2)
    params = [{"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "seed": i, "ebnf": GRAMMAR}
              for i in range(SAMPLES)]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "ebnf": GRAMMAR}
    with tiny_engine(model_dir[0], **drafter, max_running_requests=1024) as engine:
        spy = ProposeSpy(engine.core.drafter)
        verified = spy_verified_trees(engine.core.runner)
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        spec_greedy = engine.generate(input_ids=PROMPT, sampling_params=greedy)
        wait_until_all_kv_is_free(engine)
    with tiny_engine(model_dir[0]) as engine:
        plain_greedy = engine.generate(input_ids=PROMPT, sampling_params=greedy)
    return {"outputs": outputs, "spy": spy, "verified": verified, "spec greedy": spec_greedy,
            "plain greedy": plain_greedy}


def spy_verified_trees(runner) -> list[tuple[list[int], list[int], list[int]]]:
    """Records each verified tree of a sampled request as (the request's output before the step,
    tokens, parents): only those are pruned (a greedy path is kept to its grammar after the step)."""
    trees, original = [], runner.run_trees

    def run_trees(reqs, proposal, *args, **kwargs):
        for row, req in enumerate(reqs):
            count = int(proposal.num_nodes[row])
            if count > 1 and not req.params.greedy:
                trees.append((list(req.output_ids), proposal.tokens[row, :count].tolist(),
                              proposal.parents[row, :count].tolist()))
        return original(reqs, proposal, *args, **kwargs)

    runner.run_trees = run_trees
    return trees


def test_samples_follow_the_masked_distribution(runs, model_dir):
    outputs = runs["outputs"]
    assert all(len(out["output_ids"]) == MAX_NEW_TOKENS for out in outputs)
    step_logits = exact_step_logits(model_dir[1])
    p = chi_square_p(outputs, masked_joint(step_logits, 1.0))
    assert p > ALPHA, p
    # power: the same samples against another temperature's masked distribution
    assert chi_square_p(outputs, masked_joint(step_logits, 1.3)) < ALPHA


def test_drafts_were_pruned_then_verified(runs):
    """Every node of every verified tree is a token the grammar allows on its path; the trie
    proposed more (forbidden drafts went before the step); drafts were accepted."""
    verified = runs["verified"]
    assert verified
    for output, tokens, parents in verified:
        for node in range(1, len(tokens)):
            path, at = [], node
            while at > 0:
                path.append(tokens[at])
                at = parents[at]
            path.reverse()
            assert path[-1] in allowed(tuple(output + path[:-1])), (output, tokens, parents)
    verified_nodes = sum(len(tokens) - 1 for _, tokens, _ in verified)
    assert runs["spy"].drafted_nodes > verified_nodes > 0
    accepted = sum(out["meta_info"]["spec_accept_length"] > 1 for out in runs["outputs"])
    assert accepted > 0.05 * SAMPLES


def test_greedy_under_the_grammar_equals_plain(runs):
    spec, plain = runs["spec greedy"], runs["plain greedy"]
    assert spec["output_ids"] == plain["output_ids"]
    ids = plain["output_ids"]
    assert all(ids[k] in allowed(tuple(ids[:k])) for k in range(len(ids)))
