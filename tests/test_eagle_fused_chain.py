"""EAGLE / EAGLE3 chains of K drafts (top-k 1) through the fused step (speculative/model_drafters/fused_step.py):
one device function verifies the chain, commits the accepted path and drafts the next K
tokens. With heads our trainer made (tests/test_eagle_drafter.py's fixtures, both kinds),
greedy output equals plain decoding and every request's verify steps are exactly those the
trainer's accept-length replay predicts for chains of K, for K = 1 (EAGLE's, and NAIVE_EAGLE,
the same code), 2 and 3, one request at a
time and several of different lengths together: which holds only if the fused step feeds
the head the rows, target states, tokens and positions training does, its draft steps
included, after any accept length. Every step is fused after each request's first drafts;
the head's cache and the pending drafts are all freed, also after preemption and aborts
with an untrained head, whose drafts get rejected at every depth.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_eval import accepted_runs, replay_decoding
from tests.fused_fixtures import FusedSpy, fused_args, save_random_eagle_head, wait_until_fused_state_is_free
from tests.spec_fixtures import make_tiny_directory, tiny_engine
from tests.test_draft_ahead import ahead_on
from tests.test_eagle_drafter import head_dir, target  # noqa: F401  (a target and heads trained on it)

GREEDY = {"temperature": 0.0, "max_new_tokens": 32}


def accept_histogram(outputs: list[dict]) -> Counter:
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    return histogram


def chain_args(algorithm: str, head_path, num_steps: int, naive: bool = False) -> dict:
    """A fused chain of num_steps drafts: EAGLE / EAGLE3's, or NAIVE_EAGLE's (one draft, a
    head of either kind)."""
    if naive:
        return fused_args("NAIVE_EAGLE", head_path)
    return fused_args(algorithm, head_path, speculative_num_steps=num_steps)


CHAINS = [(1, True), (1, False), (2, False), (3, False)]     # (K, NAIVE_EAGLE)
CHAIN_IDS = ["naive", "K1", "K2", "K3"]


@pytest.mark.parametrize("max_running,ahead", [(1, False), (8, False), (8, True)], ids=["bs1", "bs8", "bs8-ahead"])
@pytest.mark.parametrize("num_steps,naive", CHAINS, ids=CHAIN_IDS)
def test_greedy_verify_steps_are_what_training_predicts(target, head_dir, num_steps, naive, max_running,  # noqa: F811
                                                        ahead):
    """`ahead`: as on a GPU, each greedy fused step is launched right after the previous
    one's commit, before its bookkeeping (engine/draft_ahead.py), and nothing changes."""
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = head_dir
    args = chain_args(algorithm, head_path, num_steps, naive)
    with tiny_engine(path, max_running_requests=max_running, **args) as engine:
        if ahead:
            ahead_on(engine)
        drafter = engine.core.drafter
        assert drafter.fused.nodes == num_steps + 1
        spy, held = FusedSpy(drafter), HeadRowsSpy(drafter)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_fused_state_is_free(engine)
        assert not ahead or engine.core.draft_ahead.steps_taken > 0
    # pinned drafting with the step ahead: fused steps are queued before the step they follow is read
    assert (spy.chained > 0) == ahead, spy.chained
    assert spy.engine == 0 and spy.fused == sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    assert not held.excess, held.excess
    # one catch-up per request that decodes at all, then every draft came from a fused step
    assert spy.first_drafts == sum(o["meta_info"]["spec_verify_ct"] > 0 for o in outputs)
    batch = BatchBuilder(extractor, None, bool(head.config.aux_layers))(held_out).conversations
    with torch.no_grad():
        runs = accepted_runs(head, batch, num_steps).cpu()
    for row, (conversation, output) in enumerate(zip(held_out, outputs)):
        replay = replay_decoding(runs[row:row + 1], [len(conversation.tokens)], [conversation.prompt_len])
        assert output["meta_info"]["spec_verify_ct"] == replay.verify_steps, f"conversation {row}"
    assert set(accept_histogram(outputs)) == set(range(1, num_steps + 2))     # every accept length


@pytest.mark.parametrize("num_steps,naive,ahead,topk", [(1, True, False, 1), (2, False, False, 1), (3, False, False, 1),
                                                        (3, False, True, 1), (3, False, True, 2)],
                         ids=["naive", "K2", "K3", "K3-ahead", "K3-tree-ahead"])
def test_an_untrained_head_keeps_greedy_output_and_frees_everything(tmp_path, num_steps, naive, ahead, topk):
    """A 256-token target and a random head over half its vocabulary (every draft
    rejected): batches, preemption (a small cache), an abort, penalised and sampled
    requests in the same batches (the engine verifies those); the head never holds more
    than its requests' rows and the fused steps' reserved rows. topk 2: EAGLE-2's trees of 6."""
    target_path, head_path = tmp_path / "target", tmp_path / "head"
    make_tiny_directory(target_path, "qwen2", seed=1)
    save_random_eagle_head(target_path, head_path, draft_vocab=torch.arange(0, 256, 2))
    prompts = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    penalised = {**greedy, "repetition_penalty": 1.3}
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
        expected_penalised = plain.generate(input_ids=prompts[0], sampling_params=penalised)["output_ids"]
    tree = {"speculative_eagle_topk": topk, "speculative_num_draft_tokens": 6} if topk > 1 else {}
    with tiny_engine(target_path, max_total_tokens=160, **chain_args("EAGLE3", head_path, num_steps, naive),
                     **tree) as engine:
        if ahead:
            ahead_on(engine)
        drafter = engine.core.drafter
        spy, held = FusedSpy(drafter), HeadRowsSpy(drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outputs] == expected
        assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0 and spy.fused > 0
        stream = engine.generate(input_ids=prompts[1], sampling_params={**greedy, "max_new_tokens": 60}, stream=True)
        next(iter(stream))
        stream.close()     # aborts it
        mixed = engine.generate(input_ids=prompts[:3], sampling_params=[
            penalised, {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}, greedy])
        assert mixed[0]["output_ids"] == expected_penalised and mixed[2]["output_ids"] == expected[2]
        assert len(mixed[1]["output_ids"]) == 20
        wait_until_fused_state_is_free(engine)
    assert spy.engine > 0 and held.steps > 0 and not held.excess, held.excess
    assert (spy.chained > 0) == ahead, spy.chained
    histogram = accept_histogram(outputs)
    assert set(histogram) == {1}      # every first draft rejected: the junk rows are all but the first


@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_preemption_and_aborts_with_every_accept_length(target, head_dir, ahead, tree):  # noqa: F811
    """The trained heads (accept lengths 1 .. K + 1) and a cache too small for the batch:
    requests are preempted and resumed (their head cache rebuilt from their prefill's
    states), one is aborted mid-stream; output stays plain decoding's and everything is
    freed, also with fused steps launched ahead (a step ahead is dropped or retired when
    the batch changes), for chains of 3 and EAGLE-2's trees of depth 3."""
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    prompts = [c.tokens[:c.prompt_len] for c in held_out]
    with tiny_engine(path, max_total_tokens=150, **fused_args(algorithm, head_path, speculative_num_steps=3,
                                                              **tree)) as engine:
        if ahead:
            ahead_on(engine)
        drafter = engine.core.drafter
        spy, held = FusedSpy(drafter), HeadRowsSpy(drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        stream = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "ignore_eos": True}, stream=True)
        next(iter(stream))
        next(iter(stream))
        stream.close()     # aborts it between fused steps
        wait_until_fused_state_is_free(engine)
    assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
    assert spy.fused > 0 and held.steps > 0 and not held.excess, held.excess
    assert (spy.chained > 0) == ahead, spy.chained
    assert set(accept_histogram(outputs)) == {1, 2, 3, 4}


class HeadRowsSpy:
    """After each fused step: the head's cache holds, per request, its committed rows and the
    step's reserved rows, nothing more; the rows the step fed count as committed only at the
    next sync, which keeps those of the committed tokens and frees the others. The head's
    table holds the slots of the rows committed then: the earlier rows' written by earlier
    steps, the step's own by the step itself (fused_step.write_head_table), not by the host."""

    def __init__(self, drafter):
        self.steps, self.excess = 0, []
        read_fused = drafter.read_fused
        table, fanout = drafter.fused.head.pool.req_to_token, drafter.kv.row_fanout   # (a tree's beams: fanout rows)

        def read(reqs, *args):
            outcome = read_fused(reqs, *args)
            self.steps += 1
            for req, tokens in zip(reqs, outcome.tokens):
                seq = drafter.kv.sequences[req.rid]
                rows = drafter.kv.rows_of(req)     # before the commit: L - 1
                if seq.committed != rows or len(seq.slots) != rows + drafter.reserved_rows:
                    self.excess.append((req.rid, rows, seq.committed, len(seq.slots)))
                # the rows this step leaves committed (a step chained after it, launched before this
                # read, has written its own reserved rows' entries past them already)
                fed = rows + len(tokens)
                for beam in range(seq.row * fanout, (seq.row + 1) * fanout):
                    if table[beam, :fed].tolist() != seq.slots[:fed]:
                        self.excess.append((req.rid, beam, "head table", table[beam, :fed].tolist(), seq.slots[:fed]))
            assert not drafter.kv._new_entries, "the fused rows' table entries are the step's to write"
            return outcome
        drafter.read_fused = read


def test_fused_inputs_rewrite_the_request_columns_only_for_another_batch():
    """A graph's host buffer keeps the per-request columns (head rows, sampling parameters)
    of the batch it last held: the same requests skip them, other requests (same count) or
    other head rows rewrite them; padding rows keep the padding values."""
    from types import SimpleNamespace

    from specserve.speculative.model_drafters.fused_step import FusedStepInputs
    from specserve.speculative.model_drafters.model_proposals import chain_proposal

    def request(row, temperature):
        params = SimpleNamespace(top_k=0, greedy=temperature == 0, temperature=temperature, top_p=0.9, min_p=0.0,
                                 seed=None)
        return SimpleNamespace(row=row, kv_len=10 + row, seed=row, params=params)

    inputs = FusedStepInputs.allocate(4, 3, 4, "cpu")
    proposal, _ = chain_proposal([3, 3], [1, 2], [0, 1], [[5, 6], [7, 8]], None, 2)
    head_slots = np.arange(8).reshape(2, 4)
    greedy, sampled = [request(0, 0.0), request(1, 0.0)], [request(0, 0.7), request(1, 0.5)]
    for reqs, head_rows, temperatures in [(greedy, [0, 1], [0.0, 0.0]), (sampled, [0, 1], [0.7, 0.5]),
                                          (sampled, [2, 1], [0.7, 0.5]), (greedy, [2, 1], [0.0, 0.0])]:
        inputs.fill(reqs, proposal, np.zeros((2, 3), dtype=np.int64), head_slots, head_rows, (9, 8), 256)
        assert inputs.temperatures.tolist() == temperatures + [0.0, 0.0]
        assert inputs.draft_temperatures.tolist() == temperatures + [0.0, 0.0]
        assert inputs.head_rows.tolist() == head_rows + [8, 8] and inputs.top_ks.tolist() == [256, 256, 0, 0]
        assert inputs.head_slots[:2].tolist() == head_slots.tolist() and not inputs.head_slots[2:].any()
    inputs.temperatures.fill_(-1.0)     # the same batch again: the columns are not rewritten
    inputs.fill(greedy, proposal, np.zeros((2, 3), dtype=np.int64), head_slots, [2, 1], (9, 8), 256)
    assert inputs.temperatures.tolist() == [-1.0] * 4


def test_a_chained_step_takes_the_kept_requests_and_the_outcome_s_drafts():
    """fused_step.cut_rows then chain_inputs, as a step launched before the one it follows is
    read: the requests the last step did not end keep every field of theirs (the rest turn
    into padding requests), and each gets its last committed token as root, the step's K next
    drafts as chain and a prefix longer by its accept length."""
    from types import SimpleNamespace

    from specserve.kv.pool import PADDING_SLOT
    from specserve.speculative.model_drafters.fused_chain import kept_rows
    from specserve.speculative.model_drafters.fused_step import FusedStepInputs, chain_inputs, cut_rows
    from specserve.speculative.model_drafters.model_proposals import chain_proposal

    n, k = 3, 2
    source = FusedStepInputs.allocate(3, n, 2 * k, "cpu")
    source.tree.prefix_lens[:] = torch.tensor([10, 20, 30])
    source.tree.req_rows[:] = torch.tensor([4, 5, 6])
    source.head_rows[:] = torch.tensor([7, 8, 9])
    source.seeds[:] = torch.tensor([1, 2, 3])
    source.top_ps[:] = torch.tensor([0.5, 0.6, 0.7], dtype=torch.float64)
    reqs = [object(), object(), object()]
    assert kept_rows(reqs, [reqs[0], reqs[2]]) == [0, 2] and kept_rows(reqs, [reqs[2], reqs[0]]) is None
    # outcome rows: accept length, accepted nodes (n), committed tokens (n), next drafts (k)
    outcome = torch.tensor([[2, 0, 1, -1, 11, 12, -1, 13, 14],
                            [1, 0, -1, -1, 21, -1, -1, 23, 24],
                            [3, 0, 1, 2, 31, 32, 33, 35, 36]])
    rows = torch.tensor([0, 2])
    target = FusedStepInputs.allocate(3, n, 2 * k, "cpu")
    cut_rows(source, rows, target, (99, 98))
    chain_inputs(target, outcome.index_select(0, rows), torch.tensor([[40, 41, 42], [50, 51, 52]]),
                 torch.arange(8).view(2, 4))
    tree = target.tree
    assert tree.tokens.tolist() == [[12, 13, 14], [33, 35, 36], [0, 0, 0]]
    assert tree.prefix_lens.tolist() == [12, 33, 0] and tree.num_nodes.tolist() == [3, 3, 1]
    assert tree.parents.tolist() == [[-1, 0, 1], [-1, 0, 1], [-1, -1, -1]]
    assert tree.out_slots.tolist() == [[40, 41, 42], [50, 51, 52], [PADDING_SLOT] * 3]
    assert tree.req_rows.tolist() == [4, 6, 99] and target.head_rows.tolist() == [7, 9, 98]
    assert target.head_slots.tolist()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and target.seeds.tolist() == [1, 3, 0]
    assert target.top_ps.tolist() == [0.5, 0.7, 1.0]
    # the padding cut_rows writes is what fill writes
    host = FusedStepInputs.allocate(3, n, 2 * k, "cpu")
    request = SimpleNamespace(row=4, kv_len=10, seed=1, params=SimpleNamespace(
        top_k=0, greedy=True, temperature=0.0, top_p=1.0, min_p=0.0, seed=None))
    proposal, _ = chain_proposal([3], [1], [0], [[5, 6]], None, 2)
    host.fill([request], proposal, np.arange(3).reshape(1, 3), np.arange(4).reshape(1, 4), [7], (99, 98), 512)
    for field, padding in zip(host.request_fields(), FusedStepInputs.padding((99, 98))):
        assert (field[1:] == padding).all()


def test_a_chained_tree_step_takes_the_outcome_s_tree():
    """chain_inputs after a fused tree step (EAGLE-2's top-k > 1): the next tree's tokens and
    parents come from the outcome, behind the last committed token as root."""
    from specserve.speculative.model_drafters.fused_step import FusedStepInputs, chain_inputs

    n = 4   # the tree's nodes: the outcome is accept length, accepted (n), committed (n), tokens (n - 1), parents (n - 1)
    inputs = FusedStepInputs.allocate(2, n, 8, "cpu")
    inputs.tree.prefix_lens[:] = torch.tensor([10, 20])
    outcome = torch.tensor([[2, 0, 2, -1, -1, 11, 12, -1, -1, 15, 16, 17, 0, 0, 1],
                            [1, 0, -1, -1, -1, 21, -1, -1, -1, 25, 26, 27, 0, 1, 2]])
    chain_inputs(inputs, outcome, torch.arange(8).view(2, 4), torch.arange(16).view(2, 8), trees=True)
    tree = inputs.tree
    assert tree.tokens.tolist() == [[12, 15, 16, 17], [21, 25, 26, 27]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 2]]
    assert tree.prefix_lens.tolist() == [12, 21] and tree.num_nodes.tolist() == [4, 4]
